#!/usr/bin/env bash
# Deep-GPCM on a Ray cluster (or locally: drop the `ray job submit ... --` prefix).
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
#       -- bash examples/train_deep_gpcm.sh
# Inside a job $RAY_ADDRESS is set, so the run joins the cluster; set RAYSYS_TRACKING_URI to a
# shared MLflow server (cluster/README.md) or the runs land in the job's working dir.
set -euo pipefail
python -m raysys train deep_gpcm --preset default --workers "${WORKERS:-2}" \
    --set train.precision="${PRECISION:-fp32}" --name "${RUN_NAME:-deep-gpcm-$(date +%Y%m%d-%H%M%S)}" "$@"
