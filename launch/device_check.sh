#!/usr/bin/env bash
# One command for a freshly lent accelerator host: install (from a carried wheelhouse when the
# host is offline), then `sparrow doctor`, the kernel benchmark at Qwen3-1.7B shapes (8K, 32K),
# block selection alone, `sparrow bench rollout` at 1.7B shapes in bf16 (dense vs sparse at
# batch 4 and at an RL batch of 32, each compile's seconds, a profile by phase), 2 training steps on
# the paged engine, and 2 steps of the shipped 1.7B GPU config on random weights, each stage
# under its own timeout (~8 minutes on one H200 before the last, which compiles for minutes).
# Writes a dated report (markdown + JSON) under docs/devices/ after every stage: what finished
# is kept when a later stage fails. docs/devices/README.md says how to run it on a new machine.
#   launch/device_check.sh [--quick] [--out DIR] [--only doctor,kernels,rollout,train]
#   launch/device_check.sh --only gpu_limit   # issue 55's bytes-limit benches, <= 9 min on an H200
#   launch/device_check.sh --only promise     # issue 56: warm-up + dense/controller/exact RL, <= 9 min
# --quick: toy sizes (CPU; CI runs it), no install, on the project's environment: PYTHON if set,
# else ./.venv (launch/local.sh makes it), else the active virtual environment, else the system
# Python; one that cannot import the project stops here, naming what is missing.
# GPU hosts install with launch/gpu.sh (SPARROW_INSTALL_ONLY=1), TPU VMs with tpu_setup.sh's
# install; SPARROW_WHEELHOUSE=DIR installs from DIR with no network (launch/wheelhouse.sh).
# PYTHON=/path/to/python: use that Python (an installed environment) and skip the install.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW_LAUNCHER=device_check.sh
# shellcheck source=launch/lib.sh
. launch/lib.sh

quick=""
for a in "$@"; do [ "$a" = --quick ] && quick=1; done
if [ -n "$quick" ] || [ -n "${PYTHON:-}" ]; then
  if [ -n "${PYTHON:-}" ]; then py=$PYTHON
  elif [ -x .venv/bin/python ]; then py=.venv/bin/python
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then py=$VIRTUAL_ENV/bin/python
  else py=$(sparrow_find_python)
  fi
  sparrow_say "using $py as it is (no install)"
  # Every stage would fail in 0 s on an environment without the project (issue 58).
  if ! missing=$("$py" -c 'import gin, jax, sparrow_jax' 2>&1 >/dev/null); then
    sparrow_die "$py cannot run the check: $(printf '%s\n' "$missing" | tail -n 1). Run launch/local.sh test once (it makes ./.venv), activate the project's environment, or set PYTHON=/path/to/its/python"
  fi
elif command -v nvidia-smi >/dev/null 2>&1; then
  SPARROW_INSTALL_ONLY=1 bash launch/gpu.sh || sparrow_die "the GPU install failed (above)"
  if [ -x .venv-gpu-image/bin/python ]; then py=.venv-gpu-image/bin/python; else py=.venv-gpu/bin/python; fi
elif compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/*' >/dev/null; then
  py=$(sparrow_find_python)
  if [ ! -x .venv-tpu/bin/python ]; then
    sparrow_run "$py" -m venv .venv-tpu || sparrow_die "$py -m venv failed"
  fi
  py=.venv-tpu/bin/python
  sparrow_pip_upgrade "$py"
  sparrow_pip_install "$py" -c "$SPARROW_CONSTRAINTS" -e '.[tpu]'
  sparrow_check_jax "$py" tpu ""
else
  sparrow_die "no accelerator found (no nvidia-smi, no /dev/accel*): run with --quick on CPU, or PYTHON=/path/to/python to use an environment as it is"
fi
sparrow_dry && { sparrow_say "dry run: $py -m sparrow_jax.tools.device_check $*"; exit 0; }
exec "$py" -m sparrow_jax.tools.device_check "$@"
