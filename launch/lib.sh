# shellcheck shell=bash
# Shared launcher logic, sourced by launch/gpu.sh, launch/tpu_setup.sh and launch/local.sh.
# Every failure ends in one line `[launcher] ERROR: ...` saying what to do, and exit status 1.
#
# SPARROW_LAUNCH_DRY_RUN=1: print the commands that would change the machine (venv, pip,
# training) instead of running them; every check still runs (tests/test_launch.py).

SPARROW_LAUNCHER=${SPARROW_LAUNCHER:-launch}
SPARROW_CONSTRAINTS=launch/constraints.txt     # the tested jax / plugin / libtpu versions

sparrow_say() { echo "[$SPARROW_LAUNCHER] $*" >&2; }
sparrow_die() { echo "[$SPARROW_LAUNCHER] ERROR: $*" >&2; exit 1; }
sparrow_dry() { [ -n "${SPARROW_LAUNCH_DRY_RUN:-}" ]; }

# Runs "$@", or prints it in a dry run.
sparrow_run() {
  if sparrow_dry; then echo "[$SPARROW_LAUNCHER] dry run: $*" >&2; else "$@"; fi
}

# "3.11" for a python executable, or nothing when it does not run.
sparrow_py_version() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null | tail -n 1 || true
}

# True when "MAJOR.MINOR" is a Python sparrow-jax supports (>= 3.11, pyproject's requires-python).
sparrow_py_supported() {
  local major=${1%%.*} minor=${1#*.}
  [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]] || return 1
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 11 ]; }
}

# Prints the Python to build the environment with: $PYTHON if set, else the first supported of
# python3.11 (the tested one), python3.12, python3.13, python3. Dies naming what it found.
sparrow_find_python() {
  local cand v seen=""
  if [ -n "${PYTHON:-}" ]; then
    v=$(sparrow_py_version "$PYTHON")
    [ -n "$v" ] || sparrow_die "PYTHON=$PYTHON does not run"
    sparrow_py_supported "$v" || sparrow_die "PYTHON=$PYTHON is Python $v; sparrow-jax needs Python >= 3.11"
    echo "$PYTHON"
    return
  fi
  for cand in python3.11 python3.12 python3.13 python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    v=$(sparrow_py_version "$cand")
    [ -n "$v" ] || continue
    if sparrow_py_supported "$v"; then command -v "$cand"; return; fi
    seen="${seen:+$seen, }$cand is $v"
  done
  sparrow_die "no Python >= 3.11 found (${seen:-none on PATH}; sparrow-jax needs 3.11+). Install one - Ubuntu: sudo apt install python3.11 python3.11-venv (deadsnakes PPA on 22.04); any OS: curl -LsSf https://astral.sh/uv/install.sh | sh && uv python install 3.11 - then re-run, or set PYTHON=/path/to/python3.11"
}

# The jax CUDA extra for this node's driver: cuda13 (driver >= 580) or cuda12 (525-579).
sparrow_cuda_extra() {
  command -v nvidia-smi >/dev/null 2>&1 || sparrow_die "nvidia-smi not found: launch/gpu.sh needs an NVIDIA GPU node with its driver installed"
  local driver major
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)
  major=${driver%%.*}
  [[ "$major" =~ ^[0-9]+$ ]] || sparrow_die "nvidia-smi reports no driver version (got '${driver}'): is the GPU visible (nvidia-smi)?"
  if [ "$major" -ge 580 ]; then
    echo cuda13
  elif [ "$major" -ge 525 ]; then
    echo cuda12
  else
    sparrow_die "NVIDIA driver $driver is too old: jax's CUDA 12 wheels need >= 525, CUDA 13 >= 580. Upgrade the driver"
  fi
}

# GPUs this process should see: CUDA_VISIBLE_DEVICES's entries if set, else nvidia-smi -L.
sparrow_gpu_count() {
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true
  else
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  fi
}

# "JAX JAXLIB BACKEND" of an importable jax in python $1, or nothing.
sparrow_installed_jax() {
  "$1" -c 'import jax, jaxlib; print("sparrow-jax:", jax.__version__, jaxlib.__version__, jax.default_backend())' 2>/dev/null \
    | sed -n 's/^sparrow-jax: //p' | tail -n 1 || true
}

