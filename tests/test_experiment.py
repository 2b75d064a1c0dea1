"""`sparrow experiment`: arms side by side from one base config, comparison files, resume."""

from pathlib import Path

import gin
import pytest

from hf_fixtures import gin_text, make_tiny_run, tiny_train_bindings
from sparrow_jax import cli
from sparrow_jax.experiment.runner import budget_mean, final_values
from sparrow_jax.runtime.metrics import read_jsonl


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = make_tiny_run(tmp_path_factory.mktemp("experiment"), train_rows=8, eval_rows=2)
    binds = tiny_train_bindings(root, run=None, steps=2,
                                TrainConfig__eval_data=repr(str(root / "eval.jsonl")),
                                TrainConfig__eval_prompts="2",
                                TrainConfig__eval_every="2",
                                TrainConfig__checkpoint_every="1",
                                RolloutConfig__max_new_tokens="24")
    cfg = root / "exp.gin"
    cfg.write_text(gin_text(binds) + f"""
ExperimentConfig.output_dir = '{root / 'out'}'
ExperimentConfig.arms = {{
    'dense': ["TrainConfig.rollout_mode = 'dense'"],
    'fixed48': ["TrainConfig.adapt_schedule = False", "TrainConfig.eval_at_start = False"],
}}
""")
    return root, cfg


def _run(argv):
    gin.clear_config()
    return cli.main(["experiment", *argv])


def test_two_arms_write_comparison_and_resume(base, capsys):
    root, cfg = base
    assert _run([str(cfg)]) == 0
    out = root / "out"
    md = (out / "comparison.md").read_text()
    assert (out / "comparison.png").stat().st_size > 10_000
    assert "| dense |" in md and "| fixed48 |" in md
    for arm in ("dense", "fixed48"):
        rows = read_jsonl(out / arm)
        assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
        assert (out / arm / "checkpoints" / "2").is_dir()
    # The arms differ only in their bindings: the sparse arm measured a tail, the dense one not.
    sparse_rows = [r for r in read_jsonl(out / "fixed48") if "reward/mean" in r]
    dense_rows = [r for r in read_jsonl(out / "dense") if "reward/mean" in r]
    assert all("alpha/tail_min" in r for r in sparse_rows)
    assert not any("alpha/tail_min" in r for r in dense_rows)
    assert "operative_config" not in md
    ops = (out / "dense" / "operative_config.gin").read_text()
    assert "TrainConfig.rollout_mode = 'dense'" in ops
    # TrainConfig.eval_at_start = False skips the step-0 evaluation, not the last one.
    assert [r["step"] for r in read_jsonl(out / "dense") if "eval_dense/reward" in r] == [0, 2]
    assert [r["step"] for r in read_jsonl(out / "fixed48") if "eval_dense/reward" in r] == [2]
    # A run's first evaluation compiles its programs: no speeds from it, wherever it falls.
    for arm, first_eval in (("dense", 0), ("fixed48", 2)):
        row = next(r for r in read_jsonl(out / arm) if r["step"] == first_eval)
        assert not any(k.endswith(("/tokens_per_s", "/seconds")) and k.startswith("eval_")
                       for k in row), row
    assert "eval_dense/tokens_per_s" in next(r for r in read_jsonl(out / "dense") if r["step"] == 2)
    start = next(r["eval_dense/reward"] for r in read_jsonl(out / "dense") if r["step"] == 0)
    assert f"| fixed48 | 2 | {start:.3f}* -> " in md and "no step-0 evaluation in this arm" in md
    # Re-running finds both arms finished: no new steps, the report is rewritten. With
    # --parallel 2 each arm is a `sparrow train` subprocess on the same gin files, which
    # resumes the finished run at its last step and returns.
    assert _run([str(cfg)]) == 0
    assert [r["step"] for r in read_jsonl(out / "dense") if "reward/mean" in r] == [1, 2]
    assert _run([str(cfg), "--parallel", "2"]) == 0
    for arm in ("dense", "fixed48"):
        assert [r["step"] for r in read_jsonl(out / arm) if "reward/mean" in r] == [1, 2]
        assert "resumed from" in (out / f"{arm}.log").read_text()
    assert _run([str(cfg), "--report_only", "--arms", "fixed48"]) == 0
    assert "| dense |" not in (out / "comparison.md").read_text()
    with pytest.raises(SystemExit, match="unknown arm"):
        _run([str(cfg), "--arms", "nope"])


