"""Reward registry, boxed-answer extraction, math-verify equivalence and the timeout pool.

The slow/crashing rewards below live at module level so spawned pool workers can import them
(this file is importable as `test_rewards`: conftest puts tests/ on sys.path, which spawn passes
on to the children).
"""

from __future__ import annotations

import os
import time

import gin
import numpy as np
import pytest

from sparrow_jax.data import synthetic  # noqa: F401 - registers the synthetic task's rewards
from sparrow_jax.rewards import registry
from sparrow_jax.rewards.answers import extract_last_boxed
from sparrow_jax.rewards.pool import RewardPool
from sparrow_jax.rewards.registry import get_reward, register_reward


@register_reward("test_slow")
def slow_reward(completion_text, ground_truth, *, prompt="", meta=None):
    """Hangs on "hang", crashes the process on "crash", raises on "raise", else exact match."""
    if completion_text == "hang":
        time.sleep(60)
    if completion_text == "crash":
        os._exit(3)
    if completion_text == "raise":
        raise RuntimeError("bad reward")
    return float(completion_text == ground_truth)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\text{a}{b}{c{d}}}", "\\text{a}{b}{c{d}}"),
        ("answer \\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("no box here", None),
        ("\\boxed{3} and \\boxed{\\frac{1", None),  # truncated last box: no answer
        ("\\boxed", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    "completion,truth,expected",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\boxed{3}", "3.0", 1.0),
        ("\\boxed{3}", 3, 1.0),
        ("\\boxed{4}", "3", 0.0),
        ("3", "3", 0.0),  # no boxed answer
        ("\\boxed{7} wait, \\boxed{8}", "8", 1.0),
        ("\\boxed{12}", "\\boxed{12}", 1.0),
    ],
)
def test_math_verify_reward(completion, truth, expected):
    assert get_reward("math_verify")(completion, truth) == expected


