#!/usr/bin/env bash
# One NVIDIA GPU node: installs sparrow-jax with the CUDA plugin + jax-triton into ./.venv-gpu
# (skipped when jax with CUDA is already importable, e.g. a preinstalled image) and runs training.
#   launch/gpu.sh configs/qwen3_1p7b_gpu.gin [--gin_param ...]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu
  # shellcheck disable=SC1091
  . .venv-gpu/bin/activate
  python -m pip install -q -e ".[gpu]"
else
  python3 -m pip install -q --no-deps -e .
fi
# Let XLA take most of the GPU memory up front (the KV cache is allocated once per rollout).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
exec sparrow train "$@"
