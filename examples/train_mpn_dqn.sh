#!/usr/bin/env bash
# MPN-DQN on NeuroGym with Ray rollout actors (or locally: drop the `ray job submit ... --` prefix).
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
#       --runtime-env cluster/runtime_env.yaml -- bash examples/train_mpn_dqn.sh
# The seed's fast command (sequence batch 64, train-freq 4) with collection on ACTORS Ray actors
# x ENVS envs each; the learner runs in the job's driver (DEVICE=cuda puts it on a GPU).
set -euo pipefail
python -m raysys train mpn_dqn --preset default \
    --set num_actors="${ACTORS:-2}" --set envs_per_actor="${ENVS:-4}" --set num_episodes="${EPISODES:-200}" \
    --set device="${DEVICE:-auto}" --experiment "${EXPERIMENT:-fast-sequence-test}" \
    --name "${RUN_NAME:-mpn-dqn-$(date +%Y%m%d-%H%M%S)}" "$@"
