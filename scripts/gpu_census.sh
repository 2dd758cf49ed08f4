#!/usr/bin/env bash
# Kernel counts of hackmatrix PPO compiled for an H100, on a machine without a GPU (scripts/gpu_census.py).
# The first call makes .cache/gpu-census: a venv on top of this Python with JAX's CUDA plugin for the
# installed jaxlib and CUDA's runtime and compiler wheels (~100 MB from PyPI); the main environment
# stays CPU-only. Arguments go to gpu_census.py (--num-envs, --num-steps, --precision).
set -euo pipefail
cd "$(dirname "$0")/.."
V=.cache/gpu-census
if [ ! -x "$V/bin/python" ]; then
  JAXLIB=$(python -c "import jaxlib; print(jaxlib.__version__)")
  python -m venv --system-site-packages "$V"
  "$V/bin/pip" install -q --no-deps "jax-cuda12-plugin==$JAXLIB" "jax-cuda12-pjrt==$JAXLIB" \
    nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12
fi
# the plugin's version check wants every CUDA library; a compile-only device needs none of them
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$V/bin/python" scripts/gpu_census.py "$@" \
  2> >(grep -v -E "cudart_stub|cuInit|absl::InitializeLog|cuda_platform|^WARNING: All log" >&2)
