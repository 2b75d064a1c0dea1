#!/usr/bin/env bash
# Downloads every wheel an accelerator host needs to install sparrow-jax with no network, for
# the tested versions (launch/constraints.txt). Run it where pip reaches its index, carry DIR to
# the offline host, then install from it with
#   SPARROW_WHEELHOUSE=DIR launch/gpu.sh CONFIG.gin        (or launch/tpu_setup.sh,
#   SPARROW_WHEELHOUSE=DIR launch/device_check.sh)          launch/local.sh)
#
#   launch/wheelhouse.sh DIR [--targets cuda12,cuda13,tpu] [--pythons 3.11,3.12]
#
# Targets: cuda12 (NVIDIA driver 525-579), cuda13 (driver >= 580), tpu, cpu (the CPU test
# host). Each is resolved by `pip download --only-binary=:all: --platform ... --python-version`
# for every Python, so the host's own Python and glibc need not match this machine's. Platform:
# SPARROW_WHEELHOUSE_PLATFORM (default manylinux_2_31_x86_64: glibc >= 2.31, Ubuntu 20.04+;
# pip also takes the older manylinux wheels under it). Also in DIR: sparrow-jax's own wheel
# (its dependency list) and setuptools (the launchers' editable install builds offline).
# SPARROW_LAUNCH_DRY_RUN=1 prints the pip commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW_LAUNCHER=wheelhouse.sh
# shellcheck source=launch/lib.sh
. launch/lib.sh

[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || sparrow_die "usage: launch/wheelhouse.sh DIR [--targets cuda12,cuda13,tpu] [--pythons 3.11,3.12]"
dir=$1
shift
targets=cuda12,cuda13,tpu
pythons=3.11,3.12
while [ $# -gt 0 ]; do
  case "$1" in
    --targets) targets=${2:?--targets needs a value}; shift 2 ;;
    --pythons) pythons=${2:?--pythons needs a value}; shift 2 ;;
    *) sparrow_die "unknown argument '$1' (expected --targets or --pythons)" ;;
  esac
done
platform=${SPARROW_WHEELHOUSE_PLATFORM:-manylinux_2_31_x86_64}
py=$(sparrow_find_python)
sparrow_run mkdir -p "$dir"
dir=$(cd "$dir" 2>/dev/null && pwd || echo "$dir")

# sparrow-jax as a wheel: pip download reads the dependencies from its metadata.
sparrow_say "building the sparrow-jax wheel into $dir"
sparrow_run "$py" -m pip wheel -q --no-deps -w "$dir" . \
  || sparrow_die "could not build the sparrow-jax wheel (pip wheel . failed above)"
own="$dir/sparrow_jax-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)-py3-none-any.whl"

failed=()
IFS=, read -r -a target_list <<<"$targets"
IFS=, read -r -a python_list <<<"$pythons"
for target in "${target_list[@]}"; do
  case "$target" in
    cuda12|cuda13) reqs=("$own" "jax[$target]" jax-triton) ;;
    tpu) reqs=("$own[tpu]") ;;
    cpu) reqs=("$own") ;;
    *) sparrow_die "unknown target '$target' (expected cuda12, cuda13, tpu or cpu)" ;;
  esac
  for pv in "${python_list[@]}"; do
    sparrow_py_supported "$pv" || sparrow_die "--pythons: '$pv' is not a Python >= 3.11"
    sparrow_say "$target, Python $pv, $platform"
    if ! sparrow_run "$py" -m pip download -q -d "$dir" --only-binary=:all: \
        --platform "$platform" --python-version "$pv" --implementation cp \
        -c "$SPARROW_CONSTRAINTS" "${reqs[@]}" "setuptools>=77"; then
      failed+=("$target/py$pv")
    fi
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  sparrow_die "pip could not download every wheel for: ${failed[*]} (a dependency without a wheel for that Python/platform, named above); the others are in $dir"
fi
sparrow_say "wheelhouse ready: $dir ($(find "$dir" -name '*.whl' 2>/dev/null | wc -l | tr -d ' ') wheels). On the offline host: SPARROW_WHEELHOUSE=$dir launch/gpu.sh ... (or tpu_setup.sh, device_check.sh)"
