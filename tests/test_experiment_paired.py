"""sparrow_jax.experiment.paired: per-seed paired differences to dense with a 95% t-interval, the
per-prompt standard error, the shared start and the alpha columns; configs/experiment_paired.gin
parses with every arm's bindings; `sparrow experiment --parallel N` runs the arms as
subprocesses."""

import _thread
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import gin
import numpy as np
import pytest

from sparrow_jax import cli
from sparrow_jax.experiment.paired import (paired_differences, paired_markdown, prompt_se,
                                           reference_scores, write_paired_report)


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
    assert "| dense | 2 | 0.0600 -> 0.1500 | (reference) | | - (1.000) |" in text
    # The whole model's KV read, dense layers included; an exact-sparse run's own metric.
    from sparrow_jax.experiment.paired import whole_model_kv
    assert whole_model_kv([{"kv/read_model": 0.7}, {"kv/read_model": 0.8}]) == pytest.approx(0.75)
    assert whole_model_kv([{"kv/read_model": 1.0, "exact/kv_read_model": 0.66}]) == 0.66
    assert math.isnan(whole_model_kv([{"reward/mean": 0.1}]))
    rows = _rows(0.06, 0.12, kv=0.4)
    rows[1]["kv/read_model"] = 0.7
    exact = _rows(0.06, 0.11)
    exact[1].update({"kv/read_model": 1.0, "exact/kv_read_model": 0.66})
    kv_text = paired_markdown({"dense@0": _rows(0.06, 0.10), "controller@0": rows,
                               "exact@0": exact})
    assert "| 0.700 (0.400) |" in kv_text and "| 0.660 (-) |" in kv_text
    assert "| - (0.450) |" in text
    assert write_paired_report(tmp_path, results).read_text() == text
    assert write_paired_report(tmp_path, {"dense": []}) is None


def test_paired_experiment_config_parses_every_arm():
    from sparrow_jax.experiment import runner as experiment
    from sparrow_jax.train.config import TrainConfig
    repo = Path(__file__).resolve().parents[1]
    files = [str(repo / "configs/demo_cpu.gin"), str(repo / "configs/experiment_paired.gin")]
    cli.parse_gin(files, [])
    cfg = experiment.ExperimentConfig()
    assert len(cfg.arms) == 12 and cfg.parallel == 2
    for name in cfg.arms:
        cli.parse_gin(files, experiment.arm_bindings(cfg, name))
        seed = int(name.split("@")[1])
        assert gin.query_parameter("TrainConfig.seed") == seed
        # Only dense@0 evaluates the shared starting checkpoint.
        assert TrainConfig().eval_at_start == (name == "dense@0")
    gin.clear_config()


# -- the report: shared start, alpha columns, per-prompt standard errors ------------------------
def _run_rows(last, *, start=None, alpha=None, tail=None, below=None):
    """Rows of a 10-step run: an optional step-0 evaluation, per-step alpha metrics (steps 1-5
    at 0.5 / 0.1 / 1, which the report must leave out) and the last evaluation at step 10."""
    rows = [] if start is None else [{"step": 0, "eval_dense/ref_p_exact": start}]
    for step in range(1, 11):
        row = {"step": step, "reward/mean": 0.1}
        early = step < 6
        if alpha is not None:
            row.update({"alpha/alpha_mean": 0.5 if early else alpha,
                        "alpha/tail_min": 0.1 if early else tail})
        if below is not None:
            row["schedule/bins_below_target"] = 1.0 if early else below[step - 6]
        rows.append(row)
    rows[-1]["eval_dense/ref_p_exact"] = last
    return rows