def test_exact_sparse_arm_beside_dense(base):
    """An exact-sparse arm (`TrainConfig.rollout_mode = 'exact_sparse'`, issue 42) beside the
    dense one, same base and seed: its samples are the dense policy's, so the learner sees no
    mismatch (TIS weights 1, nothing rejected or vetoed, recorded = learner logprobs to 1e-5),
    greedy held-out decoding equals dense greedy, and the acceptance per bin is logged beside
    its alpha prediction. Reuses the dense arm of the test above when it ran first."""
    root, cfg = base
    arms = ("{'dense': [\"TrainConfig.rollout_mode = 'dense'\"], 'exact': "
            "[\"TrainConfig.rollout_mode = 'exact_sparse'\", \"RolloutConfig.gamma = 3\"]}")
    assert _run([str(cfg), "--gin_param", f"ExperimentConfig.arms = {arms}",
                 "--gin_param", "ExperimentConfig.report = 'comparison_exact'"]) == 0
    out = root / "out"
    assert "| exact |" in (out / "comparison_exact.md").read_text()
    rows = read_jsonl(out / "exact")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["loss/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5), r
        assert r["loss/tis_capped_frac"] == 0 and r["loss/token_rejected_frac"] == 0
        assert r["loss/seq_vetoed_frac"] == 0
        assert r["exact/logp_max_abs_diff"] < 1e-5
        assert "alpha/tail_min" not in r            # no controller, no replayed mismatch
        bins = sorted(k.split("/")[1] for k in r if k.startswith("exact_tokens_per_pass/"))
        assert bins, r
        for b in bins:
            assert 1.0 <= r[f"exact_tokens_per_pass/{b}"] <= 4.0
            assert 1.0 <= r[f"exact_predicted/{b}"] <= 4.0
        assert 0 < r["exact/accepted_frac"] < 1 and 0 < r["exact/alpha_mean"] <= 1.0 + 1e-6
        assert 0 < r["exact/kv_read_model"] and r["kv/read_model"] == 1.0    # samples: dense
    # Greedy held-out decoding: exact sparse gives dense greedy's tokens, hence its rewards.
    evals = [r for r in rows if "eval_exact_sparse/reward" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval_exact_sparse/reward"] == r["eval_dense/reward"]
        assert r["eval_exact_sparse/response_length"] == r["eval_dense/response_length"]
    dense0 = next(r for r in read_jsonl(out / "dense") if r["step"] == 0)
    assert evals[0]["eval_dense/reward"] == dense0["eval_dense/reward"]     # same start


@pytest.mark.slow
def test_exact_sparse_arm_with_approximate_bins(base, capfd):
    """A plan across modes (issue 57: `sparrow calibrate`'s rollout_plan lines): exact_sparse
    with bins 2+ approximate (`RolloutConfig.approximate_from_bin`; the tiny rows' tokens sit in
    bins 0-2). Those tokens are unverified drafts recorded with their budget; the verified ones
    are still the dense policy's (recorded = learner logprobs to 1e-5), and the learner's TIS
    sees the rest."""
    root, cfg = base
    arms = ("{'mixed': [\"TrainConfig.rollout_mode = 'exact_sparse'\", "
            "\"RolloutConfig.gamma = 2\", \"RolloutConfig.approximate_from_bin = 2\", "
            "\"TrainConfig.adapt_schedule = False\", \"TrainConfig.eval_at_start = False\"]}")
    assert _run([str(cfg), "--gin_param", f"ExperimentConfig.arms = {arms}",
                 "--gin_param", "ExperimentConfig.report = 'comparison_mixed'"]) == 0
    out = root / "out"
    assert "length bins 2+ decode approximately sparse" in capfd.readouterr().err
    steps = [r for r in read_jsonl(out / "mixed") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 < r["exact/approximate_frac"] < 1, {k: v for k, v in r.items() if "exact" in k}
        assert r["exact/logp_max_abs_diff"] < 1e-5 and r["exact_rounds/bin_01"] > 0
        assert "exact_rounds/bin_02" not in r          # no verify rounds in approximate bins
        assert r["loss/tis_weight_mean"] > 0


def test_exact_experiment_config_parses_every_arm():
    """configs/experiment_exact.gin on top of the paired experiment: dense@seed (the paired
    experiment's own arms, reused) and exact@seed with the same seed, fixed draft budgets."""
    from sparrow_jax.experiment import runner as experiment
    from sparrow_jax.train.config import TrainConfig
    repo = Path(__file__).resolve().parents[1]
    files = [str(repo / f"configs/{n}.gin")
             for n in ("demo_cpu", "experiment_paired", "experiment_exact")]
    cli.parse_gin(files, [])
    cfg = experiment.ExperimentConfig()
    assert cfg.output_dir == "runs/experiment_paired" and cfg.report == "comparison_exact"
    assert list(cfg.arms) == ["dense@0", "exact@0", "dense@1", "exact@1"]
    for name in cfg.arms:
        cli.parse_gin(files, experiment.arm_bindings(cfg, name))
        tc = TrainConfig()
        assert (tc.rollout_mode, tc.seed) == (
            "exact_sparse" if name.startswith("exact") else "dense", int(name[-1]))
        assert tc.eval_at_start == (name == "dense@0")
    gin.clear_config()


def test_budget_mean_and_final_values():
    row = {"step": 3, "alpha_count/bin_00": 30.0, "alpha_count/bin_01": 10.0,
           "budget/bin_00": 64.0, "budget/bin_01": 128.0, "budget/bin_02": 512.0,
           "reward/mean": 0.5, "eval_dense/reward": 0.25}
    assert budget_mean(row) == pytest.approx((64 * 30 + 128 * 10) / 40)
    f = final_values([row], eval_prompts=32)
    assert f["eval_last"] == 0.25 and f["eval_se"] == pytest.approx((0.25 * 0.75 / 32) ** 0.5)
    # The first value is the step-0 evaluation only (TrainConfig.eval_at_start = False: none).
    assert "eval_first" not in f
    assert final_values([{"step": 0, "eval_dense/reward": 0.5}, row], 32)["eval_first"] == 0.5
    assert f["budget_mean"] == pytest.approx(80.0)


def test_demo_experiment_config_parses_every_arm():
    from sparrow_jax.experiment import runner as experiment
    repo = Path(__file__).resolve().parents[1]
    files = [str(repo / "configs/demo_cpu.gin"), str(repo / "configs/experiment_demo.gin")]
    cli.parse_gin(files, [])
    cfg = experiment.ExperimentConfig()
    assert set(cfg.arms) == {"dense", "controller", "fixed_64", "fixed_512"}
    for name in cfg.arms:
        cli.parse_gin(files, experiment.arm_bindings(cfg, name))
        assert gin.query_parameter("TrainConfig.run_dir").endswith(f"experiment_demo/{name}")
    assert gin.query_parameter("make_schedule.budgets") == [512] * 20
    assert gin.query_parameter("TrainConfig.eval_data") == "data/demo/heldout64.jsonl"
    assert sum(1 for _ in open(repo / "data/demo/heldout64.jsonl")) == 64
    gin.clear_config()


def _stacked_arms(config: str, probe) -> tuple:
    """configs/<config>.gin on top of the demo experiment: its ExperimentConfig and, per arm,
    `probe()` with that arm's bindings parsed."""
    from sparrow_jax.experiment import runner as experiment
    repo = Path(__file__).resolve().parents[1]
    files = [str(repo / f"configs/{name}.gin") for name in ("demo_cpu", "experiment_demo", config)]
    cli.parse_gin(files, [])
    cfg = experiment.ExperimentConfig()
    probed = {}
    for name in cfg.arms:
        cli.parse_gin(files, experiment.arm_bindings(cfg, name))
        probed[name] = (probe(), gin.query_parameter("TrainConfig.eval_prompts"))
    gin.clear_config()
    return cfg, probed


def test_distill_experiment_config_shares_the_controller_arm():
    """configs/experiment_distill.gin: same output dir as the 4-arm experiment (its finished
    controller arm is reused), its own report name, the adapter only in the new arm."""
    from sparrow_jax.rl.distill import DistillConfig
    cfg, ranks = _stacked_arms("experiment_distill", lambda: DistillConfig().rank)
    assert cfg.output_dir == "runs/experiment_demo" and cfg.report == "comparison_distill"
    assert ranks == {"controller": (0, 64), "controller_distill": (8, 64)}


def test_replicate_experiment_config_adds_seeded_arms():
    """configs/experiment_replicate.gin on top of the demo experiment: the finished dense and
    controller arms plus the same two with TrainConfig.seed = 1, reported separately."""
    from sparrow_jax.train.config import TrainConfig
    cfg, seeds = _stacked_arms("experiment_replicate", lambda: TrainConfig().seed)
    assert cfg.output_dir == "runs/experiment_demo" and cfg.report == "comparison_replicate"
    assert seeds == {"dense": (0, 64), "controller": (0, 64), "dense_seed1": (1, 64),
                     "controller_seed1": (1, 64)}


def test_every_run_in_the_figure_has_its_own_colour_and_style(tmp_path, monkeypatch):
    """comparison.png past matplotlib's 10-colour cycle: the registered 12-run experiment (3 arms
    x 4 seeds) and 25 single-seed arms (past tab20's 20 colours). Read back from the figure's
    lines: every run one (colour, line style, marker) in every panel, distinct from every other
    run's; one colour per arm, one style per seed; every run in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparrow_jax.experiment.runner import write_report
    figs = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig) or real_close(fig))

    def rows(i):
        return [{"step": s, "reward/mean": 0.1 * i + s, "eval_dense/reward": 0.5,
                 "alpha/tail_min": 0.9, "alpha/frac_below_0.9": 0.01, "rollout/tokens_per_s": 9.0,
                 "budget/bin_0": 64.0, "alpha_count/bin_0": 10.0} for s in (0, 1, 2)]

    cases = [[f"{arm}@{seed}" for arm in ("dense", "controller", "M") for seed in (11, 12, 13, 14)],
             [f"arm{i}" for i in range(25)]]
    for names in cases:
        write_report(tmp_path, {n: rows(i) for i, n in enumerate(names)}, eval_prompts=4,
                     threshold=0.8)
        fig = figs.pop()
        style = {}
        for ax in fig.axes:
            for line in ax.get_lines():
                if line.get_label() in names:
                    key = (matplotlib.colors.to_hex(line.get_color()), line.get_linestyle(),
                           line.get_marker())
                    assert style.setdefault(line.get_label(), key) == key, line.get_label()
        assert set(style) == set(names)
        assert len(set(style.values())) == len(names), style
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == names
        if "@" in names[0]:
            for a in names:
                for b in names:
                    same_arm = a.split("@")[0] == b.split("@")[0]
                    same_seed = a.split("@")[1] == b.split("@")[1]
                    assert (style[a][0] == style[b][0]) == same_arm, (a, b)
                    assert (style[a][1:] == style[b][1:]) == same_seed, (a, b)
        else:
            assert len({s[0] for s in style.values()}) == 20        # tab20, each colour used
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_parallel_arms_share_a_gpu_by_memory_fraction_and_never_a_tpu(monkeypatch):
    """Arms run in parallel each take 0.9 / N of a GPU (a JAX process preallocates 75% of it, so
    a second arm would fail); a fraction or preallocation the user set is kept; on a TPU host
    parallel arms are refused (a chip opens in one process only)."""
    from sparrow_jax.experiment import runner
    monkeypatch.setattr(runner.glob, "glob", lambda pattern: [])
    assert runner.parallel_env(1, {"A": "1"}) == {"A": "1"}
    assert runner.parallel_env(2, {})["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert runner.parallel_env(8, {})["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.11"
    mine = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert runner.parallel_env(4, mine) == mine
    monkeypatch.setattr(runner.glob, "glob",
                        lambda pattern: ["/dev/accel0"] if pattern == "/dev/accel*" else [])
    with pytest.raises(SystemExit, match="TPU chip opens in one process only"):
        runner.parallel_env(2, {})
    assert runner.parallel_env(1, {}) == {}
