#!/usr/bin/env bash
# One NVIDIA GPU node: installs sparrow-jax with the tested jax CUDA plugin + jax-triton
# (launch/constraints.txt; CUDA 13 for drivers >= 580, CUDA 12 for 525-579, from nvidia-smi)
# into ./.venv-gpu - or, when the image already has jax with CUDA, every other dependency
# against that jax into ./.venv-gpu-image (which sees the image's packages) - checks that jax
# sees every GPU, and runs training.
#   launch/gpu.sh configs/qwen3_1p7b_gpu.gin [--gin_param ...]
# Python >= 3.11 (python3.11, 3.12, 3.13 or python3 on PATH; PYTHON=/path/to/python to choose).
# Several nodes: run it on every node with COORDINATOR=host0:port NUM_NODES=N NODE_RANK=i set
# (one process per node drives all of its GPUs; SLURM jobs need none of these: auto-detected).
# SPARROW_WHEELHOUSE=DIR: install from DIR with no network (an offline node; DIR from
# launch/wheelhouse.sh). SPARROW_INSTALL_ONLY=1: install and check, then stop (before `sparrow doctor`, `sparrow data
# check`, `sparrow dryrun`). SPARROW_LAUNCH_DRY_RUN=1 prints the install and training commands
# instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW_LAUNCHER=gpu.sh
# shellcheck source=launch/lib.sh
. launch/lib.sh

py=$(sparrow_find_python)
cuda=$(sparrow_cuda_extra)
gpus=$(sparrow_gpu_count)
found=$(sparrow_installed_jax "$py")
if [ "${found##* }" = "gpu" ]; then
  # A preinstalled jax with CUDA (e.g. an NGC JAX image): keep it - a venv that sees the image's
  # packages (--system-site-packages) gets every other dependency, pinned against that jax.
  read -r jax_v jaxlib_v _ <<<"$found"
  venv=.venv-gpu-image
  sparrow_say "using the preinstalled jax $jax_v (jaxlib $jaxlib_v) of $py; installing the other dependencies against it into $venv"
  pin=$(mktemp)
  printf 'jax==%s\njaxlib==%s\n' "$jax_v" "$jaxlib_v" >"$pin"
  if [ ! -x "$venv/bin/python" ]; then
    sparrow_run "$py" -m venv --system-site-packages "$venv" || sparrow_die "$py -m venv failed: install the venv module (Ubuntu: sudo apt install python3-venv)"
  fi
  sparrow_say_jax_tested "$jax_v"
  sparrow_dry || py=$venv/bin/python
  if [ -n "${SPARROW_WHEELHOUSE:-}" ]; then
    [ -d "$SPARROW_WHEELHOUSE" ] || sparrow_die "SPARROW_WHEELHOUSE=$SPARROW_WHEELHOUSE is not a directory"
    sparrow_run "$py" -m pip install -q --no-index --find-links "$SPARROW_WHEELHOUSE" -c "$pin" -e . \
      || sparrow_die "pip could not install sparrow-jax against jax $jax_v from the wheelhouse $SPARROW_WHEELHOUSE (a missing wheel is named above)"
  else
    sparrow_run "$py" -m pip install -q -c "$pin" -e . \
      || sparrow_die "pip could not install sparrow-jax against jax $jax_v: either pip has no network (then build a wheelhouse with launch/wheelhouse.sh and set SPARROW_WHEELHOUSE=DIR) or a dependency conflicts with it (above; pyproject allows jax >=0.10.2,<0.13; tested: launch/constraints.txt)"
  fi
  # jax-triton (the pallas_triton kernel backend) where a release fits this jax; without it,
  # backend "auto" picks another GPU path and logs which (pallas_kernels/dispatch.py).
  if [ -n "${SPARROW_WHEELHOUSE:-}" ]; then
    triton_src=(--no-index --find-links "$SPARROW_WHEELHOUSE")
  else
    triton_src=()
  fi
  if sparrow_run "$py" -m pip install -q "${triton_src[@]}" -c "$pin" jax-triton; then
    sparrow_say "jax-triton installed against jax $jax_v"
  else
    sparrow_say "no jax-triton release installs against jax $jax_v (above): the kernels use backend 'auto' without it (logged at start-up)"
  fi
else
  venv=.venv-gpu
  sparrow_say "installing jax[$cuda] (driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)) into $venv with $py ($(sparrow_py_version "$py"))"
  if [ ! -x "$venv/bin/python" ]; then
    sparrow_run "$py" -m venv "$venv" || sparrow_die "$py -m venv failed: install the venv module (Ubuntu: sudo apt install python3.11-venv)"
  fi
  sparrow_dry || py=$venv/bin/python
  sparrow_pip_upgrade "$py"
  sparrow_pip_install "$py" -c "$SPARROW_CONSTRAINTS" -e . "jax[$cuda]" jax-triton
fi
sparrow_check_jax "$py" gpu "$gpus"
sparrow_use_python_scripts "$py"
if [ -n "${SPARROW_INSTALL_ONLY:-}" ]; then
  sparrow_say "installed and checked; next: . $venv/bin/activate && sparrow doctor"
  exit 0
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
if sparrow_dry; then
  sparrow_say "dry run: sparrow train $* ${multi[*]}"
  exit 0
fi
exec sparrow train "$@" "${multi[@]}"
