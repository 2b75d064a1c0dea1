"""`launch/device_check.sh --quick` on CPU: the stages run under their timeouts and the dated
markdown + JSON report names each stage's status, results and compile seconds; a stage that
fails or hangs leaves the others' results in the report.

The CI run covers doctor, kernels, selection, rollout, profile and three of the gpu_limit
group's four stages (~3.5 min at load ~17 on the shared 2-core machine, 2026-11-27, before the
gpu_limit stages; those add ~30 s: limit_rollout 13 s, limit_kernels 4 s, limit_rl 12 s on
2026-11-28; marked slow). The quick train stage (2 steps of the demo model) is not in it: on
that machine it reached step 1 after 5.5 min and timed out in step 2's compiles at its 600 s;
on an idle machine it is expected to take ~1-2 min (not measured). Nor is limit_step's quick
form (two `sparrow train` runs, ~75 s): tests/test_config_smoke.py runs it (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.guard      # issue #43: the quick device check runs in CI
def test_quick_device_check_writes_its_report(tmp_path):
    out = tmp_path / "devices"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "launch" / "device_check.sh"), "--quick", "--out",
                        str(out), "--only", "doctor,kernels,selection,rollout,profile,"
                        "limit_rollout,limit_kernels,limit_rl"],
                       cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [report] = list(out.glob("*-cpu-quick.json"))
    rep = json.loads(report.read_text())
    assert [s["stage"] for s in rep["stages"]] == ["doctor", "kernels", "selection", "rollout",
                                                   "profile", "limit_rollout", "limit_kernels",
                                                   "limit_rl"]
    assert all(s["status"] == "ok" and s["seconds"] <= s["timeout_s"] for s in rep["stages"])
    assert rep["device"]["platform"] == "cpu" and rep["device"]["jax"]
    # every stage's whole output beside the report (it must come back with it from a lent host)
    logs = out / f"{report.stem}-logs"
    assert all((logs / f"{s}.log").read_text().startswith("$ ") for s in ("doctor", "kernels",
                                                                          "rollout"))
    by = {s["stage"]: s for s in rep["stages"]}
    # The benchmarks' JSON lines are kept: the kernel's dense vs sparse times, the rollout's
    # dense vs sparse tokens/s, and the rollout's compiles with their seconds.
    [kernel] = by["kernels"]["results"]
    assert kernel["dense_ms"] > 0 and kernel["sparse_ms"] > 0 and kernel["model"] == "qwen3-1.7b"
    [rollout] = by["rollout"]["results"]
    assert rollout["dense_tok_s"] > 0 and rollout["sparse_tok_s"] > 0
    # selection alone: every form gave the ids of top_k + sort
    assert by["selection"]["results"] and all(r["identical"] for r in by["selection"]["results"])
    # the profile of each of the rollout's programs, by phase; its raw traces are gone
    profiles = by["profile"]["results"]
    assert len(profiles) == 2 and all(p["kernel_us"] > 0 and p["phases"] for p in profiles)
    assert any(p["phase"] == "block_select" for p in profiles[1]["phases"])
    assert "block_select" in report.with_suffix(".md").read_text()
    # INFO lines: compiles of >= 1 s and every load from the persistent cache (compile_cache).
    assert by["rollout"]["compiles"] and all(c["cached"] or c["seconds"] >= 1
                                             for c in by["rollout"]["compiles"])
    md = report.with_suffix(".md").read_text()
    assert md.startswith("# Device check ") and "| rollout | ok |" in md
    # a committed report names no temporary path of the machine it ran on
    assert "sparrow-device-check-" not in md + report.read_text()
    assert not any("sparrow-device-check-" in f.read_text() for f in logs.glob("*.log"))
    assert by["rollout"]["log"] == f"{logs.name}/rollout.log"
    assert "dense_tok_s=" in md
    # gpu_limit (issue 55): each timing beside its bytes limit; jax-triton said unavailable
    for r in by["limit_rollout"]["results"]:
        assert r["engine"] == "paged" and r["schedule"] == "custom"
        assert r["dense_pct_of_limit"] > 0 and r["sparse_pct_of_limit"] > 0
    unavailable, kernel = by["limit_kernels"]["results"]
    assert unavailable["backend"] == "jax_triton" and "cannot run" in unavailable["unavailable"]
    assert kernel["dense_pct_of_limit"] > 0 and kernel["sparse_pct_of_limit"] > 0
    assert [r["mode"] for r in by["limit_rl"]["results"]] == ["dense", "sparse"]
    assert all(r["pct_of_limit"] > 0 and r["tok_s"] > 0 for r in by["limit_rl"]["results"])
    assert "pct_of_limit=" in md and "unavailable=" in md


def test_a_failed_stage_keeps_the_others(tmp_path, monkeypatch):
    """A stage that fails (here: a bad flag) is reported as failed with its output; the report
    is written after every stage. Stage processes are stubbed: no jax start-up."""
    from sparrow_jax.tools import device_check as dc

    stages = [dc.Stage("good", ("--version",), 60, "prints a version"),
              dc.Stage("bad", ("--no-such-flag",), 60, "fails")]
    monkeypatch.setattr(dc, "stages", lambda quick, run_dir, profile_dir="", **where: stages)
    monkeypatch.setattr(dc, "device_summary", lambda: {"kind": "cpu", "devices": 1})

    def fake(stage, log_dir, work=None):
        ok = stage.name == "good"
        return {"stage": stage.name, "what": stage.what, "command": "sparrow x",
                "status": "ok" if ok else "fail", "returncode": 0 if ok else 2,
                "seconds": 1.0, "timeout_s": 60, "results": [{"tok_s": 5}] if ok else [],
                "compiles": [], "tail": ["error: no such flag"] if not ok else [], "log": ""}
    monkeypatch.setattr(dc, "run_stage", fake)
    assert dc.main(["--out", str(tmp_path)]) == 1
    [report] = list(tmp_path.glob("*.json"))
    rep = json.loads(report.read_text())
    assert [(s["stage"], s["status"]) for s in rep["stages"]] == [("good", "ok"), ("bad", "fail")]
    md = report.with_suffix(".md").read_text()
    assert "| good | ok |" in md and "| bad | fail |" in md and "tok_s=5" in md
    assert "error: no such flag" in md


def test_a_stage_past_its_timeout_is_cut_and_reported(tmp_path, monkeypatch):
    """A hung stage (a stand-in Python that sleeps) ends at its timeout, as 'timeout' with what
    it printed so far, and does not stop the check."""
    from sparrow_jax.tools import device_check as dc
    sleeper = tmp_path / "python"
    # The stage starts a process of its own (as config_smoke starts `sparrow train`): it must
    # go with the stage, not run on (on a GPU it would hold the memory the next stage needs).
    late = tmp_path / "still-running"
    sleeper.write_text(f"#!/bin/bash\necho started; (sleep 2; touch {late}) & sleep 30\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(dc.sys, "executable", str(sleeper))
    rec = dc.run_stage(dc.Stage("hung", ("doctor",), 1, "hangs"), tmp_path)
    assert rec["status"] == "timeout" and rec["returncode"] is None and rec["seconds"] < 20
    assert (tmp_path / "hung.log").read_text().count("doctor") == 1
    assert "started" in (tmp_path / "hung.log").read_text()
    time.sleep(2.5)
    assert not late.exists(), "the stage's own child outlived its timeout"


def test_the_stated_timeouts_are_the_stages_own():
    """docs/devices/README.md states what the full check's timeouts add up to, and the
    gpu_limit group's time plan: its stages' timeouts add up to at most 9 minutes, each one's
    as the plan's table says."""
    from sparrow_jax.tools import device_check as dc
    full = [s for s in dc.stages(False, "run") if s.name not in dc.ON_REQUEST]
    assert sum(s.timeout_s for s in full) == 1950     # promise: a call of its own (540 s)
    doc = (REPO / "docs/devices/README.md").read_text()
    assert "The timeouts add up to 32.5 minutes" in doc
    limit = [s for s in full if s.name in dc.GROUPS["gpu_limit"]]
    assert [s.name for s in limit] == list(dc.GROUPS["gpu_limit"])
    assert sum(s.timeout_s for s in limit) == 540 <= 9 * 60
    for s in limit:
        assert f"| {s.name} | " in doc and f" | {s.timeout_s} s |" in doc, s.name
    # the quick forms are the same stages
    assert [s.name for s in dc.stages(True, "run") if s.name.startswith("limit_")] == [
        s.name for s in limit]