def test_report_shared_start_and_alpha_columns():
    results = {
        "dense@0": _run_rows(0.20, start=0.08),
        "dense@1": _run_rows(0.22),
        "controller@0": _run_rows(0.18, alpha=0.99, tail=0.80, below=[0, 0, 2, 0, 1]),
        "controller@1": _run_rows(0.21, alpha=0.97, tail=0.90, below=[0, 0, 0, 0, 1]),
        "fixed@0": _run_rows(0.19, alpha=0.95, tail=0.70),
    }
    text = paired_markdown(results)
    # Only dense@0 evaluated step 0: every other run starts from its value (marked, explained).
    assert "| dense | 2 | 0.0800* -> 0.2100 | (reference) | | - (1.000) |  |  |  |" in text
    # controller: mean alpha (0.99 + 0.97) / 2, min tail (0.80 + 0.90) / 2 over steps >= 6 only,
    # steps with a bin below target: (2/5 + 1/5) / 2 = 30%.
    assert ("| controller | 2 | 0.0800* -> 0.1950 | 0: -0.0200, 1: -0.0100 | -0.0150 ["
            in text)
    assert "| - (1.000) | 0.9800 | 0.850 | 30% |" in text
    # An arm that logs no schedule/bins_below_target leaves that column blank.
    assert "| fixed | 1 | 0.0800* -> 0.1900 | 0: -0.0100 | -0.0100 | - (1.000) | 0.9500 | 0.700 |  |" \
        in text
    assert "\\* no step-0 evaluation in these runs" in text and "`dense@0`'s" in text
    assert "t-interval over seeds" in text and "over prompts" in text
    # Shared sampling keys couple the runs of a pair: the report must not say that its interval
    # carries the variance of training runs (issue 56: exact sparse, identical in distribution,
    # landed -0.050 and +0.045 from dense, ~25x outside the demo's +-0.002 interval).
    assert "does not carry the variance of training runs" in text
    assert "carries the training-run variance" not in text
    # Every run evaluated at step 0: no footnote, its own start.
    own = paired_markdown({"dense@0": _run_rows(0.2, start=0.1),
                           "controller@0": _run_rows(0.3, start=0.1)})
    assert "0.1000 -> 0.3000" in own and "no step-0 evaluation" not in own


def _reference_lines(step_logp: dict[int, list[float]], ids=("a", "b", "c", "d")) -> str:
    """eval_reference.jsonl as sparrow_jax.evaluation.reference.append_rows writes it: one line per
    (step, mode) with the per-prompt logp; a sparse line that must be ignored."""
    out = []
    for step, logp in step_logp.items():
        for mode in ("dense", "sparse"):
            out.append(json.dumps({"step": step, "mode": mode, "ids": list(ids),
                                   "logp": logp if mode == "dense" else [0.0] * len(ids),
                                   "greedy": [True] * len(ids)}))
    return "\n".join(out) + "\n"


