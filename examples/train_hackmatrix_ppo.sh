#!/usr/bin/env bash
# HackMatrix PPO in JAX (or locally: drop the `ray job submit ... --` prefix).
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
#       --runtime-env cluster/runtime_env.yaml --entrypoint-num-gpus 1 -- bash examples/train_hackmatrix_ppo.sh
# One process uses every device JAX sees (the env batch is sharded over them); the seed's
# speed settings are the seed_fast preset (2048 envs x 256 steps, minibatch scaling).
set -euo pipefail
python -m raysys train hackmatrix_ppo --preset "${PRESET:-learn}" \
    --set train.num_envs="${NUM_ENVS:-256}" --set train.precision="${PRECISION:-fp32}" \
    --name "${RUN_NAME:-hackmatrix-ppo-$(date +%Y%m%d-%H%M%S)}" "$@"
