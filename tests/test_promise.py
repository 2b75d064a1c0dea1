"""`sparrow promise` (issue 56): the registered GPU experiment's config, its time plan, the
device check's `promise` stage, the packed checkpoint, the report's fields and the pooling of
runs; the CPU twin end to end, twice, pooled (slow: 140 s for the two runs at load ~4.7 on the
shared 2-core machine, 2026-11-28; one run through the device check 116 s, 87 s of CPU time)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gin
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = "configs/experiment_promise_gpu.gin"
TWIN = "configs/experiment_promise_twin.gin"


def parsed(*files: str):
    from sparrow_jax.experiment.prereg import PreregConfig
    from sparrow_jax.cli import parse_gin      # every configurable registered
    from sparrow_jax.experiment.promise import PromiseConfig
    from sparrow_jax.train.sft import SFTConfig
    gin.clear_config()
    parse_gin([str(REPO / f) for f in files], [])
    return PromiseConfig(), PreregConfig(), SFTConfig()


def test_the_gpu_experiment_is_registered_with_its_power_analysis():
    """Arms, seeds, endpoint, margin, test and power analysis are in the config; the seeds
    registered are the runs the power analysis needs; the RL prompts and references are none
    of the warm-up's."""
    from sparrow_jax.experiment.prereg import tost_power
    cfg, pre, sft = parsed(GPU)
    assert list(cfg.arms) == ["dense", "controller", "exact"]
    assert pre.reference == "dense" and pre.equivalent_arm == "controller"
    assert pre.metric == "eval_dense/ref_logp" and pre.margin > 0 and pre.planned_sd
    need = pre.planned_seeds()
    assert len(cfg.seeds) == need == len(set(cfg.seeds))
    assert tost_power(need, pre.planned_sd, pre.margin, pre.alpha) >= pre.power
    assert tost_power(need - 1, pre.planned_sd, pre.margin, pre.alpha) < pre.power
    assert sft.seed not in (cfg.train_seed, cfg.heldout_seed)
    assert cfg.train_seed != cfg.heldout_seed
    text = (REPO / GPU).read_text()
    assert f"needs {need} paired seeds" in text and "PRE-REGISTERED" in text
    # >= 8 layers, Qwen3-shaped, answers of 4-8K tokens, >= 256 rollout rows
    assert sft.num_layers >= 8 and cfg.k_range[0] * 81 >= 4000
    assert gin.query_parameter("TrainConfig.prompts_per_step") * gin.query_parameter(
        "TrainConfig.group_size") >= 256
    gin.clear_config()


def test_the_time_plan_fits_one_nine_minute_call(capsys):
    """The plan (from each arm's compile plan and the H200 numbers) fits the command's limit,
    which fits the device check's stage (540 s); docs/devices/README.md shows the same plan."""
    from sparrow_jax.experiment.promise import plan_for
    from sparrow_jax.tools import device_check as dc
    cfg, _, _ = parsed(GPU)
    plan = plan_for([str(REPO / GPU)], [], cfg)
    gin.clear_config()
    [stage] = [s for s in dc.stages(False, "run") if s.name == "promise"]
    assert plan.total <= cfg.time_limit_s < stage.timeout_s <= 9 * 60
    parts = [p.part for p in plan.parts]
    assert parts[:2] == ["start, data", "warm-up"] and parts[-1] == "report"
    assert [p for p in parts if p.startswith("arm ")] == [f"arm {a}" for a in cfg.arms]
    doc = (REPO / "docs/devices/README.md").read_text()
    assert "launch/device_check.sh --only promise" in doc
    for p in plan.parts:
        assert f"| {p.part} | {p.seconds:.0f} s |" in doc, p.part
    assert f"**{plan.total:.0f} s**" in doc
    # `sparrow promise CONFIG --plan` prints the same table and exits 0 (it fits)
    from sparrow_jax import cli
    assert cli.main(["promise", str(REPO / GPU), "--plan"]) == 0
    assert f"| **total** | **{plan.total:.0f} s** |" in capsys.readouterr().out
    gin.clear_config()