def test_registry():
    assert get_reward("test_slow") is slow_reward
    assert {"math_verify", "synthetic_exact", "synthetic_answer"} <= set(registry.reward_names())
    with pytest.raises(KeyError, match="unknown reward 'nope'.*math_verify"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math_verify")(lambda *a, **k: 0.0)
    assert get_reward("sparrow_jax.data.synthetic:synthetic_answer")("= 3", "3") == 1.0
    gin.clear_config()
    gin.parse_config("make_reward_fn.name = 'test_slow'")
    assert registry.make_reward_fn() is slow_reward
    gin.clear_config()


def test_inprocess_pool_counts_errors():
    with RewardPool("test_slow", processes=0) as pool:
        report = pool.score([("a", "a"), ("raise", "a"), ("b", "a", "prompt", {"k": 1})])
    np.testing.assert_array_equal(report.rewards, [1, 0, 0])
    assert report.rewards.dtype == np.float32
    assert report.errors == 1 and report.failed == (1,) and "bad reward" in report.first_error
    assert report.first_error_index == 1 and "RuntimeError" in report.first_traceback
    assert report.timeouts == report.crashed == 0 and report.first_error.startswith("RuntimeError")
    with pytest.raises(AttributeError):     # a frozen value, handed on as it is
        report.errors = 0


def test_pool_timeout_crash_and_recovery():
    items = [("a", "a"), ("hang", "a"), ("b", "a"), ("crash", "a"), ("raise", "a"), ("c", "c")]
    with RewardPool("test_slow", processes=2, timeout_s=3.0) as pool:
        t0 = time.monotonic()
        report = pool.score(items)
        assert time.monotonic() - t0 < 30  # the hung item did not wait its 60 s
        np.testing.assert_array_equal(report.rewards, [1, 0, 0, 0, 0, 1])
        assert report.timeouts == 1 and report.timed_out == (1,)
        assert report.errors == 2 and sorted(report.failed) == [3, 4]
        assert report.restarts == 2 and report.crashed == 1  # the hung and the crashed worker
        # The pool keeps working after the replacements.
        again = pool.score([("x", "x"), ("y", "z")] * 3)
        np.testing.assert_array_equal(again.rewards, [1, 0] * 3)
        assert again.timeouts == again.errors == 0 and again.first_error is None
        assert pool.total["timeouts"] == 1


def test_pool_math_verify_and_huge_answer():
    huge = "\\boxed{" + "9" * 200_000 + "}"
    with RewardPool("math_verify", processes=1, timeout_s=20) as pool:
        r = pool.score([("\\boxed{\\frac{1}{2}}", "0.5"), (huge, "1"), ("\\boxed{2}", "2")]).rewards
    assert r[0] == 1.0 and r[1] == 0.0 and r[2] == 1.0


def test_pool_rejects_fork():
    with pytest.raises(ValueError, match="spawn"):
        RewardPool("test_slow", processes=1, start_method="fork")


# A reward module that imports in the trainer but not in its reward workers (a dependency the
# workers' environment lacks), or whose import kills the worker outright.
_WORKER_ONLY_FAILURE = '''
import multiprocessing, os
from sparrow_jax.rewards.registry import register_reward
if multiprocessing.parent_process() is not None:
    {failure}

@register_reward("{name}")
def score(completion_text, ground_truth, *, prompt="", meta=None):
    return 1.0
'''


def test_worker_that_cannot_start_is_one_clear_error(tmp_path, monkeypatch):
    """Issue #45: a reward worker that crashed at start-up ended in a traceback and "a reward
    worker died during start-up (import error?)". Now: the reward, its function and the
    worker's own error (or how it died), before anything is scored."""
    from sparrow_jax.runtime.faults import RunError

    (tmp_path / "worker_import_fails.py").write_text(_WORKER_ONLY_FAILURE.format(
        name="worker_import_fails", failure="raise ImportError('libmissing.so: cannot open')"))
    (tmp_path / "worker_dies.py").write_text(_WORKER_ONLY_FAILURE.format(
        name="worker_dies", failure="os._exit(3)"))
    monkeypatch.syspath_prepend(str(tmp_path))   # spawn passes sys.path on to the workers
    pool = RewardPool("worker_import_fails:worker_import_fails", processes=1)
    try:
        with pytest.raises(RunError) as e:
            pool.wait_ready()
    finally:
        pool.close()
    message = str(e.value)
    assert message.startswith("reward 'worker_import_fails:worker_import_fails' "
                              "(worker_import_fails.score): a reward worker process could not "
                              "start: ImportError: libmissing.so: cannot open"), message
    assert "\n" not in message and "Traceback" not in message, message
    # A worker that dies before saying why: its exit code, here from score() itself.
    with RewardPool("worker_dies:worker_dies", processes=1) as pool:
        with pytest.raises(RunError, match=r"\(worker_dies.score\): a reward worker process "
                                           r"could not start: it died before reporting ready "
                                           r"\(exit code 3\)"):
            pool.score([("a", "a")])
    # A reward that cannot be sent to a worker at all is named, not a pickling traceback.
    with pytest.raises(ValueError, match="cannot be sent to reward worker processes"):
        RewardPool(lambda *a, **k: 1.0, processes=1)


def test_a_worker_killed_by_a_job_signal_at_start_up_hands_the_signal_to_the_trainer(
        tmp_path, monkeypatch):
    """Ctrl-C to the process group can reach a worker before it ignores job signals (seen
    under load 3.5 s into `sparrow train`'s start-up: the run then ended with a reward error,
    status 1, not the start-up line and 130). A worker that died by SIGINT / SIGTERM before
    reporting ready raises that signal in the trainer, whose own handler decides."""
    import signal

    from sparrow_jax.runtime.faults import RunError

    (tmp_path / "worker_ctrl_c.py").write_text(_WORKER_ONLY_FAILURE.format(
        name="worker_ctrl_c", failure="import signal; signal.signal(signal.SIGINT, "
                                      "signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    got = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with RewardPool("worker_ctrl_c:worker_ctrl_c", processes=1) as pool:
            with pytest.raises(RunError, match=r"killed by SIGINT"):
                pool.wait_ready()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == [signal.SIGINT]


def test_a_busy_worker_does_not_outlive_its_trainer(tmp_path):
    """Workers ignore Ctrl-C and SIGTERM (the trainer stops them); a trainer that dies without
    stopping them (kill -9, a second Ctrl-C) must not leave one behind, even one stuck in a
    reward: each worker exits when its parent does."""
    import subprocess
    import sys
    script = tmp_path / "trainer.py"
    script.write_text(   # spawned workers import this script too: hence the __main__ guard
        "import os, time\n"
        "from sparrow_jax.rewards.pool import RewardPool\n"
        "import test_rewards  # registers test_slow\n"
        "if __name__ == '__main__':\n"
        "    pool = RewardPool('test_slow', processes=1, timeout_s=60)\n"
        "    pool.wait_ready()\n"
        "    pool._workers[0].conn.send((0, 'hang', 'a', '', None))   # busy for 60 s\n"
        "    print(pool._workers[0].process.pid, flush=True)\n"
        "    time.sleep(0.3)\n"
        "    os._exit(0)   # no close(): as a process killed outright\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(__file__), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    # Output to files, not pipes: the worker inherits them, and a pipe would wait for it.
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        rc = subprocess.Popen([sys.executable, str(script)], stdout=o, stderr=e,
                              env=env).wait(timeout=120)
    assert rc == 0, err.read_text()[-3000:]
    stat = f"/proc/{int(out.read_text().split()[-1])}/stat"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(stat) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":   # exited, not yet reaped
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the reward worker outlived its trainer")


def test_a_worker_starts_with_job_signals_blocked_also_the_first_one(tmp_path):
    """The first spawn launches multiprocessing's resource tracker, whose start *unblocks*
    SIGINT and SIGTERM in the calling thread (CPython 3.11-3.12): started inside the block, it
    let the first worker start with Ctrl-C open until `worker_main` ignores it (issue 58: a
    Ctrl-C 3.5 s into `sparrow train`'s start-up killed a worker still importing, about half
    the runs on a loaded machine). A fresh process (no tracker yet) reports its first
    child's signal mask, and its own after the block."""
    import subprocess
    import sys
    script = tmp_path / "first_spawn.py"
    script.write_text(   # the spawned child imports this script too: hence the __main__ guard
        "import multiprocessing, signal\n"
        "from sparrow_jax.rewards.workers import job_signals_blocked\n"
        "def report(conn):\n"
        "    conn.send(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n"
        "if __name__ == '__main__':\n"
        "    ctx = multiprocessing.get_context('spawn')\n"
        "    mine, theirs = ctx.Pipe()\n"
        "    with job_signals_blocked():\n"
        "        child = ctx.Process(target=report, args=(theirs,))\n"
        "        child.start()\n"
        "    print(mine.recv(), sorted(int(s) for s in signal.pthread_sigmask(\n"
        "        signal.SIG_BLOCK, [])))\n"
        "    child.join()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [os.path.dirname(os.path.dirname(__file__)),
                              *os.environ.get("PYTHONPATH", "").split(os.pathsep)])})
    assert out.returncode == 0, out.stderr[-3000:]
    child_mask, parent_mask = out.stdout.strip().split("] [")
    assert {2, 15} <= {int(s) for s in child_mask.strip("[]").split(",") if s.strip()}, out.stdout
    assert parent_mask.strip("[]") == "", out.stdout      # the block is undone after
