"""Re-planning the exact_sparse per-bin gamma in a run (sparsity/round_costs.py,
train/exact_replan.py): the round-cost fit on synthetic call timings, the per-bin re-fit, the
Replanner's log, metrics and checkpoint state, and `sparrow train` re-planning and resuming."""

import json

import gin
import numpy as np
import pytest

from hf_fixtures import gin_argv, make_tiny_run, tiny_train_bindings
from sparrow_jax import cli
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.runtime.metrics import read_jsonl
from sparrow_jax.sparsity import cost_model, round_costs
from sparrow_jax.sparsity.schedule import Schedule
from sparrow_jax.train import exact_replan, plan as run_plan


def test_fit_recovers_known_round_costs():
    rng = np.random.default_rng(0)
    true, overhead = np.array([0.004, 0.009, 0.013]), 0.25      # s per round, s per call
    counts = rng.integers(0, 60, size=(12, 3))
    seconds = overhead + counts @ true + rng.normal(0, 1e-4, 12)
    fit = round_costs.fit_round_costs(counts, seconds, modelled=[1.0, 2.0, 3.0])
    assert fit.measured and fit.in_seconds and fit.calls == 12 and fit.note == ""
    np.testing.assert_allclose(fit.seconds, true, rtol=0.03)
    assert fit.overhead == pytest.approx(overhead, abs=0.01)


def test_underdetermined_fit_falls_back_to_modelled_ratios():
    modelled = [1.0, 2.0, 4.0]
    counts = np.array([[10, 0, 5], [20, 0, 3], [5, 0, 9]])      # gamma branch 1 never ran
    seconds = 0.1 + counts @ (0.002 * np.asarray(modelled))
    fit = round_costs.fit_round_costs(counts, seconds, modelled)
    assert not fit.measured and fit.in_seconds and "[1] never ran" in fit.note
    np.testing.assert_allclose(fit.seconds, 0.002 * np.asarray(modelled), rtol=1e-6)
    same = round_costs.fit_round_costs([[4, 4, 4]] * 3, [1.0, 1.0, 1.0], modelled)
    assert not same.measured and "too few different mixes" in same.note
    none = round_costs.fit_round_costs(np.zeros((0, 3)), [], modelled)
    assert not none.in_seconds and none.seconds == tuple(modelled) and "no timed call" in none.note
    with pytest.raises(ValueError, match="each > 0"):
        round_costs.fit_round_costs([[1, 1]], [1.0], [1.0, 0.0])


def test_replan_table_per_bin():
    gammas, costs = (0, 1, 2), (1.0, 1.3, 1.6)     # seconds of a round of gamma 0, 1, 2
    alpha = [0.95, 0.2, np.nan, 0.95, 0.9]
    rounds = [100, 100, 100, 3, 100]
    out = round_costs.replan_table((1, 1, 1, 1, 1), gammas, costs, alpha, rounds,
                                   min_rounds=10, first_approximate=4)
    assert [c.new for c in out] == [2, 0, 1, 1]          # bin 4 approximate: not re-planned
    assert out[0].speedup == pytest.approx((1 + .95 + .95 ** 2) / 1.6 / ((1 + .95) / 1.3))
    assert "alpha 0.950" in out[0].reason
    assert "no draft beats dense" in out[1].reason
    assert "no alpha measured" in out[2].reason and "< replan_min_rounds 10" in out[3].reason
    # Without a compiled dense step (0), dense is never chosen.
    no_dense = round_costs.replan_table((1, 1), (1, 2), (1.3, 1.6), [0.2, 0.95], [50, 50],
                                        min_rounds=10)
    assert [c.new for c in no_dense] == [1, 2]


def test_a_dense_bin_is_probed_after_staying_dense():
    """A dense bin (gamma 0) drafts nothing, so its alpha is never measured: with traffic and
    probe_after re-fits spent dense, it runs the smallest compiled draft length once."""
    gammas, costs = (0, 1, 2), (1.0, 1.3, 1.6)
    alpha, rounds = [np.nan, np.nan, np.nan, np.nan], [100, 100, 3, 100]
    out = round_costs.replan_table((0, 0, 0, 2), gammas, costs, alpha, rounds, min_rounds=10,
                                   dense_refits=(4, 3, 9, 0), probe_after=4)
    assert [c.new for c in out] == [1, 0, 0, 2]   # bin 1: too soon; 2: no traffic; 3: drafts
    assert out[0].probe and not any(c.probe for c in out[1:])
    assert "probe: dense through 4 re-fits" in out[0].reason and np.isnan(out[0].speedup)
    never = round_costs.replan_table((0,), gammas, costs, [np.nan], [100], min_rounds=10,
                                     dense_refits=(50,), probe_after=0)
    assert never[0].new == 0
    no_draft = round_costs.replan_table((0,), (0,), (1.0,), [np.nan], [100], min_rounds=10,
                                        dense_refits=(50,), probe_after=1)
    assert no_draft[0].new == 0                  # nothing compiled to probe with


