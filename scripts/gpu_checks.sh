#!/usr/bin/env bash
# Every GPU check and bench the open issues ask for, for a session that is lent a GPU machine.
#
# The device has no network and lacks some of raysys's packages, and what travels to it must stay
# under 64 MiB, so each of the two device calls gets its own kit (devkit plus that group's extras):
#   here:       bash scripts/gpu_checks.sh kit a        (or kit b; ~1 minute, rebuilds .devkit/)
#   on device:  rm -rf /tmp/site; source .devkit/install-on-device.sh && bash scripts/gpu_checks.sh a
#               (a device `run` with carry [".devkit"], under 10 minutes; the rm makes a warm machine
#               install this call's kit, not keep the previous one)
#   a: pytest -m gpu, the deep_gpcm and mpn_dqn benches (extras: neurogym and its needs)
#   b: the hackmatrix_ppo, pointer_generator and ad_transformer benches (sentencepiece, rouge-score;
#      without the SQL store's wheels, which these benches do not use, to stay under 64 MiB)
#   all [STEP...]: one call for a session with little device time (`kit all`: kit a plus nltk and
#      rouge-score): the three benches the issues' figures come from, the GPU tests (7 at once where
#      pytest-xdist is there), then pointer_generator's bench; or the STEPs named, in that order.
#      GPU_CHECKS_BUDGET_S bounds the whole call (default 560 s); one archive, gpu_checks.tgz, comes back.
#      The call exits 3 at once where torch sees no CUDA, and 1 where any step failed, was cut or skipped.
#      On an H200 (2026-11-26) these took ~55, ~220, ~150 and ~140 s: all of them in one 10-minute call
#      is tight, so name the steps a session needs (e.g. `all deep_gpcm tests`). Shorter steps for
#      the issue's figures alone: deep_gpcm_256 (~45 s), hackmatrix_8192 (fp32 and bf16, ~120 s),
#      hackmatrix_8192_xla (bf16 under other XLA_FLAGS), hackmatrix_8192_nobarriers (bf16, the env's
#      optimization barriers off on the GPU), hackmatrix_8192_aligned (bf16, model.feature_align=16), population_32 (#17: 32 members x 256 envs as one program
#      vs one alone, fp32 and bf16); GPU_TESTS_K="expr" runs some GPU tests only
# Each step has its own time limit, so one slow step cannot use up a call; logs and JSON land in
# $OUT (they come back). Then record the figures in docs/benchmarks.md with the device named.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export RAY_ADDRESS=local
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX next to torch in one process: take memory as needed

# the whole call's time: no step runs past it (default: under the device's 600 s a command, so the
# archive at the end is always made)
DEADLINE=$(( $(date +%s) + ${GPU_CHECKS_BUDGET_S:-560} ))
FAILED=()  # the steps that did not exit 0 (or were skipped for time): the call's exit status says so
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep its log, go on whatever it returns
  local name=$1 limit=$2 left=$(( DEADLINE - $(date +%s) )) rc
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "== $name: skipped, the call's time is spent"; FAILED+=("$name(skipped)"); return; fi
  echo "== $name ($(date +%T), up to ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   exit $rc ; last lines:"
  tail -n 12 "$OUT/$name.log" | sed 's/^/   /'
  [ "$rc" -eq 0 ] || FAILED+=("$name(exit $rc)")
}

run_tests() {  # the -m gpu tests, 7 at once where pytest-xdist is there (each starts its own Ray; ~140 s on an H200)
  local par=() sel=(); python3 -c "import xdist" 2>/dev/null && par=(-n 7)
  [ -n "${GPU_TESTS_K:-}" ] && sel=(-k "$GPU_TESTS_K")  # some of them only (a rerun after a fix)
  step gpu-tests 200 python -m pytest -q -m gpu -p no:cacheprovider "${par[@]}" "${sel[@]}" tests/test_gpu.py tests/test_train_knobs.py
}

EXTRA_A="neurogym==2.3.1 pydantic-settings==2.14.1 loguru==0.7.3 tomlkit==0.15.2 natsort==8.4.0"
EXTRA_B="sentencepiece==0.2.3 nltk==3.10.4 absl-py==2.5.1 regex==2026.5.9 joblib==1.6.0 click==8.4.0 tqdm==4.70.1 six==1.17.0"
if [ "${1:-}" = kit ]; then  # here, not on the device
  case "${2:-}" in
    a) EXTRA="$EXTRA_A" DL=$(mktemp -d) bash ../shared/devkit/build.sh ;;
    # b's benches open no MLflow store: its SQL and crypto wheels make room for the text packages
    b) EXTRA="$EXTRA_B" DL=$(mktemp -d) bash ../shared/devkit/build.sh \
         && rm -f .devkit/sqlalchemy-*.whl .devkit/cryptography-*.whl \
         && python -m pip wheel -q --no-deps rouge-score==0.1.2 -w .devkit ;;  # an sdist only: built here, pure Python
    # the device image has sentencepiece, absl, regex, joblib, click and tqdm: nltk and rouge-score make the text benches run
    all) EXTRA="$EXTRA_A" DL=$(mktemp -d) bash ../shared/devkit/build.sh \
           && python -m pip download -q --no-deps nltk==3.10.4 -d .devkit \
           && python -m pip wheel -q --no-deps rouge-score==0.1.2 -w .devkit ;;
    *) echo "usage: bash scripts/gpu_checks.sh kit a|b|all" >&2; exit 2 ;;
  esac
  exit $?