# Checks that jax in python $1 runs on platform $2 with $3 local devices (empty: any > 0), else
# dies naming the cause: a run must never silently train on the CPU.
sparrow_check_jax() {
  local py=$1 want=$2 count=${3:-} out err platform n
  err=$(mktemp)
  out=$("$py" -c 'import jax; print("sparrow-jax:", jax.default_backend(), jax.local_device_count())' 2>"$err" \
    | sed -n 's/^sparrow-jax: //p' | tail -n 1) || true
  platform=${out%% *}
  n=${out##* }
  if [ -z "$out" ]; then
    sparrow_die "jax does not import in $py: $(grep -v '^\s*$' "$err" | tail -n 1 || true)"
  fi
  if [ "$platform" != "$want" ]; then
    local why
    why=$(grep -iE 'cuda|driver|tpu|libtpu|plugin|fall' "$err" | head -n 1 || true)
    rm -f "$err"
    sparrow_die "jax runs on '$platform', not '$want' (${why:-no reason printed}); training would run on the CPU. $( [ "$want" = gpu ] && echo 'Check nvidia-smi and that the jax CUDA plugin matches the driver (launch/constraints.txt).' || echo 'Check that this is a TPU VM and libtpu is installed (launch/constraints.txt).')"
  fi
  rm -f "$err"
  if [ -n "$count" ] && [ "$n" != "$count" ]; then
    sparrow_die "jax sees $n $want device(s) but this host has $count; another process may hold some (nvidia-smi / CUDA_VISIBLE_DEVICES, or a TPU still held by an old run)"
  fi
  sparrow_say "jax on $want with $n local device(s): OK"
}

# Puts python $1's script directory (where pip puts `sparrow`) first on PATH.
sparrow_use_python_scripts() {
  local dir
  dir=$("$1" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null | tail -n 1 || true)
  if [ -n "$dir" ]; then PATH="$dir:$PATH"; fi
  export PATH
}

# pip install "$@" with python $1 - from the wheelhouse $SPARROW_WHEELHOUSE when set (no index:
# an offline host, launch/wheelhouse.sh), else from the package index. Dies saying which.
sparrow_pip_install() {
  local py=$1
  shift
  if [ -n "${SPARROW_WHEELHOUSE:-}" ]; then
    [ -d "$SPARROW_WHEELHOUSE" ] || sparrow_die "SPARROW_WHEELHOUSE=$SPARROW_WHEELHOUSE is not a directory (build one with launch/wheelhouse.sh where pip has network)"
    sparrow_run "$py" -m pip install -q --no-index --find-links "$SPARROW_WHEELHOUSE" "$@" \
      || sparrow_die "pip could not install from the wheelhouse $SPARROW_WHEELHOUSE (no network used): a wheel it needs is missing (named above); rebuild it with launch/wheelhouse.sh DIR --targets <this host's> --pythons $(sparrow_py_version "$py")"
  else
    sparrow_run "$py" -m pip install -q "$@" \
      || sparrow_die "pip install $* failed (above). If this host has no network (an air-gapped node, a locked image), build a wheelhouse with launch/wheelhouse.sh DIR where pip has network, carry DIR here and re-run with SPARROW_WHEELHOUSE=DIR"
  fi
}

# Upgrades pip in python $1 from the index; skipped with a wheelhouse (offline: the venv's pip
# installs wheels as it is).
sparrow_pip_upgrade() {
  [ -n "${SPARROW_WHEELHOUSE:-}" ] && return 0
  sparrow_run "$1" -m pip install -q --upgrade pip || sparrow_say "could not upgrade pip (no network?); going on with $("$1" -m pip --version 2>/dev/null | cut -d' ' -f2)"
}

# Whether jax $1 is the tested version (launch/constraints.txt): says so either way.
sparrow_say_jax_tested() {
  local tested
  tested=$(sed -n 's/^jax==//p' "$SPARROW_CONSTRAINTS" | head -n 1)
  if [ "$1" = "$tested" ]; then
    sparrow_say "jax $1 is the tested version (launch/constraints.txt)"
  else
    sparrow_say "WARNING: jax $1 is NOT the tested version ($tested, launch/constraints.txt); the kernels' compile checks for other versions: docs/devices/README.md. Run launch/device_check.sh before training"
  fi
}

# The checkout that python $1's sparrow_jax resolves to, printed only when it is an editable
# install of another directory than the checkout $2 (nothing for no install, an install of $2, or
# a copy inside the venv). -I: PYTHONPATH and the working directory must not decide the answer;
# find_spec locates the package without importing it (no jax import, well under a second).
sparrow_editable_elsewhere() {
  "$1" -I -c '
import importlib.util, os, sys
spec = importlib.util.find_spec("sparrow_jax")
if spec is not None and spec.origin:
    pkg = os.path.realpath(os.path.dirname(spec.origin))
    src, repo = os.path.dirname(pkg), os.path.realpath(sys.argv[1])
    if src != repo and not pkg.startswith(os.path.realpath(sys.prefix) + os.sep):
        print("sparrow-jax checkout:", src)' "$2" 2>/dev/null | sed -n 's/^sparrow-jax checkout: //p' | tail -n 1 || true
}

# Dies when python $1's venv holds an editable sparrow-jax of another checkout than $2 (a git
# worktree whose .venv links to another checkout's): `pip install -e .` from $2 would silently
# re-point that venv - and every checkout sharing it - at $2.
sparrow_refuse_shared_venv() {
  local other
  other=$(sparrow_editable_elsewhere "$1" "$2")
  [ -z "$other" ] || sparrow_die ".venv's sparrow-jax is an editable install of $other, not of this checkout $2 (a venv shared with another checkout?); installing here would re-point it for every checkout using it. Run this checkout with that venv as it is: PYTHONPATH=$2 .venv/bin/python -m ... ; or re-point the venv deliberately: $1 -m pip install --no-deps -e $2 ; or give this checkout its own venv (remove .venv and re-run)"
}
