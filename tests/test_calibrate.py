"""`sparrow calibrate` end to end on a tiny random model, plus its configuration errors."""

from __future__ import annotations

import json
import math

import gin

from hf_fixtures import make_tiny_synthetic_model
import numpy as np
import pytest

from sparrow_jax import cli
from sparrow_jax.sparsity.cost_model import ModelShape
from sparrow_jax.sparsity.exact_cost import plan_exact, plan_modes
from sparrow_jax.sparsity.schedule import load_schedule

GRID = (48, 64, 128)
TARGET = 0.995  # high enough that a random model needs different budgets in different bins

GIN = """
CalibrateConfig.bin_size = 32
CalibrateConfig.num_bins = 6
CalibrateConfig.num_prompts = 4
CalibrateConfig.group_size = 2
CalibrateConfig.max_new_tokens = 96
CalibrateConfig.min_bin_tokens = 20
CalibrateConfig.analyze_rows = 4
CalibrateConfig.hardware = "h100"
RolloutConfig.max_budget = 128
RolloutConfig.backend = "xla"
"""


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random 3-layer Qwen3 (layer 2 sparse) with the synthetic tokenizer, prompts, a gin file."""
    from sparrow_jax.data import synthetic

    root = tmp_path_factory.mktemp("calibrate")
    make_tiny_synthetic_model(root / "model", hidden=64, intermediate=128, heads=4, kv_heads=2,
                              rope_theta=1_000_000.0)
    # 20-letter tables: 45-token prompts; with <= 96 new tokens positions span bins 1-4 of 32.
    synthetic.write_jsonl(str(root / "prompts.jsonl"), 6, 0, (1, 1), 20)
    (root / "cal.gin").write_text(GIN)
    return root


def _argv(root, *extra, gin_file: str = "cal.gin", prompts: str = "prompts.jsonl"):
    return ["--log_level=WARNING", "calibrate", str(root / gin_file), "--model",
            str(root / "model"), "--prompts", str(root / prompts), *extra]


def test_calibrate_end_to_end(setup, capsys):
    out = setup / "out"
    rc = cli.main(_argv(setup, "--out", str(out), "--budgets", "64,48", "128",
                        "--target", str(TARGET)))
    assert rc == 0
    for name in ("schedule.json", "heatmap.png", "report.json"):
        assert (out / name).stat().st_size > 0, name
    printed = capsys.readouterr().out
    assert "tail alpha (p5) per bin" in printed and "predicted rollout speedup" in printed

    sched = load_schedule(str(out / "schedule.json"))
    assert sched.bin_size == 32 and sched.num_bins == 6 and sched.block_size == 16
    assert set(sched.budgets) <= set(GRID)
    assert list(sched.budgets) == sorted(sched.budgets)  # monotone over bins

    report = json.loads((out / "report.json").read_text())
    assert report["budgets"] == list(GRID) and report["target"] == TARGET
    assert math.isfinite(report["predicted_speedup"]) and report["predicted_speedup"] >= 1.0
    assert report["hardware"] == "h100"
    tails = np.array([[np.nan if v is None else v for v in row] for row in report["tails"]])
    counts = np.asarray(report["counts"])
    assert tails.shape == counts.shape == (len(GRID), 6)
    assert (counts[:, 1:5] > 0).all()  # several bins really filled
    # Per bin: the cheapest budget meeting the target, or flagged unmet (then the largest).
    for j in range(6):
        if (counts[:, j] < 20).any():
            continue
        meets = [b for b, t in zip(GRID, tails[:, j]) if t >= TARGET]
        if meets:
            assert report["picked"][j] == meets[0]
        else:
            assert j in report["unmet_bins"] and report["picked"][j] == GRID[-1]
    for row in report["per_budget"]:
        assert row["replay_err"] < 1e-4  # the replay reproduces the rollout's own logprobs
        assert 0.0 <= row["alpha_p1"] <= row["alpha_p5"] <= 1.0
        assert row["pred_speedup"] >= 1.0
    floor = report["noise_floor"]
    assert floor["exact"] and floor["tail_min"] > 0.999  # f32 dense vs dense: ~identical
    # The certified table (the controller's rule): every certified budget's bound is <= q.
    cert = report["certified"]
    certified = load_schedule(str(out / "certified_schedule.json"))
    assert certified.bin_size == 32 and certified.num_bins == 6
    ub = np.array([[np.nan if v is None else v for v in row] for row in cert["upper_bound"]])
    for j, b in enumerate(certified.budgets):
        if b in GRID:
            assert cert["certified"][GRID.index(b)][j] and ub[GRID.index(b), j] <= report["quantile"]
        else:
            assert j in cert["dense_bins"] and not any(row[j] for row in cert["certified"])
    assert "certified by the controller's rule" in printed
    # Exact sparse rollout's plan: the cost model's per-bin pick at the bins' mean alpha.
    means = {b: [np.nan if v is None or c < 20 else v for v, c in zip(
        row["mean_alpha_by_bin"], counts[i])] for i, (b, row) in enumerate(
        zip(GRID, report["per_budget"]))}
    want = plan_exact(ModelShape(**report["model_shape"]), "h100", (np.arange(6) + 0.5) * 32,
                      means, batch=report["cost_batch"])
    assert report["exact_plan"]["gammas"] == list(want.gammas)
    assert report["exact_plan"]["budgets"] == list(want.budgets)
    assert f"RolloutConfig.gamma_by_bin = {want.gammas}" in printed
    # The plan across modes: the same lossless plan, approximate bins only where certified and
    # as a suffix, its budgets as rollout_plan_schedule.json, and what it chose printed.
    plan = report["rollout_plan"]
    want_modes = plan_modes(ModelShape(**report["model_shape"]), "h100",
                            (np.arange(6) + 0.5) * 32, means, certified.budgets,
                            batch=report["cost_batch"], weights=plan["weights"])
    assert plan["modes"] == [m.value for m in want_modes.modes]
    assert plan["approximate_from_bin"] == want_modes.approximate_from_bin
    assert list(load_schedule(str(out / "rollout_plan_schedule.json")).budgets) == plan["budgets"]
    k = plan["approximate_from_bin"]
    if k:
        assert all(b == certified.budgets[j] for j, b in enumerate(plan["budgets"]) if j >= k)
        assert f"RolloutConfig.approximate_from_bin = {k}" in printed
    else:
        assert "plan across modes: no approximate bins" in printed


@pytest.mark.parametrize("extra, message", [
    (["--budgets", "48", "50"], "multiples of the block size"),
    (["--budgets", "32"], "at least 3 blocks"),
    (["--budgets", "48", "1024"], "exceeds RolloutConfig.max_budget"),
    (["--gin_param", "CalibrateConfig.budgets = ()"], "budget grid is empty"),
    (["--budgets", "4x8"], "not an integer"),
    (["--budgets", "48", "--target", "1.5"], "target must be in"),
    (["--budgets", "48", "--gin_param", "CalibrateConfig.hardware = 'abacus'"],
     "unknown hardware"),
])
def test_config_errors(setup, extra, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(_argv(setup, *extra))


@pytest.mark.parametrize("case, message", [
    ("model", "has no config.json"), ("prompts", "prompt file not found"), ("none", "no model")])
def test_missing_inputs(setup, tmp_path, case, message):
    # One cli.main per test: the CLI finalizes (locks) the gin config it parsed.
    model = tmp_path / "nope" if case == "model" else setup / "model"
    prompts = tmp_path / "missing.jsonl" if case == "prompts" else setup / "prompts.jsonl"
    paths = [] if case == "none" else ["--model", str(model), "--prompts", str(prompts)]
    with pytest.raises(SystemExit, match=message):
        cli.main(["calibrate", str(setup / "cal.gin"), *paths])


# The plan across modes end to end: enough rows that the controller's rule certifies budgets
# (its 95% bound needs ~60 rows with no exceedance), a target the random model meets at the
# smallest budget, and 4 bins so that the certified bins 1-3 form the suffix the planner may
# run unverified. On the h100 cost model approximate sparse at 48 tokens then beats exact
# sparse's best (gamma 4 at alpha ~0.98) in the long bins.
MODES_GIN = GIN.replace("num_prompts = 4", "num_prompts = 32").replace(
    "num_bins = 6", "num_bins = 4")
assert "num_prompts = 32" in MODES_GIN and "num_bins = 4" in MODES_GIN


@pytest.fixture(scope="module")
def modes_run(setup):
    """`sparrow calibrate` whose plan across modes has approximate bins: (out dir, printed)."""
    import contextlib
    import io

    from sparrow_jax.data import synthetic

    synthetic.write_jsonl(str(setup / "prompts40.jsonl"), 40, 0, (1, 1), 20)
    (setup / "modes.gin").write_text(MODES_GIN)
    out = setup / "modes_out"
    gin.clear_config()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            assert cli.main(_argv(setup, "--out", str(out), "--budgets", "48", "64", "128",
                                  "--target", "0.98", gin_file="modes.gin",
                                  prompts="prompts40.jsonl")) == 0
    finally:
        gin.clear_config()
    return out, printed.getvalue()


def _faster_lines(printed: str) -> list[str]:
    """The gin lines under calibrate's "faster, not lossless" heading."""
    lines = printed.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("faster, not lossless"))
    return [x.strip() for x in lines[start + 1:] if x.startswith("  ")
            and x.strip().startswith(("TrainConfig.", "RolloutConfig.", "make_schedule."))]


