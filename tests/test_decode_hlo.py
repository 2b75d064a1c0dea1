"""The rollout's decode program stays sort-free on accelerators (issue 30): the paged decode chunk
of the Qwen3-1.7B GPU config, compiled for H100 and for TPU v5p without the hardware, has no
`sort` and no top-k wider than XLA's small-k GPU kernel in its optimised HLO, and no copy of a
page pool (the pools are updated in place).

Compile-only, in a subprocess with the compile environment (.compile-env) on PYTHONPATH, like
tests/test_dryrun.py. For CI time it compiles 3 layers (2 dense + 1 sparse: every sparse layer
lowers alike) and 8 prompts x 8 samples per step instead of 64 x 8; heads, widths, the 32K+2K
context (2176 blocks per row), the selection width (512 blocks) and the 32-step chunk are the
config's own.
"""

from __future__ import annotations

import json
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


def _decode_ops(target: str, *extra: str) -> dict:
    if os.environ.get("SPARROW_SKIP_COMPILE_CHECK") == "1":
        pytest.skip("SPARROW_SKIP_COMPILE_CHECK=1")
    require_compile_env(COMPILE_ENV)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(COMPILE_ENV), str(REPO)]))
    argv = [sys.executable, "-m", "sparrow_jax.dryrun.hlo", str(REPO / "configs/qwen3_1p7b_gpu.gin"),
            "--gin_param", "TrainConfig.prompts_per_step = 8", "--target", target,
            "--preset", "qwen3-1.7b", "--layers", "3", "--json", "--no_bytes", *extra]
    with tempfile.TemporaryDirectory(prefix="sparrow-hlo-test-") as cwd:  # no `libtpu` shadowing
        r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("target", ["h100x8", "v5p-8"])
def test_paged_decode_has_no_sort_or_large_topk(target):
    report = _decode_ops(target)
    assert report["program"] == "rollout.paged_decode" and report["engine"] == "paged"
    assert report["sparse_layers_compiled"] == 1 and report["blocks_per_row"] == 2176
    assert report["max_selected"] == 512
    # alpha_mode = "full" reads no vocabulary top-k: the rollout records none.
    assert report["record_topk"] == 0
    assert report["large_sorts"] == [], report["large_sorts"]
    assert report["sort"] == [] and report["topk"] == []
    # The fed token's K/V is written into the page pools in place (issue 31): a row scatter made
    # the TPU compiler copy every layer's pool out of its layout and back, 22 GiB of temporaries
    # in the 8B pod's decode chunk.
    assert report["pool_copies"] == [], report["pool_copies"]
    # Block selection is one Pallas Triton kernel on GPU (both sides of the sparse layer's
    # dense/sparse switch hold one), the XLA form on TPU.
    launches = report["kernel_launches"]
    assert launches["block_select_kernels"] == (2 if target.startswith("h100") else 0), launches
    assert launches["sort"] == 0 and launches["total"] > 0
