"""Real TPU (v5e/v5p/v6e) and H100 compiles of the kernels, without the hardware.

Runs ``pallas_kernels.compile_check`` in a subprocess with the separate compile environment
(.compile-env/, installed by ``bash .ci/compile_env.sh``, which ``launch/local.sh test`` runs
first) on PYTHONPATH. A compile failure fails the test. A missing compile environment also fails
(CI must not silently skip these); set SPARROW_SKIP_COMPILE_CHECK=1 to skip deliberately.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hf_fixtures import require_compile_env

REPO = Path(__file__).resolve().parents[1]
# SPARROW_COMPILE_ENV: another jax version's compile environment (.ci/second_jax.sh).
COMPILE_ENV = Path(os.environ.get("SPARROW_COMPILE_ENV") or REPO / ".compile-env").absolute()

pytestmark = pytest.mark.compile


def _run_check(target: str, **extra_env: str) -> subprocess.CompletedProcess:
    if os.environ.get("SPARROW_SKIP_COMPILE_CHECK") == "1":
        pytest.skip("SPARROW_SKIP_COMPILE_CHECK=1")
    require_compile_env(COMPILE_ENV)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=f"{COMPILE_ENV}{os.pathsep}{REPO}",
        # cpu as the default backend: the compile-only TPU/GPU topologies do not need one, and
        # it keeps the CUDA plugin from probing for a driver.
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        TRITON_DEFAULT_FP_FUSION="1",
    )
    env.update(extra_env)
    env.pop("XLA_FLAGS", None)
    # cwd outside the repo: a folder named `libtpu` in the working directory shadows the package.
    with tempfile.TemporaryDirectory(prefix="sparrow-compile-") as cwd:
        return subprocess.run(
            [sys.executable, "-m", "pallas_kernels.compile_check", "--targets", target],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("target", ["tpu", "cuda", "jax_triton", "triton_interpret"])
def test_real_compile(target):
    # triton_interpret: the raw Triton kernel run numerically in Triton's CPU interpreter (the
    # flag must be set before triton is imported, hence per-subprocess).
    r = _run_check(target, **({"TRITON_INTERPRET": "1"} if target == "triton_interpret" else {}))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL", "SUMMARY"))]
    report = "\n".join(lines)
    print(report)
    assert r.returncode == 0, f"compile check for {target} failed:\n{report}\n{r.stderr[-4000:]}"
    assert any(ln.startswith("PASS") for ln in lines), r.stdout[-4000:]
    assert not any(ln.startswith("FAIL") for ln in lines), report