def test_only_a_group_runs_its_stages(tmp_path, monkeypatch):
    """`--only gpu_limit` selects the group's stages, in order; an unknown name lists the
    groups with the stages."""
    from sparrow_jax.tools import device_check as dc
    ran = []
    monkeypatch.setattr(dc, "device_summary", lambda: {"kind": "cpu", "devices": 1})

    def fake(stage, log_dir, work=None):
        ran.append(stage.name)
        return {"stage": stage.name, "what": stage.what, "command": "x", "status": "ok",
                "returncode": 0, "seconds": 0.0, "timeout_s": stage.timeout_s, "results": [],
                "compiles": [], "tail": [], "log": ""}
    monkeypatch.setattr(dc, "run_stage", fake)
    assert dc.main(["--quick", "--out", str(tmp_path), "--only", "doctor,gpu_limit"]) == 0
    assert ran == ["doctor", *dc.GROUPS["gpu_limit"]]
    with pytest.raises(SystemExit, match="gpu_limit"):
        dc.main(["--quick", "--out", str(tmp_path), "--only", "nope"])


def test_the_profile_stage_reads_what_the_rollout_stages_write():
    """Each profiled `bench rollout` stage writes <dir>/<context>-<program>; the profile stage
    names exactly those folders (both rollout stages, dense and sparse at each context)."""
    from sparrow_jax.tools import device_check as dc
    by = {s.name: s for s in dc.stages(False, "run", "prof")}
    written = set()
    for name in ("rollout", "rollout_batch"):
        argv = by[name].argv
        d = argv[argv.index("--profile") + 1]
        contexts = argv[argv.index("--context") + 1:]
        contexts = contexts[:next((i for i, a in enumerate(contexts) if a.startswith("--")),
                                  len(contexts))]
        written |= {f"{d}/{c}-{p}" for c in contexts for p in ("dense", "sparse_1024_0_1")}
    assert set(by["profile"].argv[:-1]) == written and len(written) == 6


