"""`sparrow train` end to end on a tiny model: run dir contents, metrics, resume, config errors."""


import gin
import pytest

from hf_fixtures import gin_argv, make_tiny_run, tiny_train_bindings
from sparrow_jax import cli
from sparrow_jax.runtime.metrics import read_jsonl, read_scalars


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("train"))


def _params(root, run, steps, extra=()):
    binds = tiny_train_bindings(root, run, steps,
                                TrainConfig__eval_data=repr(str(root / "eval.jsonl")),
                                TrainConfig__diagnostic_rewards="('synthetic_answer',)",
                                TrainConfig__eval_every="2",
                                ControllerConfig__min_tokens="1",
                                ControllerConfig__min_rows="2",
                                LearnerConfig__micro_batch_size="2")
    return gin_argv(binds) + list(extra)   # extra: argv as written (--gin_param ...)


def _run(argv):
    gin.clear_config()
    return cli.main(["train", *argv])


def test_train_writes_run_dir_and_resumes(setup, capsys):
    root = setup
    assert _run(_params(root, "run", 2)) == 0
    run = root / "run"
    out, err = capsys.readouterr()
    assert "held-out reward (sparse decoding)" in out and "sparse vs dense" in out
    # Long evaluations say what runs and when it is done (minutes of silence otherwise).
    assert "held-out evaluation at step 0: dense decoding of" in out + err
    assert "held-out evaluation at step 2, sparse: done in" in out + err
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
        # The controller's state (pooled evidence, probes) came back with the checkpoint.
        for key in [k for k in fresh[s] if k.startswith(("budget/", "schedule/"))]:
            assert fresh[s][key] == pytest.approx(resumed[s][key]), (s, key)


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
    # Checked with every other setting before anything loads (sparrow_jax.train.preflight).
    with pytest.raises(SystemExit, match="TrainConfig.model_path .*nope' does not exist"):
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
