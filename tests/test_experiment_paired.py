"""sparrow_jax.experiment_paired: per-seed paired differences to dense with a 95% t-interval and
the KV fraction per arm; configs/experiment_paired.gin parses with every arm's bindings."""

from pathlib import Path

import gin
import pytest

from sparrow_jax import cli
from sparrow_jax.experiment_paired import paired_differences, paired_markdown, write_paired_report


def _rows(first, last, kv=None):
    rows = [{"step": 0, "eval_dense/ref_p_exact": first}, {"step": 1, "reward/mean": 0.1},
            {"step": 2, "eval_dense/ref_p_exact": last}]
    if kv is not None:
        rows[1]["schedule/kv_fraction"] = kv
    return rows


def test_paired_differences_and_report(tmp_path):
    d = paired_differences({"dense": {"0": 0.10, "1": 0.20, "2": 0.30},
                            "ctrl": {"0": 0.12, "1": 0.21, "2": 0.33}, "solo": {"0": 0.5}})
    assert d["ctrl"]["n"] == 3 and d["ctrl"]["mean"] == pytest.approx(0.02)
    # t(0.975, 2) = 4.303; sd of (0.02, 0.01, 0.03) = 0.01
    half = 4.303 * 0.01 / 3 ** 0.5
    assert d["ctrl"]["ci_low"] == pytest.approx(0.02 - half)
    assert d["ctrl"]["ci_high"] == pytest.approx(0.02 + half)
    assert d["solo"]["n"] == 1 and d["solo"]["ci_low"] != d["solo"]["ci_low"]   # NaN: one seed
    results = {"dense@0": _rows(0.06, 0.10), "dense@1": _rows(0.06, 0.20),
               "controller@0": _rows(0.06, 0.12, kv=0.4), "controller@1": _rows(0.06, 0.18, kv=0.5)}
    text = paired_markdown(results)
    assert "| controller | 2 | 0.0600 -> 0.1500 | 0: +0.0200, 1: -0.0200 |" in text
    assert "| dense | 2 | 0.0600 -> 0.1500 | (reference) | | 1.000 |" in text
    assert "0.450 |" in text
    assert write_paired_report(tmp_path, results).read_text() == text
    assert write_paired_report(tmp_path, {"dense": []}) is None


def test_paired_experiment_config_parses_every_arm():
    from sparrow_jax import experiment
    repo = Path(__file__).resolve().parents[1]
    files = [str(repo / "configs/demo_cpu.gin"), str(repo / "configs/experiment_paired.gin")]
    cli.parse_gin(files, [])
    cfg = experiment.ExperimentConfig()
    assert len(cfg.arms) == 12
    for name in cfg.arms:
        cli.parse_gin(files, experiment._arm_bindings(cfg, name))
        seed = int(name.split("@")[1])
        assert gin.query_parameter("TrainConfig.seed") == seed
    gin.clear_config()