def test_the_decode_options_and_exact_groups_each_fit_one_call():
    """`--only decode_options` times the paged decode under each GPU compile setting of
    RolloutConfig (defaults first), `--only exact_gpu` the exact-sparse round; each group fits
    one 9-minute call, neither runs in a check without `--only`, and each setting reaches the
    bench as the gin binding RolloutConfig parses."""
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.tools import device_check as dc
    full = {s.name: s for s in dc.stages(False, "run")}
    for group in ("decode_options", "exact_gpu"):
        names = dc.GROUPS[group]
        assert set(names) <= set(dc.ON_REQUEST)
        assert sum(full[n].timeout_s for n in names) <= 9 * 60, group
    assert dc.GROUPS["decode_options"][0] == "opt_default"
    assert "--gin_param" not in full["opt_default"].argv[full["opt_default"].argv.index("8192"):]
    for name, binds in dc.DECODE_OPTIONS.items():
        argv = full[name].argv
        for bind in binds:
            assert argv[argv.index(bind) - 1] == "--gin_param"
            field, value = (x.strip() for x in bind.split("=", 1))
            RolloutConfig(**{field.split(".")[1]: eval(value)})     # a value it accepts
    assert "exact" in full["exact_round"].argv and "qwen3-1.7b" in full["exact_round"].argv
    quick = [s.name for s in dc.stages(True, "run") if s.name in dc.ON_REQUEST]
    assert quick == [s for s in full if s in dc.ON_REQUEST]
