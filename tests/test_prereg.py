"""sparrow_jax.experiment.prereg: TOST, the one-sided lag test and the tail-vs-mean predictor,
against scipy's own t-tests and rank correlation."""

import numpy as np
import pytest
from scipy import stats

from sparrow_jax.experiment import prereg


def test_tost_matches_two_scipy_one_sided_tests():
    d = np.array([0.004, -0.006, 0.010, 0.001, -0.002])
    margin = 0.02
    r = prereg.tost(d, margin, 0.05)
    lo = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    hi = stats.ttest_1samp(d, margin, alternative="less").pvalue
    assert r["p_low"] == pytest.approx(lo) and r["p_high"] == pytest.approx(hi)
    assert r["p"] == pytest.approx(max(lo, hi)) and r["equivalent"]
    # Equivalence <=> the 90% interval inside the margins.
    ci = stats.t.interval(0.90, d.size - 1, loc=d.mean(), scale=stats.sem(d))
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(ci)
    assert not prereg.tost(d + 0.03, margin)["equivalent"]
    assert not prereg.tost([0.05, -0.05, 0.04, -0.04], margin)["equivalent"]   # too noisy


def test_lag_test_matches_scipy():
    d = np.array([-0.03, -0.01, -0.02, -0.005])
    r = prereg.lag_test(d)
    assert r["p"] == pytest.approx(stats.ttest_1samp(d, 0.0, alternative="less").pvalue)
    assert r["lags"]
    assert not prereg.lag_test(-d)["lags"]
    with pytest.raises(ValueError, match=">= 2 seeds"):
        prereg.lag_test([0.1])


def test_spearman_matches_scipy():
    x, y = [3, 1, 2, 2, 5], [0.1, 0.4, 0.2, 0.3, 0.05]
    assert prereg.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic)
    assert np.isnan(prereg.spearman([1, 1, 1], [1, 2, 3]))


def _rows(final, fails, alpha, kv, seconds=10.0):
    return [{"step": 0, "eval_dense/ref_p_exact": 0.08},
            {"step": 1, "schedule/bins_below_target": fails, "alpha/alpha_mean": alpha,
             "kv/read_model": kv, "time/rollout": seconds},
            {"step": 2, "schedule/bins_below_target": fails, "alpha/alpha_mean": alpha,
             "kv/read_model": kv, "time/rollout": seconds, "eval_dense/ref_p_exact": final}]


def test_analyse_reads_the_registered_seeds_only():
    cfg = prereg.PreregConfig(margin=0.02, seeds=(11, 12, 13, 14))
    rng = np.random.default_rng(0)
    results = {}
    for s in (11, 12, 13, 14, 0):         # seed 0 was used for tuning: ignored
        base = 0.13 + 0.01 * rng.standard_normal()
        results[f"dense@{s}"] = _rows(base, 0, 0.99, 1.0, 20.0)
        # Both arms' mean alpha from one distribution: it says nothing about which arm lags.
        results[f"controller@{s}"] = _rows(base + 0.002 * rng.standard_normal(), 0,
                                           0.985 + 0.001 * rng.standard_normal(), 0.4)
        results[f"M@{s}"] = _rows(base - 0.03 + 0.003 * rng.standard_normal(), 6,
                                  0.985 + 0.001 * rng.standard_normal(), 0.4)
    res = prereg.analyse(results, cfg)
    assert set(res["arms"]["controller"]["diffs"]) == {"11", "12", "13", "14"}
    assert res["tost"]["equivalent"] and res["lag"]["lags"]
    # M's tail failures line up with its loss, its mean alpha does not: the tail predicts.
    assert res["predictor"]["runs"] == 8 and res["predictor"]["tail_better"]
    assert res["arms"]["dense"]["kv_read"] == 1.0 and res["arms"]["M"]["kv_read"] == 0.4
    assert res["arms"]["dense"]["rollout_s"] == 40.0
    text = prereg.prereg_markdown(res)
    assert "**equivalent**" in text and "**lags**" in text and "**the tail** predicts" in text
    del results["M@14"]
    assert prereg.analyse(results, cfg)["missing"] == ["M@14"]
    with pytest.raises(ValueError, match="margin"):
        prereg.PreregConfig(margin=0.0)


def test_the_experiment_runner_writes_the_registered_report(tmp_path):
    import gin

    from sparrow_jax.experiment import runner
    rows = {f"{arm}@{s}": _rows(0.1 + 0.01 * i + (0.0 if arm != "M" else -0.02), 0, 0.98, 0.5)
            for i, s in enumerate((11, 12, 13)) for arm in ("dense", "controller", "M")}
    gin.clear_config()
    try:
        gin.parse_config("PreregConfig.seeds = (11, 12, 13)\nPreregConfig.margin = 0.01")
        cfg = runner.ExperimentConfig(arms={name: [] for name in rows})
        runner.write_reports(tmp_path, rows, cfg, eval_prompts=32)
    finally:
        gin.clear_config()
    text = (tmp_path / "comparison_prereg.md").read_text()
    assert "seeds 11, 12, 13" in text and "margin 0.01" in text and "**equivalent**" in text


def test_the_registered_config_parses_every_arm():
    from pathlib import Path

    import gin

    from sparrow_jax import cli
    from sparrow_jax.experiment import runner
    from sparrow_jax.runtime import config_check
    repo = Path(__file__).resolve().parents[1]
    files = [str(repo / f"configs/{n}.gin")
             for n in ("demo_cpu", "controller_certified", "experiment_promise")]
    try:
        cli.parse_gin(files, [])
        cfg, pre = runner.ExperimentConfig(), prereg.PreregConfig()
        assert pre.seeds == ("11", "12", "13", "14") and pre.margin == 0.02
        assert {n.split("@")[0] for n in cfg.arms} == {"dense", "controller", "M"}
        assert {n.split("@")[1] for n in cfg.arms} == set(pre.seeds)
        for name in cfg.arms:
            cli.parse_gin(files, runner.arm_bindings(cfg, name))
            config_check.check_bindings()          # as `sparrow train` does before it runs
            assert gin.query_parameter("ControllerConfig.raise_on") == "lower"
            assert gin.query_parameter("ControllerConfig.lower_margin") == 1.0
    finally:
        gin.clear_config()