def test_the_promise_stage_runs_only_when_asked():
    """`--only promise` runs the registered config (quick: with the twin on top); a check
    without `--only` leaves it out (a call of its own)."""
    from sparrow_jax.tools import device_check as dc
    [full] = [s for s in dc.stages(False, "run", report="out/x") if s.name == "promise"]
    [quick] = [s for s in dc.stages(True, "run", report="out/x") if s.name == "promise"]
    assert full.argv[:2] == ("promise", GPU) and TWIN not in full.argv
    assert quick.argv[:3] == ("promise", GPU, TWIN)
    assert "--stem" in full.argv and "x-promise" in full.argv
    assert "promise" in dc.ON_REQUEST


def test_a_packed_checkpoint_is_one_file_and_unpacks_to_the_directory(tmp_path):
    from safetensors.numpy import load_file, save_file

    from sparrow_jax.runtime import packed_checkpoint
    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"hidden_size": 3}')
    (src / "tokenizer.json").write_text('{"vocab": ["a"]}')
    packed = tmp_path / "m.safetensors"
    packed_checkpoint.pack(src, packed)
    back = tmp_path / "back"
    packed_checkpoint.unpack(packed, back)
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in src.iterdir())
    for name in ("config.json", "tokenizer.json"):
        assert (back / name).read_text() == (src / name).read_text()
    np.testing.assert_array_equal(load_file(str(back / "model.safetensors"))["w"],
                                  load_file(str(src / "model.safetensors"))["w"])


def arm(mode: str, step_s: float, rollout_s: float, end: float, kv: float) -> dict:
    """An arm's report record as `promise_report.arm_record` writes it (the fields read)."""
    return {"status": "ok", "exit_code": 0, "seconds": 30.0, "seed": 1, "steps": 2,
            "mode": mode, "heldout_start": {"eval_dense/ref_logp": -900.0},
            "heldout_end": {"eval_dense/ref_logp": end},
            "split": {"rollout": rollout_s, "reward": 0.01, "probe": 0.1, "learner": 1.0},
            "step_s": step_s, "compile_s": 20.0, "tokens_per_s": 1000.0 / rollout_s,
            "kv_read": kv, "tail_by_bin": {0: 0.97}, "budget_by_bin": {0: 512},
            "tis_weight_mean": 1.0 if mode != "sparse" else 0.99,
            "balance": {"rows": 256, "context": 3000.0, "kv_bytes": 12.6e9 * kv,
                        "weight_bytes": 15e6, "other_bytes": 1e6, "kv_share": 0.99,
                        "bytes_limit_s": 6e-3 * kv, "launches": 300, "launch_floor_s": 1.5e-3,
                        "bytes_over_launches": 4 * kv, "measured_s": 8e-3 * kv}}


def report_of(seed: int, sha: str, ends: dict[str, float]):
    from sparrow_jax.experiment import promise_report
    rep = promise_report.Report(
        name="t", date="2026-11-28", device="cpu", config=(GPU,), overrides=(),
        config_sha=sha, seed=seed, registered_seed=True, steps=2, k_range=(2, 3),
        arm_names=("dense", "controller", "exact"), reference="dense",
        equivalent_arm="controller", metric="eval_dense/ref_logp", margin=1.0, alpha=0.05,
        time_limit_s=530.0, plan={"parts": [], "limit_s": 530.0, "total_s": 0.0},
        results_file="r.jsonl")
    for name, mode, step_s, rollout_s, kv in (("dense", "dense", 4.0, 3.0, 1.0),
                                              ("controller", "sparse", 2.0, 1.5, 0.4),
                                              ("exact", "exact_sparse", 3.0, 2.5, 0.5)):
        rep = rep.with_arm(name, arm(mode, step_s, rollout_s, ends[name], kv))
    return rep


