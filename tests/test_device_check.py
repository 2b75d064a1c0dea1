"""`launch/device_check.sh --quick` on CPU: every stage runs under its timeout and the dated
markdown + JSON report names each stage's status, results and compile seconds; a stage that
fails leaves the others' results in the report. (~2 min on an idle 2-core machine, several
under load: 4 processes, each importing jax and compiling; marked slow.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_device_check_writes_its_report(tmp_path):
    out = tmp_path / "devices"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "launch" / "device_check.sh"), "--quick", "--out",
                        str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [report] = list(out.glob("*-cpu-quick.json"))
    rep = json.loads(report.read_text())
    assert [s["stage"] for s in rep["stages"]] == ["doctor", "kernels", "rollout", "train"]
    assert all(s["status"] == "ok" and s["seconds"] <= s["timeout_s"] for s in rep["stages"])
    assert rep["device"]["platform"] == "cpu" and rep["device"]["jax"]
    by = {s["stage"]: s for s in rep["stages"]}
    # The benchmarks' JSON lines are kept: dense and sparse decode, kernel rows.
    modes = {x.get("mode") for x in by["rollout"]["results"]}
    assert {"dense", "sparse"} <= modes, by["rollout"]["results"]
    assert by["kernels"]["results"]
    # Training logs each compile with its seconds (the compile log).
    assert any("decode_chunk_program" in c["program"] for c in by["train"]["compiles"])
    md = report.with_suffix(".md").read_text()
    assert md.startswith("# Device check ") and "| train | ok |" in md


def test_a_failed_stage_keeps_the_others(tmp_path, monkeypatch):
    """A stage that fails (here: a bad flag) is reported as failed with its output; the report
    is written after every stage. Stage processes are stubbed: no jax start-up."""
    from sparrow_jax.tools import device_check as dc

    stages = [dc.Stage("good", ("--version",), 60, "prints a version"),
              dc.Stage("bad", ("--no-such-flag",), 60, "fails")]
    monkeypatch.setattr(dc, "stages", lambda quick, run_dir: stages)
    monkeypatch.setattr(dc, "device_summary", lambda: {"kind": "cpu", "devices": 1})

    def fake(stage, log_dir):
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
    sleeper.write_text("#!/bin/bash\necho started; sleep 30\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(dc.sys, "executable", str(sleeper))
    rec = dc.run_stage(dc.Stage("hung", ("doctor",), 1, "hangs"), tmp_path)
    assert rec["status"] == "timeout" and rec["returncode"] is None and rec["seconds"] < 20
    assert (tmp_path / "hung.log").read_text().count("doctor") == 1