fi

case "${1:-}" in
  a|b|all) ;;
  *) echo "usage: bash scripts/gpu_checks.sh a|b|all [STEP...]   (here first: bash scripts/gpu_checks.sh kit a|b|all)" >&2
     exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# the GPU tests skip where torch sees no GPU, and the benches fall back to the CPU: without CUDA every
# figure would be a CPU's, so the call stops here, in seconds, saying so
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_checks: torch here sees no CUDA device (torch $(python3 -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)): nothing run" >&2
  exit 3
fi
case "$1" in
  a)
    step gpu-tests 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_train_knobs.py
    step bench-deep_gpcm 150 python -m raysys.bench deep_gpcm --quick --device cuda --json "$OUT/bench_deep_gpcm_cuda.json"
    step bench-mpn_dqn 180 python -m raysys.bench mpn_dqn --quick --device cuda --json "$OUT/bench_mpn_dqn_cuda.json"
    ;;
  b)
    step bench-hackmatrix_ppo 240 python -m raysys.bench hackmatrix_ppo --quick --device cuda --json "$OUT/bench_hackmatrix_ppo_cuda.json"
    step bench-pointer_generator 150 python -m raysys.bench pointer_generator --quick --device cuda --json "$OUT/bench_pointer_generator_cuda.json"
    step bench-ad_transformer 120 python -m raysys.bench ad_transformer --quick --device cuda --json "$OUT/bench_ad_transformer_cuda.json"
    ;;
  all)  # all [STEP...]: these steps in this order (default: deep_gpcm hackmatrix_ppo mpn_dqn tests pointer_generator)
    steps=("${@:2}"); [ ${#steps[@]} -eq 0 ] && steps=(deep_gpcm hackmatrix_ppo mpn_dqn tests pointer_generator)
    for s in "${steps[@]}"; do  # limits: what each took on an H200 (2026-11-26), plus a margin
      case $s in
        tests) run_tests; continue ;;
        hackmatrix_8192)  # the issue's width alone, fp32 and bf16, with where the time goes (~2 minutes)
          step hackmatrix-8192 200 python -m raysys.workloads.hackmatrix_ppo.bench --profile 8192 --precision fp32 bf16
          continue ;;
        hackmatrix_8192_xla)  # the same at bf16 under other XLA flags: CUDA graphs over the loop bodies by default
          # (a step is ~380 small kernels, launch-bound; HACKMATRIX_XLA_FLAGS replaces the flags tried)
          step hackmatrix-8192-xla 150 env XLA_FLAGS="${HACKMATRIX_XLA_FLAGS:---xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL}" \
            python -m raysys.workloads.hackmatrix_ppo.bench --profile 8192 --precision bf16
          continue ;;
        hackmatrix_8192_nobarriers)  # bf16 without the env's optimization barriers on the GPU (90 kernels a rollout step, not 104)
          step hackmatrix-8192-nobarriers 150 python -m raysys.workloads.hackmatrix_ppo.bench --profile 8192 --precision bf16 --gpu-barriers off
          continue ;;
        hackmatrix_8192_aligned)  # bf16 with model.feature_align=16: 1,552-wide rows, 32-byte aligned, for the matmuls
          step hackmatrix-8192-aligned 150 python -m raysys.workloads.hackmatrix_ppo.bench --profile 8192 --precision bf16 --feature-align 16
          continue ;;
        population_32)  # #17's figure alone: 32 members x 256 envs as one program vs one member, fp32 and bf16 (~2.5 minutes)
          step population-32 220 python -m raysys.workloads.hackmatrix_ppo.bench --population 32 --precision fp32 bf16
          continue ;;
        deep_gpcm_256)  # the issue's step alone: B=256, T=399, every variant, and the profile (~1 minute)
          step deep_gpcm-256 120 python -m raysys.workloads.deep_gpcm.bench --batch 256
          continue ;;
        deep_gpcm) limit=120 ;;
        hackmatrix_ppo) limit=300 ;;
        mpn_dqn) limit=190 ;;  # its JSON is written at its end: a cut step loses everything
        pointer_generator|ad_transformer) limit=100 ;;
        *) FAILED+=("$s(unknown)"); echo "unknown step $s (deep_gpcm hackmatrix_ppo mpn_dqn tests pointer_generator ad_transformer" \
                "hackmatrix_8192 hackmatrix_8192_xla hackmatrix_8192_nobarriers hackmatrix_8192_aligned population_32 deep_gpcm_256)"; continue ;;
      esac
      step "bench-$s" "$limit" python -m raysys.bench "$s" --quick --device cuda --json "$OUT/bench_${s}_cuda.json"
    done
    # the device tool returns at most 8 files: one archive holds every log and JSON
    (cd "$OUT" && tar czf gpu_checks.tgz --remove-files ./*.log ./*.json device.txt 2>/dev/null; ls -l)
    ;;
esac
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_checks: not every step passed: ${FAILED[*]}" >&2
  exit 1
fi
