#!/usr/bin/env bash
# One NVIDIA GPU node: installs sparrow-jax with the CUDA plugin + jax-triton into ./.venv-gpu
# (skipped when jax with CUDA is already importable, e.g. a preinstalled image) and runs training.
#   launch/gpu.sh configs/qwen3_1p7b_gpu.gin [--gin_param ...]
# Several nodes: run it on every node with COORDINATOR=host0:port NUM_NODES=N NODE_RANK=i set
# (one process per node drives all of its GPUs; SLURM jobs need none of these: auto-detected).
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
multi=()
if [ -n "${COORDINATOR:-}" ]; then
  multi=(--gin_param "TrainConfig.distributed = True"
         --gin_param "TrainConfig.coordinator_address = '${COORDINATOR}'"
         --gin_param "TrainConfig.num_processes = ${NUM_NODES:?set NUM_NODES}"
         --gin_param "TrainConfig.process_id = ${NODE_RANK:?set NODE_RANK}")
fi
exec sparrow train "$@" "${multi[@]}"