def test_reference_scores_and_per_prompt_standard_error(tmp_path):
    lines = _reference_lines({0: [0.0] * 4, 10: [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]})
    scores = reference_scores(lines.splitlines())
    assert scores == pytest.approx({"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4})
    assert reference_scores(lines.splitlines(), mode="nope") == {}
    arm = {"a": 0.15, "b": 0.2, "c": 0.33, "d": 0.4, "extra": 0.9}     # 'extra' is unpaired
    d = np.asarray([0.05, 0.0, 0.03, 0.0])
    assert prompt_se(arm, scores) == pytest.approx(d.std(ddof=1) / 2)
    assert math.isnan(prompt_se({"a": 0.1}, scores))

    # The same files in run directories: write_paired_report pairs them per seed.
    ref_p, arm_p = (0.1, 0.2, 0.3, 0.4), (0.15, 0.2, 0.33, 0.4)
    for name, ps in (("dense@0", ref_p), ("controller@0", arm_p), ("dense@1", ref_p),
                     ("controller@1", arm_p)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval_reference.jsonl").write_text(
            _reference_lines({10: [math.log(p) for p in ps]}))
    # seed 1's controller has no per-prompt file: no +- for that seed.
    (tmp_path / "controller@1" / "eval_reference.jsonl").unlink()
    results = {"dense@0": _run_rows(0.25, start=0.1), "controller@0": _run_rows(0.27),
               "dense@1": _run_rows(0.25), "controller@1": _run_rows(0.2)}
    text = write_paired_report(tmp_path, results).read_text()
    se = d.std(ddof=1) / 2
    assert f"0: +0.0200 (+- {se:.4f}), 1: -0.0500 |" in text


# -- the parallel runner --------------------------------------------------------------------------
# A stand-in for `sparrow train`: records when it ran, sleeps, writes a metrics.jsonl (and an
# eval_reference.jsonl) in its run directory - or fails, for arms named bad@*.
FAKE_ARM = r"""
import json, math, os, sys, time
run_dir, name, stamps = sys.argv[1:]
start = time.time()
print("fake arm", name, "line 1")
time.sleep(1.5)
if name.startswith("bad"):
    print("\n".join(f"noise {i}" for i in range(50)), flush=True)
    sys.stderr.write("".join(f"\rtrain {i}/10" for i in range(11)) + "\n")   # a tqdm bar
    print("Traceback: the fake arm broke", file=sys.stderr)
    sys.exit(3)
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for step in range(11):
        f.write(json.dumps({"step": step, "reward/mean": 0.1,
                            "eval_dense/ref_p_exact": 0.1 + 0.01 * step}) + "\n")
with open(os.path.join(run_dir, "eval_reference.jsonl"), "w") as f:
    f.write(json.dumps({"step": 10, "mode": "dense", "ids": ["a", "b"],
                        "logp": [math.log(0.2), math.log(0.3 if "dense" in name else 0.4)]}) + "\n")
with open(os.path.join(stamps, name), "w") as f:
    f.write(f"{start} {time.time()}")
"""


@pytest.fixture
def fake_arms(tmp_path, monkeypatch):
    """An experiment config of five arms (one failing) whose per-arm command is FAKE_ARM."""
    from sparrow_jax.experiment import runner as experiment
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    calls = []

    def command(gin_files, gin_params, bindings, log_level=None):
        calls.append((list(gin_files), list(gin_params), list(bindings)))
        run_dir = next(b.split("=", 1)[1].strip().strip("'") for b in bindings
                       if b.startswith("TrainConfig.run_dir"))
        return [sys.executable, "-c", FAKE_ARM, run_dir, Path(run_dir).name, str(stamps)]

    monkeypatch.setattr(experiment, "arm_command", command)
    cfg = tmp_path / "exp.gin"
    cfg.write_text(f"""
ExperimentConfig.output_dir = '{tmp_path / "out"}'
ExperimentConfig.arms = {{
    'dense@0': ["TrainConfig.seed = 0"], 'ctrl@0': ["TrainConfig.seed = 0"],
    'bad@0': ["TrainConfig.seed = 0"], 'dense@1': ["TrainConfig.seed = 1"],
    'ctrl@1': ["TrainConfig.seed = 1"],
}}
""")
    return cfg, tmp_path / "out", stamps, calls


def test_parallel_runs_at_most_n_reports_a_failing_arm_and_exits_nonzero(fake_arms, capsys):
    cfg, out, stamps, calls = fake_arms
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["experiment", str(cfg), "--parallel", "2",
                  "--gin_param", "TrainConfig.total_steps = 10"])
    message = str(exit_info.value.code)
    assert "1 arm(s) failed: bad@0 (exit code 3" in message and "bad@0.log" in message
    # Each arm's command got the base overrides and its own bindings (with its run directory).
    assert [c[1] for c in calls] == [["TrainConfig.total_steps = 10"]] * 5
    assert calls[2][2][0] == "TrainConfig.seed = 0" and calls[2][2][1].endswith("/bad@0'")
    # The four good arms ran, never more than two at once, and two did run together.
    spans = {p.name: tuple(map(float, p.read_text().split())) for p in stamps.iterdir()}
    assert set(spans) == {"dense@0", "ctrl@0", "dense@1", "ctrl@1"}
    starts = sorted(s for s, _ in spans.values())
    overlap = [sum(1 for s, e in spans.values() if s <= t < e) for t in starts]
    assert max(overlap) == 2
    # The failure: named, with the last lines of its log (not the first); the others logged.
    text = capsys.readouterr().err         # the console log (cli.main sets up logging)
    assert "arm bad@0: FAILED after" in text and "exit code 3" in text
    assert "Traceback: the fake arm broke" in text and "noise 49" in text
    assert "train 10/10" in text and "train 9/10" not in text     # a bar's last redraw only
    assert "fake arm bad@0 line 1" not in text
    for name in spans:
        assert f"arm {name}: started" in text and f"arm {name}: finished in" in text
        assert f"fake arm {name} line 1" in (out / f"{name}.log").read_text()
    # The report of the arms that finished, with the per-prompt standard errors.
    paired = (out / "comparison_paired.md").read_text()
    assert "| ctrl | 2 |" in paired and "bad" not in paired
    assert "0: +0.0000 (+- 0.0500), 1: +0.0000 (+- 0.0500)" in paired
    assert "| bad@0 |" not in (out / "comparison.md").read_text()


def test_parallel_ctrl_c_terminates_the_arms(tmp_path):
    """Ctrl-C while arms run: SIGTERM to each (they save and exit), wait, then re-raise."""
    from sparrow_jax.experiment import runner as experiment
    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    open(sys.argv[1], 'w').write('saved'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    commands = {f"arm{i}": [sys.executable, "-c", script, str(tmp_path / f"arm{i}.saved")]
                for i in range(3)}
    # pytest-xdist workers ignore SIGINT (Ctrl-C belongs to the controller), and
    # interrupt_main does nothing for an ignored signal: Python's own handler, for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            experiment.run_parallel(commands, tmp_path, 2, poll_s=0.1)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 30
    # The two running arms got SIGTERM and handled it; the third never started.
    assert sorted(p.name for p in tmp_path.glob("*.saved")) == ["arm0.saved", "arm1.saved"]
    assert not (tmp_path / "arm2.log").exists()


def test_parallel_must_be_at_least_one(tmp_path):
    from sparrow_jax.experiment import runner as experiment
    with pytest.raises(ValueError, match="parallel must be an integer >= 1"):
        experiment.ExperimentConfig(arms={"a": []}, parallel=0)
    cfg = tmp_path / "exp.gin"
    cfg.write_text(f"ExperimentConfig.output_dir = '{tmp_path}'\n"
                   "ExperimentConfig.arms = {'a': []}\n")
    with pytest.raises(SystemExit, match="ExperimentConfig.parallel must be an integer >= 1"):
        cli.main(["experiment", str(cfg), "--parallel", "0"])


def test_arm_command_is_sparrow_train_with_the_arm_bindings():
    from sparrow_jax.experiment import runner as experiment
    argv = experiment.arm_command(["a.gin", "b.gin"], ["X.y = 1"], ["X.z = 2", "T.r = 'd'"],
                                  "DEBUG")
    assert argv == [sys.executable, "-m", "sparrow_jax.cli", "--log_level", "DEBUG", "train",
                    "a.gin", "b.gin", "--gin_param", "X.y = 1", "--gin_param", "X.z = 2",
                    "--gin_param", "T.r = 'd'"]


def test_an_arm_stopped_by_a_signal_is_not_counted_as_finished(tmp_path, caplog):
    """`sparrow train` exits 130/143 after it saved a step on Ctrl-C / SIGTERM (a stop it did not
    get from this runner, e.g. a scheduler's): the arm is reported as stopped, never finished,
    so the report is not written over an arm that ran part of its steps."""
    from sparrow_jax.experiment import runner as experiment
    commands = {"cut": [sys.executable, "-c", "raise SystemExit(143)"],
                "done": [sys.executable, "-c", "pass"]}
    with caplog.at_level("INFO", logger=experiment.__name__):
        codes = experiment.run_parallel(commands, tmp_path, 2, poll_s=0.05)
    assert codes == {"cut": 143, "done": 0}
    assert "arm cut: stopped by a signal after" in caplog.text and "re-running resumes" in caplog.text
    assert "arm cut: finished" not in caplog.text and "arm done: finished" in caplog.text