def test_calibrate_plans_approximate_bins_where_certified(modes_run):
    from sparrow_jax.experiment.calibrate import exact_plan_config

    out, printed = modes_run
    report = json.loads((out / "report.json").read_text())
    plan, cert = report["rollout_plan"], report["certified"]
    k = plan["approximate_from_bin"]
    certified = list(load_schedule(str(out / "certified_schedule.json")).budgets)
    # Approximate bins: a non-empty suffix, each at the budget the controller's rule certified,
    # none where it certified nothing (dense bins), and not predicted slower than lossless.
    assert k >= 1, plan["reasons"]
    assert plan["modes"][k:] == ["approximate"] * (4 - k)
    assert "approximate" not in plan["modes"][:k]
    assert not set(range(k, 4)) & set(cert["dense_bins"])
    assert plan["budgets"][k:] == certified[k:]
    assert all(g == 0 for g in plan["gammas"][k:])    # an approximate bin verifies nothing
    assert plan["overall_speedup"] >= plan["lossless_overall_speedup"]
    assert list(load_schedule(str(out / "rollout_plan_schedule.json")).budgets) == \
        plan["budgets"]
    assert f"bins {k}+ approximate sparse at the certified budgets" in printed
    assert _faster_lines(printed) == exact_plan_config(
        tuple(plan["gammas"]), report["files"]["plan"], k)


