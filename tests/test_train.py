"""`sparrow train` end to end on a tiny model: run dir contents, metrics, resume, config errors."""

import json

import gin
import pytest

from hf_fixtures import make_tiny_synthetic_model
from sparrow_jax import cli
from sparrow_jax.data import synthetic
from sparrow_jax.runtime.metrics import read_jsonl, read_scalars


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_tiny_synthetic_model(root / "model")
    synthetic.write_jsonl(str(root / "train.jsonl"), 16, seed=0, k_range=(1, 1), num_letters=4)
    synthetic.write_jsonl(str(root / "eval.jsonl"), 4, seed=1, k_range=(1, 1), num_letters=4)
    return root


def _params(root, run, steps, extra=()):
    return ["--gin_param", f"TrainConfig.run_dir = '{root / run}'",
            "--gin_param", f"TrainConfig.model_path = '{root / 'model'}'",
            "--gin_param", f"TrainConfig.train_data = '{root / 'train.jsonl'}'",
            "--gin_param", f"TrainConfig.eval_data = '{root / 'eval.jsonl'}'",
            "--gin_param", "TrainConfig.reward = 'synthetic_exact'",
            "--gin_param", "TrainConfig.diagnostic_rewards = ('synthetic_answer',)",
            "--gin_param", "TrainConfig.reward_processes = 0",
            "--gin_param", "TrainConfig.prompts_per_step = 2",
            "--gin_param", "TrainConfig.group_size = 2",
            "--gin_param", f"TrainConfig.total_steps = {steps}",
            "--gin_param", "TrainConfig.eval_every = 2",
            "--gin_param", "TrainConfig.checkpoint_every = 2",
            "--gin_param", "RolloutConfig.max_new_tokens = 40",
            "--gin_param", "RolloutConfig.max_budget = 64",
            "--gin_param", "RolloutConfig.backend = 'xla'",
            "--gin_param", f"make_schedule.budgets = {[48] * 20}",
            "--gin_param", "make_schedule.bin_size = 16",
            "--gin_param", "ControllerConfig.min_budget = 48",
            "--gin_param", "ControllerConfig.max_budget = 64",
            "--gin_param", "ControllerConfig.min_tokens = 1",
            "--gin_param", "LearnerConfig.learning_rate = 1e-3",
            "--gin_param", "LearnerConfig.micro_batch_size = 2", *extra]


def _run(argv):
    gin.clear_config()
    return cli.main(["train", *argv])


def test_train_writes_run_dir_and_resumes(setup, capsys):
    root = setup
    assert _run(_params(root, "run", 2)) == 0
    run = root / "run"
    out = capsys.readouterr().out
    assert "held-out reward (sparse decoding)" in out and "sparse vs dense" in out
    assert (run / "operative_config.gin").exists()
    assert "TrainConfig.group_size = 2" in (run / "operative_config.gin").read_text()
    rows = read_jsonl(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    step1 = rows[1]
    for key in ("reward/mean", "loss/policy", "alpha/alpha_mean", "budget/bin_00",
                "rollout/tokens_per_s", "time/rollout", "time/learner", "reward/synthetic_answer"):
        assert key in step1, key
    assert any(k.startswith("alpha_tail/bin_") for k in step1)
    assert "eval_sparse/reward" in rows[2] and "eval_dense/reward" in rows[2]
    tb = read_scalars(run)
    assert "reward/mean" in tb and len(tb["reward/mean"]) == 2
    assert (run / "checkpoints" / "2").is_dir()

    # Resume: same command with more steps continues at step 2 with the next data batch.
    assert _run(_params(root, "run", 4)) == 0
    rows = read_jsonl(run)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]
    # A fresh 4-step run sees the same data order, so its step 3-4 rewards/lengths match.
    assert _run(_params(root, "fresh", 4)) == 0
    fresh = {r["step"]: r for r in read_jsonl(root / "fresh")}
    resumed = {r["step"]: r for r in read_jsonl(run)}
    for s in (3, 4):
        assert fresh[s]["response/length_mean"] == pytest.approx(resumed[s]["response/length_mean"])
        assert fresh[s]["reward/mean"] == pytest.approx(resumed[s]["reward/mean"])


def test_relative_run_dir(setup, monkeypatch):
    monkeypatch.chdir(setup)
    argv = _params(setup, "x", 1)
    argv[argv.index(f"TrainConfig.run_dir = '{setup / 'x'}'")] = "TrainConfig.run_dir = 'rel_run'"
    assert _run(argv + ["--gin_param", "TrainConfig.eval_data = ''"]) == 0
    assert (setup / "rel_run" / "checkpoints" / "1").is_dir()


def test_bad_gin_key_is_a_clear_error(setup):
    with pytest.raises(SystemExit, match="TrainConfig.no_such_field"):
        _run(_params(setup, "bad", 1, ["--gin_param", "TrainConfig.no_such_field = 3"]))


def test_missing_model_path(setup):
    argv = [a for a in _params(setup, "bad2", 1)]
    i = argv.index(f"TrainConfig.model_path = '{setup / 'model'}'")
    argv[i] = f"TrainConfig.model_path = '{setup / 'nope'}'"
    # Bad input is one clear line and exit status 1, not a traceback (sparrow_jax.runtime.faults).
    with pytest.raises(SystemExit, match="FileNotFoundError: .*does not exist"):
        _run(argv)


def test_paged_engine_trains_like_the_static_one(setup):
    """`RolloutConfig.engine = "paged"` in training: the same samples as the static engine, so
    the same rewards, lengths and update."""
    rows = {}
    for engine in ("static", "paged"):
        extra = ["--gin_param", f"RolloutConfig.engine = '{engine}'",
                 "--gin_param", "TrainConfig.eval_data = ''",
                 "--gin_param", "RolloutConfig.chunk_steps = 16"]
        assert _run(_params(setup, f"engine_{engine}", 1, extra)) == 0
        rows[engine] = [r for r in read_jsonl(setup / f"engine_{engine}") if r["step"] == 1][0]
    for key in ("reward/mean", "response/length_mean", "loss/policy", "alpha/alpha_mean"):
        assert rows["paged"][key] == pytest.approx(rows["static"][key], rel=1e-5, abs=1e-6), key