def _replanner(**kw):
    rc = RolloutConfig(mode="exact_sparse", gamma=2, replan_gammas=(0, 1, 2), replan_every=2,
                       replan_min_rounds=10, gamma_by_bin=(1,), **kw)
    sched = Schedule(budgets=(48, 48, 64), bin_size=16, block_size=16)
    return exact_replan.Replanner(rc, sched, cost_model.MODEL_SHAPES["qwen3-1.7b"], None,
                                  batch=64)


def test_replanner_logs_changes_keeps_metrics_and_state(caplog):
    r = _replanner()
    assert r.table == (1, 1, 1) and not r.due(1) and r.due(2)
    for step, counts in ((1, [3, 10, 0]), (1, [0, 5, 8]), (2, [6, 0, 4]), (2, [2, 2, 2])):
        r.observe_call(step, counts, 0.1 + np.dot(counts, [0.010, 0.012, 0.014]))
    r.observe_rounds([{"bin": 0, "rounds": 40, "mean_alpha": 0.97},
                      {"bin": 1, "rounds": 4, "mean_alpha": 0.1},
                      {"bin": 2, "rounds": 40, "mean_alpha": float("nan")}])
    with caplog.at_level("INFO"):
        done = r.replan(2)
    assert ("round costs (ms) gamma_0 10, gamma_1 12, gamma_2 14; fitted on 4 calls"
            in done.lines[0])
    assert [c.bin for c in done.changed] == [0] and r.table == (2, 1, 1)
    assert "bin 0 (0-16 tokens): gamma 1 -> 2 (alpha 0.970 over 40 rounds" in caplog.text
    m = r.metrics(done)
    assert m["exact_plan/gamma_bin_00"] == 2 and m["exact_plan/bins_changed"] == 1
    assert m["exact_plan/costs_measured"] == 1
    assert m["exact_plan/round_ms/gamma_2"] == pytest.approx(14)
    assert r.rollout(RolloutConfig(mode="exact_sparse", gamma=2, replan_gammas=(0, 1, 2))
                     ).gamma_by_bin == (2, 1, 1)
    # The evidence starts anew; the state round-trips through JSON (the checkpoint's extra).
    assert not r.rounds.any()
    state = json.loads(json.dumps(r.state_dict()))
    back = _replanner()
    back.load_state_dict(state)
    assert back.table == (2, 1, 1) and list(back.calls) == list(r.calls)
    with pytest.raises(ValueError, match="does not fit"):
        back.load_state_dict({**state, "table": [4, 1, 1]})
    # Calls older than FIT_STEPS steps leave the fit.
    r.observe_call(2 + exact_replan.FIT_STEPS, [1, 1, 1], 0.1)
    assert [c[0] for c in r.calls] == [2 + exact_replan.FIT_STEPS]


def test_replanner_probes_a_bin_that_went_dense_and_decides_again(caplog):
    r = _replanner(replan_probe_after=2)
    dense_steps = [{"bin": 0, "rounds": 50, "mean_alpha": float("nan")}]
    # Re-fit 1: bin 0 measured a poor alpha -> dense. Re-fits 2-3: dense, nothing measured.
    r.observe_rounds([{"bin": 0, "rounds": 50, "mean_alpha": 0.05}])
    assert r.replan(2).changed[0].new == 0 and r.table[0] == 0
    assert list(r.dense_refits[:1]) == [1]
    r.observe_rounds(dense_steps)
    assert not r.replan(4).changed and r.dense_refits[0] == 2
    r.observe_rounds(dense_steps)
    with caplog.at_level("INFO"):
        probe = r.replan(6)
    assert [(c.bin, c.new) for c in probe.probed] == [(0, 1)] and r.table[0] == 1
    assert "bin 0 (0-16 tokens): gamma 0 -> 1 (50 dense rounds; probe: dense through 2" \
        in caplog.text
    assert r.metrics(probe)["exact_plan/bins_probed"] == 1 and r.dense_refits[0] == 0
    # The probe's interval measured a high alpha: drafts pay now (at the timed round costs
    # 10 / 12 / 14 ms).
    for counts in ([3, 10, 0], [0, 5, 8], [6, 0, 4], [2, 2, 2]):
        r.observe_call(8, counts, 0.1 + np.dot(counts, [0.010, 0.012, 0.014]))
    r.observe_rounds([{"bin": 0, "rounds": 50, "mean_alpha": 0.97}])
    assert r.replan(8).changed[0].new == 2
    state = json.loads(json.dumps(r.state_dict()))
    back = _replanner(replan_probe_after=2)
    back.load_state_dict(state)
    np.testing.assert_array_equal(back.dense_refits, r.dense_refits)
    old = {k: v for k, v in state.items() if k != "dense_refits"}   # a checkpoint before probes
    back.load_state_dict(old)
    assert not back.dense_refits.any()
    with pytest.raises(ValueError, match="replan_probe_after=-1 must be >= 0"):
        RolloutConfig(mode="exact_sparse", gamma=2, replan_gammas=(0, 2), replan_probe_after=-1)


