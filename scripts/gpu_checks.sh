#!/usr/bin/env bash
# Every GPU check and bench the open issues ask for, for a session that is lent a GPU machine.
#
# Here, once:   bash ../shared/devkit/build.sh            (writes .devkit/, the wheels the device lacks)
# On the device, in two calls of under 10 minutes each (device `run` with carry [".devkit"]):
#   source .devkit/install-on-device.sh && bash scripts/gpu_checks.sh a     # tests, deep_gpcm, mpn_dqn
#   source .devkit/install-on-device.sh && bash scripts/gpu_checks.sh b     # hackmatrix_ppo, pointer_generator, ad_transformer
# Each step has its own time limit, so one slow step cannot use up a call; logs and JSON land in
# $OUT (they come back). Then record the figures in docs/benchmarks.md with the device named.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export RAY_ADDRESS=local
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX next to torch in one process: take memory as needed

step() {  # step NAME SECONDS COMMAND...: run with a limit, keep its log, go on whatever it returns
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? ; last lines:"
  tail -n 12 "$OUT/$name.log" | sed 's/^/   /'
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "${1:-a}" in
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
  *)
    echo "usage: bash scripts/gpu_checks.sh a|b" >&2
    exit 2
    ;;
esac
