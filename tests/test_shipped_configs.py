"""The shipped configs' guard: every real config in configs/ (a `# dryrun: --target ...` header
line) compiles one RL step for its target with `sparrow dryrun` and must fit.

A file of its own (not in tests/test_dryrun.py): pytest-xdist (`--dist loadfile`) gives a whole
file to one worker, and this guard is CI's longest item (minutes of TPU/H100 compiling), so the
other worker takes everything else, the dryrun unit tests included. Marked `guard`: the default
`launch/local.sh test` (CI) skips `slow` tests but never a guard.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hf_fixtures import require_compile_env
from test_dryrun import COMPILE_ENV, REPO, dryrun_env

pytestmark = [pytest.mark.compile, pytest.mark.guard]

def _shipped_configs() -> list[tuple[str, list[str]]]:
    """(config, dryrun arguments) from each real config's header line `# dryrun: --target ...`."""
    out = []
    for path in sorted((REPO / "configs").glob("*.gin")):
        m = re.search(r"^# dryrun: (.+)$", path.read_text(), re.M)
        if m:
            out.append((path.name, m.group(1).split()))
    return out


@pytest.fixture(scope="module")
def shipped_results(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every shipped config's dryrun for its target (`--no_fit --no_cost`: the memory verdict's
    compiles only), one after another. Not side by side: libtpu's and XLA's compiles are
    multi-threaded, and three at once on CI's 2 cores took twice the CPU time of the three in a
    row (measured 2026-11-25: 959 s wall and ~30 CPU-minutes side by side; 568 s wall and 15
    CPU-minutes in a row), which the other pytest worker then lacked."""
    if os.environ.get("SPARROW_SKIP_COMPILE_CHECK") == "1":
        pytest.skip("SPARROW_SKIP_COMPILE_CHECK=1")
    require_compile_env(COMPILE_ENV)
    root = tmp_path_factory.mktemp("shipped")
    results = {}
    for config, argv in _shipped_configs():
        try:
            r = subprocess.run(
                [sys.executable, "-m", "sparrow_jax.cli", "dryrun", str(REPO / "configs" / config),
                 *argv, "--no_fit", "--no_cost"], cwd=root, env=dryrun_env(),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
            results[config] = (r.returncode, r.stdout)
        except subprocess.TimeoutExpired as e:     # its output arrives as bytes, text=True or not
            results[config] = (-9, (e.stdout or b"").decode(errors="replace"))
    return results


@pytest.mark.parametrize("config", [c for c, _ in _shipped_configs()])
def test_shipped_configs_fit(shipped_results, config):
    """The guard: CI fails when a shipped real config stops fitting its target."""
    code, out = shipped_results[config]
    verdict = [line for line in out.splitlines() if "FIT" in line]
    print(out[-8000:])
    assert code == 0 and verdict and verdict[-1].startswith("FITS"), out[-6000:]
    if config in ("qwen3_1p7b_gpu.gin", "qwen3_8b_tpu.gin"):
        # The whole step's 512 rollouts in one paged rollout, its pool reported (on the pod:
        # one scheduler on every host, the rollout programs extrapolated from 4 and 5 layers).
        assert "512 rollouts/step in 1 call(s)" in out and "on the paged engine" in out, out
        assert "paged KV pool per device:" in out and "rollout.paged_prefill[resume]" in out, out
    if config == "qwen3_8b_tpu.gin":
        assert "rollout compiled at 4 and 5 layers, extrapolated to 36" in out, out
        assert "learner compiled at full depth (36 layers)" in out, out


def test_every_real_config_names_its_target():
    names = {c for c, _ in _shipped_configs()}
    assert {"qwen3_1p7b_gpu.gin", "qwen3_8b_tpu.gin", "qwen3_0p6b_v5e.gin"} <= names
