#!/usr/bin/env bash
# A speed/quality sweep of Deep-GPCM: the Pareto front of throughput vs QWK, with a recommendation.
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
#       -- bash examples/sweep_deep_gpcm.sh
set -euo pipefail
python -m raysys.tune --space tune_spaces/deep_gpcm.yaml --num-samples "${SAMPLES:-6}" "$@"
