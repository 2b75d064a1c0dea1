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
    """A run's metrics.jsonl rows; fails None: no controller record (dense, a fixed table)."""
    tail = {} if fails is None else {"schedule/bins_below_target": fails}
    return [{"step": 0, "eval_dense/ref_p_exact": 0.08},
            {"step": 1, **tail, "alpha/alpha_mean": alpha, "kv/read_model": kv,
             "time/rollout": seconds},
            {"step": 2, **tail, "alpha/alpha_mean": alpha, "kv/read_model": kv,
             "time/rollout": seconds, "eval_dense/ref_p_exact": final}]


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


def test_fixed_table_arms_make_the_predictor_test_invalid_not_a_winner():
    """Issue 41's M was a fixed table: it logs no tail failures, so its 0 is by construction
    (calibration showed it failing in 5 bins). The report names no predictor winner then."""
    cfg = prereg.PreregConfig(margin=0.02, seeds=(11, 12, 13, 14))
    rng = np.random.default_rng(1)
    results = {}
    for s in (11, 12, 13, 14):
        base = 0.13 + 0.01 * rng.standard_normal()
        results[f"dense@{s}"] = _rows(base, None, 0.99, 1.0)
        results[f"controller@{s}"] = _rows(base - 0.01 * rng.random(), 2 * rng.random(),
                                           0.9995, 0.75)
        results[f"M@{s}"] = _rows(base - 0.04 * rng.random(), None, 0.998, 0.61)   # fixed
    res = prereg.analyse(results, cfg)
    p = res["predictor"]
    assert p["invalid"] == prereg.PREDICTOR_INVALID and p["tail_better"] is None
    assert p["unlogged"] == [f"M@{s}" for s in (11, 12, 13, 14)]
    assert "rho_tail" not in p
    assert np.isnan(res["arms"]["M"]["tail_failures"])        # not logged, not "0 failures"
    text = prereg.prereg_markdown(res)
    assert "invalid: fixed-table arms log no tail failures" in text
    assert "predicts better" not in text and "**the tail**" not in text
    assert "| M | 0.610 | 20.0 | 0.9980 | not logged |" in text
    # Only runs with a controller record: the comparison is computed and a winner named.
    only = {k: v for k, v in results.items() if not k.startswith("M@")}
    valid = prereg.analyse(only, cfg)["predictor"]
    assert "invalid" not in valid and valid["tail_better"] in (True, False)


def test_tost_power_is_exact_against_simulation_and_sizes_the_registered_test():
    sd, margin = 0.0404, 0.02          # the registered run's spread of controller - dense
    # The registered 4-seed test had ~2% power; the exact integral matches simulation.
    assert prereg.tost_power(4, sd, margin) == pytest.approx(0.0176, abs=0.001)
    rng = np.random.default_rng(0)
    for n, true in ((4, 0.0), (12, 0.0), (12, 0.01)):
        d = rng.normal(true, sd, (200_000, n))
        m, se = d.mean(1), d.std(1, ddof=1) / np.sqrt(n)
        t = stats.t.ppf(0.95, n - 1)
        shown = np.mean((m - t * se > -margin) & (m + t * se < margin))
        assert prereg.tost_power(n, sd, margin, true_diff=true) == pytest.approx(shown, abs=0.003)
    n = prereg.seeds_needed(sd, margin, 0.05, 0.8)
    assert prereg.tost_power(n, sd, margin) >= 0.8 > prereg.tost_power(n - 1, sd, margin)
    assert n == 37
    assert prereg.seeds_needed(0.001, margin) == 2


def test_the_report_says_how_many_more_seeds_and_the_pooled_estimate():
    cfg = prereg.PreregConfig(margin=0.02, seeds=(11, 12, 13, 14), planned_sd=0.0404)
    assert cfg.planned_seeds() == 37
    d = {"11": 0.0098, "12": -0.0335, "13": -0.0054, "14": -0.0822}    # the registered run
    results = {}
    for s, x in d.items():
        results[f"dense@{s}"] = _rows(0.13, None, 0.99, 1.0)
        results[f"controller@{s}"] = _rows(0.13 + x, 1.0, 0.9995, 0.75)
    res = prereg.analyse(results, cfg)
    w = res["power"]
    assert w["needed"] == 37 and w["seeds"] == 4 and w["more_needed"] == 33
    assert w["observed_sd"] == pytest.approx(np.std(list(d.values()), ddof=1))
    assert w["power_now"] == pytest.approx(0.0176, abs=0.001)
    text = prereg.prereg_markdown(res)
    assert "**37 seeds needed**" in text and "**33 more needed**" in text
    assert "Pooled estimate: -0.0278, 90% CI [-0.0754, +0.0198] over 4 seeds" in text
    assert prereg.analyse(results, prereg.PreregConfig(seeds=(11, 12)))["power"] is None
    with pytest.raises(ValueError, match="planned_sd"):
        prereg.PreregConfig(planned_sd=0.0)


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
        # The power analysis registered after the first run (issue 56): seeds for 80% power.
        assert pre.planned_sd == 0.0404 and pre.power == 0.8 and pre.planned_seeds() == 37
        assert {n.split("@")[0] for n in cfg.arms} == {"dense", "controller", "M"}
        assert {n.split("@")[1] for n in cfg.arms} == set(pre.seeds)
        for name in cfg.arms:
            cli.parse_gin(files, runner.arm_bindings(cfg, name))
            config_check.check_bindings()          # as `sparrow train` does before it runs
            assert gin.query_parameter("ControllerConfig.raise_on") == "lower"
            assert gin.query_parameter("ControllerConfig.lower_margin") == 1.0
    finally:
        gin.clear_config()
