#!/usr/bin/env bash
# Installs the "compile-only" accelerator toolchains into ./.compile-env (a pip --target folder),
# kept apart from .venv on purpose:
#   * libtpu             -> real Mosaic/TPU compiles via jax.experimental.topologies (no TPU needed)
#   * jax-cuda13-plugin  -> real Triton->sm_90 compiles via a GPU target config (no GPU needed)
#     + jax-cuda13-pjrt
#   * jax-triton, triton -> the jax_triton backend's kernel (triton compiles PTX/cubin on the host)
# Having the CUDA plugin importable in the main venv would make every plain CPU run print cuDNN
# errors, so tests put this folder on PYTHONPATH only for the compile-check subprocess.
#
# Versions are read from the venv's jax so the plugin ABI always matches. Idempotent: a stamp file
# records what was installed; a rerun with the same versions does nothing (fast CI reruns).
# Set SPARROW_SKIP_JAX_TRITON=1 to skip the (large) triton wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${SPARROW_COMPILE_ENV:-.compile-env}     # another jax's own: .ci/second_jax.sh
STAMP="$DEST/.sparrow-compile-env"

# One install at a time (`launch/local.sh test` runs this in the background, and a test may start
# `launch/local.sh test` again): a second caller waits, then finds the folder up to date.
if command -v flock > /dev/null; then
  exec 9> "$DEST.lock"
  flock 9
fi

JAX_VERSION=$("$PY" -c 'import jax; print(jax.__version__)')
# libtpu's pin comes from jax's own [tpu] extra (e.g. "libtpu==0.0.42.*" for jax 0.10.2).
LIBTPU_SPEC=$("$PY" - <<'EOF'
from importlib.metadata import requires
import re
for r in requires("jax") or []:
    if r.startswith("libtpu") and 'extra == "tpu"' in r:
        print(re.sub(r"\s+", "", r.split(";")[0]))
        break
else:
    raise SystemExit("jax metadata has no libtpu pin in its [tpu] extra")
EOF
)
# jax-triton: 0.3.x is the series that supports jax 0.10 / Python 3.11 (pyproject's gpu extra).
JAX_TRITON_SPEC=${JAX_TRITON_SPEC:-"jax-triton>=0.3,<0.4"}
# triton: jax-triton 0.3.x needs >=3.6; pip picks the newest 3.x wheel (3.9.0 when written).
TRITON_SPEC=${TRITON_SPEC:-"triton>=3.6,<4"}

WANT="jax=$JAX_VERSION libtpu=$LIBTPU_SPEC cuda13=$JAX_VERSION jt=${SPARROW_SKIP_JAX_TRITON:-0}:$JAX_TRITON_SPEC:$TRITON_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "[compile_env] up to date ($WANT)"
  exit 0
fi

echo "[compile_env] installing into $DEST: $WANT"
rm -rf "$DEST"
mkdir -p "$DEST"
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$DEST" --no-deps)
# --no-deps everywhere: jax/jaxlib/numpy come from the main venv (PYTHONPATH adds, never replaces),
# and the "with-cuda" NVIDIA libraries are not needed to compile (only to run).
"${PIP[@]}" "$LIBTPU_SPEC"
"${PIP[@]}" "jax-cuda13-plugin==$JAX_VERSION" "jax-cuda13-pjrt==$JAX_VERSION"
if [ "${SPARROW_SKIP_JAX_TRITON:-0}" != "1" ]; then
  "${PIP[@]}" "$JAX_TRITON_SPEC" "$TRITON_SPEC"
fi
echo "$WANT" > "$STAMP"
echo "[compile_env] done: $(du -sh "$DEST" | cut -f1)"
