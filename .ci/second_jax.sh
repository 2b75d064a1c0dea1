#!/usr/bin/env bash
# The compile checks (real H100 and TPU kernel compiles, tests/test_compile.py; the decode-HLO
# guards, tests/test_decode_hlo.py) against another jax than the CI's pinned one:
#   bash .ci/second_jax.sh 0.11.2 /path/to/python3.12      (jax 0.11 needs Python >= 3.12)
# Builds .venv-jax-VERSION (that jax, sparrow-jax's other dependencies, pytest) and its compile
# environment .compile-env-VERSION (libtpu, the CUDA 13 plugin, jax-triton at that jax), then
# runs the two test files with them. Needs the package index (about 1.5 GB of wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: .ci/second_jax.sh JAX_VERSION [PYTHON]}
py=${2:-python3.12}
venv=.venv-jax-$version
export SPARROW_COMPILE_ENV=.compile-env-$version
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "jax==$version" \
  "jaxlib==$version" -e . "pytest>=8,<10" "pytest-xdist>=3.5,<4"
PYTHON=$venv/bin/python bash .ci/compile_env.sh
shift $(( $# < 2 ? $# : 2 ))
"$venv/bin/python" -m pytest -q -n 0 -p no:cacheprovider tests/test_compile.py tests/test_decode_hlo.py "$@"
