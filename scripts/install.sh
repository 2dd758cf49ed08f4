#!/usr/bin/env bash
# Installs raysys and everything it needs into the current Python environment.
# Order matters: torch first (so a range never pulls a multi-GB CUDA build), then raysys with its
# pins, then neurogym without its own pins (gymnasium 0.29 / numpy 2.2 / matplotlib 3.10 clash
# with ray[rllib]'s gymnasium 1.2.2; docs/dependencies.md records neurogym's own suite against these versions
# and why the parts raysys uses are unaffected).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --disable-pip-version-check -q"
$PIP "torch==2.13.0" || $PIP torch
$PIP -e ".[test]"
$PIP --no-deps "neurogym==2.3.1"
# The MLflow UI browser test (tests/test_mlflow_ui.py) drives Debian's Chromium; best effort: without
# apt or root the test is skipped and says why.
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
    || echo "note: chromium could not be installed; the MLflow UI browser test will be skipped"
fi
python -c "import raysys, ray, torch, jax, mlflow, neurogym; print('raysys installed: ray', ray.__version__, '| torch', torch.__version__, '| jax', jax.__version__)"