def test_two_runs_pool_into_the_registered_test(tmp_path):
    """Each run appends its seed's endpoint values to the results file; the second run's
    report pools both: the difference per seed, the TOST with its interval, how many more
    runs the registered power analysis needs; another config's runs pool apart."""
    from sparrow_jax.experiment import promise, promise_pool, promise_report
    cfg, pre, _ = parsed(GPU)
    gin.clear_config()
    results = tmp_path / "r.jsonl"
    files = promise_report.ReportFiles(tmp_path, "run")
    first = promise.finish(report_of(101, "abc", {"dense": -800.0, "controller": -800.3,
                                                  "exact": -799.9}), files, results, pre, cfg, 0)
    assert first["pooled"]["runs"] == 1
    assert first["pooled"]["arms"]["controller"]["tost"] is None
    promise_pool.append(results, {**report_of(7, "other", {"dense": 0.0, "controller": 50.0,
                                                           "exact": 0.0}).pool_record()})
    assert promise_pool.next_seed(promise_pool.read(results), "abc", cfg.seeds) == (102, True)
    second = promise.finish(report_of(102, "abc", {"dense": -790.0, "controller": -789.9,
                                                   "exact": -790.2}), files, results, pre, cfg, 0)
    pooled = second["pooled"]
    assert pooled["runs"] == 2 and pooled["seeds_registered"] == len(cfg.seeds)
    c = pooled["arms"]["controller"]
    assert {int(k): round(v, 6) for k, v in c["diffs"].items()} == {101: -0.3, 102: 0.1}
    assert math.isclose(c["tost"]["mean"], -0.1) and c["tost"]["ci_low"] < -0.1 < c["tost"][
        "ci_high"]
    assert c["power"]["more_needed"] == pre.planned_seeds() - 2
    assert math.isclose(c["speedup_step"], 2.0) and math.isclose(c["kv_read"], 0.4)
    # the report: per arm the split, sparse/dense per step and per rollout, the targets
    assert second["comparisons"]["controller"]["speedup_rollout"] == 2.0
    targets = {(t["arm"], t["target"]): t["met"] for t in second["targets"]}
    assert targets[("controller", "RL step >= 1.3x faster")] is True
    assert targets[("controller", "rollout >= 1.5x faster")] is True
    assert targets[("exact", "TIS weight exactly 1")] is True
    md = files.md.read_text()
    assert "2 of 11 registered runs" in md and "**9 more runs**" in md
    assert "| controller | 256 | 3000 | 5040.0 | 15.0 | 0.99 |" in md    # bytes vs launches
    assert json.loads(files.json.read_text())["pooled"]["runs"] == 2


TWIN_FIELDS = ("status", "steps", "mode", "split", "step_s", "compile_s", "tokens_per_s",
               "kv_read", "tail_by_bin", "heldout_start", "heldout_end", "balance")


@pytest.mark.slow
def test_the_cpu_twin_runs_end_to_end_and_two_runs_pool(tmp_path):
    """`launch/device_check.sh --quick --only promise`: the twin's warm-up, three arms and
    report, every field the GPU run reports; a second run (the first's checkpoint file reused:
    no warm-up) pools with it."""
    out = tmp_path / "devices"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "launch" / "device_check.sh"), "--quick", "--out",
                        str(out), "--only", "promise"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [check] = list(out.glob("*-cpu-quick.json"))
    [stage] = json.loads(check.read_text())["stages"]
    assert stage["stage"] == "promise" and stage["status"] == "ok"
    [report] = list(out.glob("*-cpu-quick-promise.json"))
    rep = json.loads(report.read_text())
    assert rep["warmup"]["status"] == "ok" and rep["warmup"]["file_mib"] < 16
    assert rep["warmup"]["model"]["num_hidden_layers"] == 2
    for name in ("dense", "controller", "exact"):
        a = rep["arms"][name]
        assert all(k in a for k in TWIN_FIELDS), (name, sorted(a))
        assert a["status"] == "ok" and a["steps"] == 1 and a["step_s"] > 0
        assert set(a["split"]) == {"rollout", "reward", "probe", "learner"}
        assert a["balance"]["kv_bytes"] > 0 and a["balance"]["launches"] > 0
        assert name in rep["comparisons"]
    assert rep["arms"]["exact"]["tis_weight_mean"] == 1.0
    assert rep["heldout_start"]["eval_dense/ref_logp"] < 0
    assert any(r.get("bench") == "promise" for r in stage["results"])
    packed = report.with_suffix(".safetensors")
    again = subprocess.run(
        [sys.executable, "-m", "sparrow_jax.cli", "promise", GPU, TWIN, "--out", str(out),
         "--stem", "again", "--device", "cpu", "--checkpoint", str(packed)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rep2 = json.loads((out / "again.json").read_text())
    assert rep2["warmup"]["status"] == "reused" and rep2["seed"] == rep["seed"] + 1
    pooled = rep2["pooled"]
    assert pooled["runs"] == 2 and pooled["arms"]["controller"]["seeds"] == 2
    assert pooled["arms"]["controller"]["tost"] is not None
    assert len((out / "promise_twin_results.jsonl").read_text().splitlines()) == 2
    assert "Pooled: every run of this registered config (2 of 4" in (
        out / "again.md").read_text()
