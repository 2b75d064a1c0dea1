#!/usr/bin/env bash
# Runs on every TPU VM worker (launch/tpu_pod.sh starts it there): builds ./.venv-tpu with the
# tested jax[tpu] / libtpu (launch/constraints.txt), checks that jax sees this host's TPU chips
# and that every path the run names exists on this host. Training is started separately, so a
# worker that fails here stops the launch before any process waits for it.
#   bash launch/tpu_setup.sh CONFIG.gin [--gin_param ...]
# SPARROW_WHEELHOUSE=DIR: install from DIR with no network (DIR from launch/wheelhouse.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW_LAUNCHER="tpu_setup.sh@$(hostname)"
# shellcheck source=launch/lib.sh
. launch/lib.sh

py=$(sparrow_find_python)
if [ ! -x .venv-tpu/bin/python ]; then
  sparrow_run "$py" -m venv .venv-tpu || sparrow_die "$py -m venv failed: install the venv module (Ubuntu: sudo apt install python3.11-venv)"
fi
sparrow_dry || py=.venv-tpu/bin/python
sparrow_pip_upgrade "$py"
sparrow_pip_install "$py" -c "$SPARROW_CONSTRAINTS" -e '.[tpu]'
# The expected local device count: TPU_CHIPS_PER_HOST (e.g. 4 on v5p, 8 on v5e-8), else the
# /dev/accel* chips this VM exposes (v4/v5p); none found (vfio-based v5e/v6e) = any count.
shopt -s nullglob
accels=(/dev/accel[0-9]*)
shopt -u nullglob
chips=${TPU_CHIPS_PER_HOST:-${#accels[@]}}
[ "$chips" != 0 ] || chips=""
sparrow_check_jax "$py" tpu "$chips"
"$py" -m sparrow_jax.train.host_check "$@" || sparrow_die "the run's paths are not all on this host (above)"