def test_replanning_outside_exact_sparse_is_refused():
    from sparrow_jax.evaluation.reference import ReferenceEvalConfig
    from sparrow_jax.rl.distill import DistillConfig
    from sparrow_jax.rl.grpo import LossConfig
    from sparrow_jax.rl.learner import LearnerConfig
    from sparrow_jax.sparsity.controller import ControllerConfig
    from sparrow_jax.train.config import ConfigError, TrainConfig
    sched = Schedule(budgets=(48, 48), bin_size=16, block_size=16)
    with pytest.raises(ConfigError, match="replan_gammas = \\(0, 4\\) / replan_every = 2 "
                                          "re-plan exact_sparse rollouts, but the mode is"):
        run_plan.resolve(TrainConfig(model_path="m", train_data="d", rollout_mode="sparse"),
                         RolloutConfig(replan_gammas=(0, 4), replan_every=2), LearnerConfig(),
                         LossConfig(), sched, ControllerConfig(), DistillConfig(),
                         ReferenceEvalConfig())


# -- `sparrow train` ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("replan"))


def _train(root, steps):
    binds = tiny_train_bindings(root, "run", steps, TrainConfig__rollout_mode="'exact_sparse'",
                                RolloutConfig__gamma="2", RolloutConfig__gamma_by_bin="(1,)",
                                RolloutConfig__replan_gammas="(0, 1, 2)",
                                RolloutConfig__replan_every="1",
                                RolloutConfig__replan_min_rounds="4",
                                TrainConfig__checkpoint_every="1")
    gin.clear_config()
    return cli.main(["train", *gin_argv(binds)])


@pytest.mark.slow       # ~40 s: two short exact_sparse runs
def test_train_replans_every_step_and_resumes_with_the_plan(setup, capsys):
    root = setup
    assert _train(root, 2) == 0
    out, err = capsys.readouterr()
    text = out + err
    assert "exact_sparse re-plan at step 1: round costs" in text
    assert "exact_sparse re-plan at step 2: round costs" in text
    rows = {r["step"]: r for r in read_jsonl(root / "run") if "reward/mean" in r}
    assert rows[1]["exact_plan/bins_changed"] >= 0 and "exact_plan/gamma_bin_00" in rows[1]
    # Step 1 compiled its rollout: no timed call, the modelled ratios (unscaled); step 2's
    # call is timed.
    assert "exact_plan/round_modelled/gamma_0" in rows[1]
    assert "exact_plan/round_ms/gamma_0" in rows[2]
    plan2 = {k: v for k, v in rows[2].items() if k.startswith("exact_plan/gamma_bin_")}
    table = [int(plan2[f"exact_plan/gamma_bin_{j:02d}"]) for j in range(len(plan2))]
    assert table != [1] * len(table)        # bins re-planned away from the gin plan
    assert _train(root, 3) == 0
    out, err = capsys.readouterr()
    assert f"exact_sparse plan restored from step 2: gamma per bin {table}" in out + err
    # Step 3 ran the restored plan: its per-bin gamma metrics (exact_gamma/bin_xx) are it.
    step3 = [r for r in read_jsonl(root / "run") if r.get("step") == 3 and "reward/mean" in r][0]
    keys = [k for k in step3 if k.startswith("exact_gamma/bin_")]
    assert keys
    for key in keys:
        assert step3[key] == table[int(key[-2:])], key
