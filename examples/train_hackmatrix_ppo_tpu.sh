#!/usr/bin/env bash
# HackMatrix PPO on a TPU v4-16 slice (2 hosts x 4 chips) of cluster/gcp-tpu-v4.yaml, one JAX
# process per host under Ray Train's JaxTrainer, jax.distributed across both:
#   ray up cluster/gcp-tpu-v4.yaml && ray dashboard cluster/gcp-tpu-v4.yaml   # tunnel to 8265
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
#       --runtime-env cluster/runtime_env.yaml -- bash examples/train_hackmatrix_ppo_tpu.sh
# The head has no TPU: JaxTrainer asks for the slice's TPU-v4-16-head resource, so the autoscaler
# starts a slice if none is up. The env batch (NUM_ENVS, a multiple of the 8 chips) is sharded
# over all chips of both hosts. PRESET=seed_fast selects the seed's 2048 x 256 with minibatch
# scaling (docs/benchmarks.md measures what it costs in learning). Rank 0 writes checkpoints and
# every host reads them on resume, so STORAGE must be a folder all hosts share (NFS, GCS FUSE).
# Without a TPU, JAX_PLATFORMS_OVERRIDE=cpu runs the same job on the hosts' CPUs.
set -euo pipefail
python -m raysys train hackmatrix_ppo --preset "${PRESET:-default}" \
    --set launch.workers="${HOSTS:-2}" --set launch.use_tpu=true \
    --set launch.topology="${TOPOLOGY:-2x2x2}" --set launch.accelerator_type="${ACCELERATOR:-TPU-V4}" \
    --set launch.jax_platforms="${JAX_PLATFORMS_OVERRIDE:-}" \
    --set train.num_envs="${NUM_ENVS:-2048}" --set train.precision="${PRECISION:-bf16}" \
    --storage-path "${STORAGE:-$HOME/raysys_runs}" \
    --name "${RUN_NAME:-hackmatrix-ppo-tpu-$(date +%Y%m%d-%H%M%S)}" "$@"