@pytest.mark.slow       # one RL step; the printed lines are checked above (CI)
def test_the_printed_plan_across_modes_trains(modes_run, setup):
    """What calibrate printed under "faster, not lossless", pasted into a training config,
    trains: verified tokens in the dense bins, unverified (budget recorded) in the approximate."""
    from hf_fixtures import gin_text, tiny_train_bindings

    out, printed = modes_run
    binds = tiny_train_bindings(setup, "modes_train", 1, make_schedule__budgets=None,
                                make_schedule__bin_size=None,
                                TrainConfig__train_data=repr(str(setup / "prompts40.jsonl")))
    config = setup / "modes_train.gin"
    config.write_text(gin_text(binds) + "\n".join(_faster_lines(printed)) + "\n")
    gin.clear_config()
    try:
        assert cli.main(["--log_level=WARNING", "train", str(config)]) == 0
    finally:
        gin.clear_config()
    rows = [json.loads(x) for x in (setup / "modes_train" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [1]
    m = rows[0]
    # Tokens in bins 0-1 decoded densely (verified: the dense policy's, within f32), those in
    # the approximate bins by unverified drafts at the certified budget.
    assert 0 < m["exact/approximate_frac"] < 1, m
    assert m["exact/logp_max_abs_diff"] < 1e-4
    plan = json.loads((out / "report.json").read_text())["rollout_plan"]
    k = plan["approximate_from_bin"]
    assert m[f"budget/bin_{k:02d}"] == plan["budgets"][k]
