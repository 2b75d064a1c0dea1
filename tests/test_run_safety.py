"""Nothing a user does loses a run (issue #28), on a tiny model:

- a resume with a changed setting is refused before the model loads, naming it, and moves
  nothing (sparrow_jax.train.resume_config; quick cases in test_resume_config.py); only
  verified damage sets a step aside, and a fresh start is refused while set-aside steps (or
  metrics of later steps) exist; re-running a finished run keeps summary.json;
- one trainer per run directory: a second `sparrow train` stops at start naming the holder, the
  first finishes intact; a stale lock of a dead process is taken over;
- Ctrl-C saves at the step boundary and exits cleanly; a second Ctrl-C exits at once and the
  next run resumes from the last checkpoint;
- `sparrow export` never writes into the run or the base model, and --overwrite replaces only
  an earlier export's files;
- every bad setting is reported together before the model loads; `sparrow sft` does not
  overwrite a model directory unless asked; math-verify's timeout log is cut short.

The subprocess tests run `sparrow train` through tests/fault_worker.py (tracing the phases, so a
signal can be aimed at a step).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gin
import pytest

from hf_fixtures import gin_argv, group_left, make_tiny_run, tiny_train_bindings

# `sparrow train` subprocesses: slow, and guards too - what a user does wrong is checked in CI.
def slow(test):
    return pytest.mark.guard(pytest.mark.slow(test))

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("run_safety"), eval_rows=0)


def _argv(root: Path, run: str, steps: int, extra=(), **overrides: str) -> list[str]:
    settings = {"TrainConfig__reward": "'fault_worker:varied'",
                "TrainConfig__eval_every": "1000", "TrainConfig__checkpoint_every": "1",
                "TrainConfig__max_to_keep": "10", "ControllerConfig__min_budget": "32",
                "ControllerConfig__min_tokens": "1", "LearnerConfig__micro_batch_size": "2"}
    binds = tiny_train_bindings(root, run, steps, **{**settings, **overrides})
    return ["train", *gin_argv(binds, extra)]


def _env(root: Path, faults: dict | None) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "NO_COLOR": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
            # The session's shared cache (tests/conftest.py): test_faults runs the same programs.
            "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                        str(root / "jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "SPARROW_FAULTS": json.dumps(faults or {})}


def _launch(root: Path, argv: list[str], faults: dict | None = None, group: bool = False
            ) -> tuple[subprocess.Popen, Path]:
    """`group`: the trainer leads its own process group (as a shell's foreground job or a
    scheduler's job), which its reward workers join: the test signals the whole group."""
    log = root / f"log-{time.monotonic_ns()}.stderr"
    proc = subprocess.Popen([sys.executable, str(TESTS / "fault_worker.py"), *argv],
                            env=_env(root, faults), stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"), start_new_session=group)
    return proc, log


def _run(root: Path, argv: list[str], faults: dict | None = None) -> tuple[int, str]:
    proc, log = _launch(root, argv, faults)
    rc = proc.wait(timeout=300)
    return rc, log.read_text(errors="replace")


def _clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, (needle, err[-3000:])


def _wait_for(trace: Path, wanted: str, proc: subprocess.Popen, timeout: float = 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trace.exists() and wanted in trace.read_text().splitlines():
            return
        assert proc.poll() is None, f"the run ended before {wanted!r}"
        time.sleep(0.01)
    raise TimeoutError(wanted)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run: Path) -> list[int]:
    """Finalized steps, each restored (its JSON extra names the step); no temp step left."""
    from sparrow_jax.runtime import checkpoint as ckpt

    assert not list((run / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
    with ckpt.CheckpointManager(run, read_only=True) as m:
        steps = m.all_steps()
        for step in steps:
            assert m.restore(step)[2]["step"] == step
    return steps


@pytest.fixture(scope="module")
def base(root):
    """A finished 2-step run. Its summary.json gets evaluation numbers (as a run with eval_data
    writes; evaluating here would only add compile time)."""
    rc, err = _run(root, _argv(root, "base", 2))
    assert rc == 0, err[-3000:]
    (root / "base" / "summary.json").write_text(json.dumps(
        {"first": {"eval_dense/reward": 0.25}, "last": {"eval_dense/reward": 0.5}}))
    return root / "base"


def _copy(run: Path, name: str) -> Path:
    dest = run.parent / name
    shutil.copytree(run, dest)
    return dest


# -- resume: configuration change vs damage -------------------------------------------------------


@slow
def test_changed_setting_on_resume_is_refused_before_the_model_loads(root, base):
    """Issue #45 list 1-2: `param_dtype` alone (orbax converts dtypes silently, so this once
    declared every step corrupted and moved it aside), and a new learning rate."""
    run = _copy(base, "changed")
    before = {name: (run / name).read_bytes()
              for name in ("metrics.jsonl", "summary.json", "operative_config.gin")}
    argv = _argv(root, "changed", 2)
    rc, err = _run(root, argv + ["--gin_param", "TrainConfig.param_dtype = 'bfloat16'",
                                 "--gin_param", "LearnerConfig.learning_rate = 1e-4"])
    _clean_error(rc, err, "holds a run trained to step 2 with other settings",
                 "TrainConfig.param_dtype: 'float32' -> 'bfloat16'",
                 "LearnerConfig.learning_rate: 0.001 -> 0.0001",
                 "nothing was moved or changed", "another TrainConfig.run_dir")
    assert "corrupted" not in err and "precision: master weights" not in err, err[-3000:]
    assert not (run / "damaged_checkpoints").exists()
    assert _checkpoints(run) == [1, 2]
    assert {name: (run / name).read_bytes() for name in before} == before
    # The original command again: the run is finished; its records stay as they were.
    rc, err = _run(root, argv)
    assert rc == 0, err[-3000:]
    assert f"resumed from {run / 'checkpoints' / '2'} at step 2" in err, err[-3000:]
    # The evaluations are kept (the report adds the run's whole-model KV read beside them).
    summary, kept = (json.loads(x) for x in ((run / "summary.json").read_text(),
                                             before["summary.json"]))
    assert summary["first"] == kept["first"], summary
    assert summary["last"].items() >= kept["last"].items(), summary
    assert (run / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    assert not (run / "config_history.jsonl").exists()


@slow
def test_swapped_data_new_model_and_new_layout_on_resume_are_refused_by_name(root, base,
                                                                           monkeypatch):
    """Issue #45 list 2 and 9, through the command (in-process: it stops before the model
    loads): the data file swapped for one of the same row count at the same path, a copy of
    the model at a new path, a new bin count and prompts_per_step (once reported as
    `{'batch_size': (2, 4)}`); then a total_steps below the run's step."""
    from sparrow_jax.data import synthetic

    run = _copy(base, "swapped")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    shutil.copytree(root / "model", root / "model_copy", dirs_exist_ok=True)
    data = root / "train.jsonl"
    original = data.read_bytes()
    rows = len(original.splitlines())
    try:
        synthetic.write_jsonl(str(data), rows, seed=5, k_range=(1, 1), num_letters=4)
        assert data.read_bytes() != original and len(data.read_bytes().splitlines()) == rows
        message = _train_error(_argv(root, "swapped", 2,
                                     TrainConfig__model_path=repr(str(root / "model_copy")),
                                     make_schedule__budgets=str([48] * 10),
                                     TrainConfig__prompts_per_step="4"), monkeypatch)
    finally:
        data.write_bytes(original)
    for needle in (f"{run} holds a run trained to step 2 with other settings",
                   f"TrainConfig.model_path: '{root / 'model'}' -> '{root / 'model_copy'}'",
                   f"make_schedule.budgets: {[48] * 20} -> {[48] * 10}",
                   "TrainConfig.prompts_per_step: 2 -> 4",
                   "training data content (sha256 of TrainConfig.train_data's files)",
                   "nothing was moved or changed", "another TrainConfig.run_dir"):
        assert needle in message, (needle, message)
    assert "batch_size" not in message, message
    message = _train_error(_argv(root, "swapped", 1), monkeypatch)
    assert f"TrainConfig.total_steps = 1 but the run in {run} is at step 2 already" in message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@slow
def test_fresh_start_is_refused_while_set_aside_steps_exist(root, base):
    run = _copy(base, "set_aside")
    (run / "damaged_checkpoints").mkdir()
    for step in ("1", "2"):
        shutil.move(run / "checkpoints" / step, run / "damaged_checkpoints" / step)
    metrics = (run / "metrics.jsonl").read_bytes()
    rc, err = _run(root, _argv(root, "set_aside", 3))
    _clean_error(rc, err, "has no restorable checkpoint",
                 f"were set aside as damaged in {run / 'damaged_checkpoints'}",
                 "To start afresh, move those away")
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (run / "damaged_checkpoints").iterdir()) == ["1", "2"]


def test_fresh_start_with_metrics_of_later_steps_is_refused(tmp_path):
    from sparrow_jax.runtime import resume_check

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert resume_check.check_fresh_start(str(tmp_path), str(tmp_path)) is None  # killed early
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 5}\n')
    reason = resume_check.check_fresh_start(str(tmp_path), str(tmp_path))
    assert reason and "records steps up to 5" in reason


class _FakeManager:
    """The parts of CheckpointManager that restore_newest_good uses, over real directories."""

    def __init__(self, run_dir: Path, steps: list[int]):
        self.run_dir = str(run_dir)
        self.directory = str(run_dir / "checkpoints")
        for s in steps:
            (run_dir / "checkpoints" / str(s)).mkdir(parents=True)

    def all_steps(self) -> list[int]:
        return sorted(int(p) for p in os.listdir(self.directory))

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def reload(self) -> None:
        pass


def test_only_verified_damage_sets_a_step_aside(tmp_path):
    from sparrow_jax.runtime import faults

    # A read that fails once (a transient error) is retried, not called damage.
    mngr = _FakeManager(tmp_path / "transient", [1, 2])
    calls = []

    def flaky(step):
        calls.append(step)
        if len(calls) == 1:
            raise OSError("Input/output error")
        return "state"
    assert faults.restore_newest_good(mngr, flaky, lambda step: None) == (2, "state")
    assert mngr.all_steps() == [1, 2] and not (tmp_path / "transient" / "damaged_checkpoints"
                                               ).exists()
    # A step of another configuration: a RunError with the classifier's message, nothing moved.
    mngr = _FakeManager(tmp_path / "config", [1, 2])

    def broken(step):
        raise ValueError("tree structure differs")
    with pytest.raises(faults.RunError, match="saved with a different configuration"):
        faults.restore_newest_good(mngr, broken,
                                   lambda step: "saved with a different configuration")
    assert mngr.all_steps() == [1, 2]
    # A fingerprint mismatch (a structurally matching restore): set aside, the older step used.
    mngr = _FakeManager(tmp_path / "damaged", [1, 2])

    def fingerprint(step):
        if step == 2:
            raise faults.DamagedCheckpointError("step 2: arrays differ")
        return "state"
    assert faults.restore_newest_good(mngr, fingerprint, lambda step: None) == (1, "state")
    assert mngr.all_steps() == [1]
    assert len(os.listdir(tmp_path / "damaged" / "damaged_checkpoints")) == 1


# -- one trainer per run directory --------------------------------------------------------------


def _next(trace: Path, offset: int, phase: str, proc: subprocess.Popen, timeout: float = 200
          ) -> int:
    """The step of the first `phase` line written to `trace` after byte `offset`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in trace.read_text()[offset:].splitlines():
            if line.startswith(phase + " "):
                return int(line.split()[1])
        assert proc.poll() is None, f"the run ended before another {phase!r}"
        time.sleep(0.01)
    raise TimeoutError(phase)


@slow
def test_second_trainer_stops_at_start_and_ctrl_c_stops_the_first_cleanly(root):
    """One run, four processes (kept in one test: each start costs imports and compiles):
    a second trainer while the first runs; Ctrl-C; two Ctrl-C; the resume. As in a terminal,
    Ctrl-C signals the trainer's whole process group, its two reward workers too (issue #45
    list 8: a double Ctrl-C with reward workers)."""
    run, trace = root / "shared", root / "shared.trace"
    # More steps than the test lets it run (it stops the run): a loaded machine can take a
    # while to start the second trainer, and the first must not finish meanwhile.
    argv = _argv(root, "shared", 300, TrainConfig__checkpoint_every="10",
                 TrainConfig__reward_processes="2")
    faults = {"trace": str(trace), "slow_reward_s": 0.3}
    first, log = _launch(root, argv, faults, group=True)
    try:
        _wait_for(trace, "rollout 1", first)
        rc, err = _run(root, argv)
        _clean_error(rc, err, f"run directory {run} is in use by another sparrow train",
                     f"host {socket.gethostname()}, pid {first.pid}")
        assert "precision:" not in err, "the second trainer loaded the model"
        # Ctrl-C inside a step: that step finishes, is saved, the run exits cleanly.
        step = _next(trace, trace.stat().st_size, "reward", first)
        os.killpg(first.pid, signal.SIGINT)
        # 130: saved and stopped, not finished (a scheduler or `&&` must not read it as done).
        assert first.wait(timeout=200) == 130, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    err = log.read_text()
    assert f"interrupted (Ctrl-C): saved step {step} and stopping" in err, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert group_left(first.pid) == [], "reward workers outlived the trainer"
    steps = list(range(1, step + 1))
    assert _steps(run) == steps, "the second trainer wrote into the first's run"
    # Step 1, every 10th, and the step Ctrl-C saved (an unloaded machine reaches step 10 before
    # the second trainer has come and gone).
    saved = sorted({1, step, *range(10, step + 1, 10)})
    assert _checkpoints(run) == saved
    assert (run / "sparrow.lock").read_text() == ""      # released
    # Resume; two Ctrl-C while the next step's rewards are scored: out at once, that step not
    # saved, the workers gone with the trainer, the last checkpoint intact.
    proc, log = _launch(root, argv, faults, group=True)
    try:
        assert _next(trace, trace.stat().st_size, "reward", proc) == step + 1
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = log.read_text()
    assert (f"stopped at once by a second Ctrl-C; the step in flight was not saved; the last "
            f"checkpoint is step {step}" in err), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert group_left(proc.pid, timeout=10) == [], "reward workers outlived the trainer"
    assert _checkpoints(run) == saved and _steps(run) == steps
    assert not (run / "damaged_checkpoints").exists()
    # The same command resumes from it (one more step here, to keep the test short).
    rc, err = _run(root, _argv(root, "shared", step + 1, TrainConfig__checkpoint_every="10",
                               TrainConfig__reward_processes="2"), faults)
    assert rc == 0, err[-3000:]
    assert f"resumed from {run / 'checkpoints' / str(step)} at step {step}" in err, err[-3000:]
    assert "taking over the stale lock" in err, err[-3000:]   # left by the exit at once
    assert _steps(run) == steps + [step + 1]
    assert _checkpoints(run) == sorted({*saved, step + 1})
    assert not (run / "damaged_checkpoints").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in rows), rows


@slow
def test_sigterm_to_the_process_group_saves_the_step_with_its_rewards(root):
    """Issue #45 list 3: Kubernetes, SLURM and `docker stop` signal the whole process group.
    The reward workers ignore it; the step in flight is scored in full, saved, and the run
    stops cleanly, its workers gone with it."""
    run, trace = root / "group", root / "group.trace"
    argv = _argv(root, "group", 8, TrainConfig__checkpoint_every="10",
                 TrainConfig__reward_processes="2")
    log = root / "group.stderr"
    proc = subprocess.Popen([sys.executable, str(TESTS / "fault_worker.py"), *argv],
                            env=_env(root, {"trace": str(trace), "slow_reward_s": 0.3}),
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)      # its own group, as a scheduler's job
    try:
        deadline = time.monotonic() + 200
        while not trace.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        step = _next(trace, 0, "reward", proc)
        time.sleep(0.5)                                   # workers busy scoring
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=200) == 143, log.read_text()[-3000:]     # requeue me
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = log.read_text()
    assert f"preemption requested: saved step {step} and stopping" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in rows), rows
    assert _checkpoints(run) == [step]
    deadline = time.monotonic() + 20                      # the workers went with the trainer
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("reward workers outlived the trainer")


@slow
def test_a_reward_worker_that_cannot_start_is_one_clear_line(root):
    """Issue #45: a reward worker that crashed at start-up (its module fails to import in the
    worker, not in the trainer) ended in a traceback. Now one line naming the reward, its
    function and the worker's own error, exit status 1, before the first rollout."""
    trace = root / "no_worker.trace"
    rc, err = _run(root, _argv(root, "no_worker", 2, TrainConfig__reward_processes="1"),
                   {"trace": str(trace), "worker_start_error": "libgmp.so.10: cannot open"})
    _clean_error(rc, err, "sparrow train: reward 'fault_worker:varied' (fault_worker.varied): a "
                 "reward worker process could not start: ImportError: libgmp.so.10: cannot open")
    assert not trace.exists() or "rollout 1" not in trace.read_text(), "a step began"
    assert not list((root / "no_worker" / "checkpoints").glob("[0-9]*"))
    metrics = root / "no_worker" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


@slow
def test_ctrl_c_during_start_up_exits_cleanly(root):
    """Issue #45 list 8: Ctrl-C while the model loads and compiles was a C++ abort (134)."""
    proc, log = _launch(root, _argv(root, "startup", 2))
    deadline = time.monotonic() + 200
    while "devices: " not in log.read_text(errors="replace"):   # the model loads next
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    err = log.read_text(errors="replace")
    assert "interrupted (Ctrl-C) during start-up, before the first step: nothing was trained" \
        in err, err[-3000:]
    assert "Traceback" not in err and "Aborted" not in err, err[-3000:]
    assert not list((root / "startup" / "checkpoints").glob("[0-9]*"))


@slow
def test_a_platform_without_its_device_is_one_clear_line(root):
    """Issue #45 list 8: JAX_PLATFORMS=cuda on a machine without a GPU crashed."""
    import importlib.util
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        pytest.skip("a CUDA plugin is installed: the platform may start here")
    env = {**_env(root, None), "JAX_PLATFORMS": "cuda"}
    proc = subprocess.run([sys.executable, str(TESTS / "fault_worker.py"),
                           *_argv(root, "no_gpu", 1)], env=env, capture_output=True, text=True,
                          timeout=300)
    _clean_error(proc.returncode, proc.stderr, "JAX cannot start its backend "
                 "(JAX_PLATFORMS='cuda')", "set it to cpu")
    assert not (root / "no_gpu").exists()


def test_run_lock_names_the_holder_and_takes_over_a_stale_lock(tmp_path, caplog):
    from sparrow_jax.runtime.faults import RunError
    from sparrow_jax.runtime.run_lock import RunLock

    with RunLock(tmp_path):
        with pytest.raises(RunError, match=f"host {socket.gethostname()}, pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):       # released: free again
        pass
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "sparrow.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}))
    with caplog.at_level(logging.WARNING), RunLock(tmp_path) as lock:
        assert lock.held
        assert json.loads((tmp_path / "sparrow.lock").read_text())["pid"] == os.getpid()
    assert "stale lock" in caplog.text and "that process is gone" in caplog.text


def test_deleting_the_lock_file_does_not_let_a_second_trainer_in(tmp_path):
    """Issue #45 list 6: the lock holds on the run directory itself, in another process (the
    user's second `sparrow train`), after the user deleted sparrow.lock by hand."""
    from sparrow_jax.runtime.run_lock import RunLock

    code = ("import sys\nfrom sparrow_jax.runtime.run_lock import RunLock\n"
            "from sparrow_jax.runtime.faults import RunError\n"
            "try:\n    RunLock(sys.argv[1]).acquire()\n"
            "except RunError as e:\n    print(e)\n    sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    with RunLock(tmp_path):
        (tmp_path / "sparrow.lock").unlink()
        second = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 3, second.stdout + second.stderr
        assert f"run directory {tmp_path} is in use by another sparrow train" in second.stdout
        assert "its lock file was deleted" in second.stdout
    with RunLock(tmp_path) as lock:     # released: free again
        assert lock.held


# -- export targets -----------------------------------------------------------------------------


@slow
def test_export_never_writes_into_the_run_or_the_model(root, base, tmp_path):
    from sparrow_jax.tools.export import PROVENANCE_FILE, ExportError, export

    steps = _checkpoints(base)
    for out, needle in ((base, "is the run directory"), (base / "hf", "is inside the run"),
                        (root, "contains the run directory"),
                        (root / "model" / "hf", "is inside the base model directory")):
        with pytest.raises(ExportError, match=needle):
            export(base, out, overwrite=True)
    assert _checkpoints(base) == steps and (base / "metrics.jsonl").exists()
    assert not (root / "model" / "hf").exists()
    # A directory export did not write is never replaced, --overwrite or not.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not an earlier `sparrow export`"):
        export(base, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    # An earlier export: refused without --overwrite; with it, only the export's files change.
    out = tmp_path / "hf"
    export(base, out)
    (out / "README.md").write_text("my notes")
    with pytest.raises(ExportError, match="--overwrite"):
        export(base, out)
    export(base, out, dtype="bfloat16", overwrite=True, step=1)
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["dtype"] == "bfloat16" and provenance["step"] == 1
    assert (out / "README.md").read_text() == "my notes"
    assert "README.md" not in provenance["files"] and "model.safetensors" in provenance["files"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging left


@slow
def test_export_checks_the_fingerprint_and_exports_nothing_from_a_damaged_step(root, base,
                                                                              tmp_path):
    """Issue #45 list 4: a corrupted step exported with exit 0 (and wrong weights). Step 2's
    parameter files are replaced by step 1's: arrays that decode cleanly but are not the ones
    step 2's fingerprint was taken of."""
    run = _copy(base, "damaged_export")
    shutil.rmtree(run / "checkpoints" / "2" / "params")
    shutil.copytree(run / "checkpoints" / "1" / "params", run / "checkpoints" / "2" / "params")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "sparrow_jax.cli", "export", str(run),
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=_env(root, None))
    assert proc.returncode == 1, proc.stderr[-3000:]
    for needle in ("step 2: ", "differ from the fingerprint saved with them",
                   "Nothing was exported", "available: [1, 2]"):
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- validation before anything loads -------------------------------------------------------------


def _train_error(argv: list[str], monkeypatch) -> str:
    from sparrow_jax import cli
    from sparrow_jax.train import trainer as train

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")
    monkeypatch.setattr(train, "load_hf", no_model)
    gin.clear_config()
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
    finally:
        gin.clear_config()
    return str(e.value)


def test_every_bad_setting_is_reported_together_before_the_model_loads(root, tmp_path,
                                                                       monkeypatch):
    argv = _argv(root, "never", 0, TrainConfig__eval_every="0", TrainConfig__mesh_model="0",
                 TrainConfig__checkpoint_every="0", TrainConfig__max_to_keep="0",
                 TrainConfig__prompts_per_step="0", TrainConfig__run_dir="''",
                 TrainConfig__train_data=repr(str(tmp_path / "missing.jsonl")),
                 TrainConfig__eval_data=repr(str(tmp_path / "no_dir" / "*.jsonl")),
                 TrainConfig__reward="'no_such_reward'",
                 TrainConfig__diagnostic_rewards="('no_such_module_xyz:f',)",
                 LearnerConfig__remat="'sometimes'",
                 ReferenceEvalConfig__data=repr(str(tmp_path / "no_refs.jsonl")))
    message = _train_error(argv, monkeypatch)
    for needle in ("total_steps must be >= 1, got 0", "eval_every must be >= 1, got 0",
                   "checkpoint_every must be >= 1, got 0", "max_to_keep must be >= 1, got 0",
                   "prompts_per_step must be >= 1, got 0", "mesh_model must be >= 1, got 0",
                   "TrainConfig.run_dir is empty", "missing.jsonl",
                   "TrainConfig.eval_data", "unknown reward 'no_such_reward'",
                   "module 'no_such_module_xyz' does not import",
                   "LearnerConfig.remat must be one of", "ReferenceEvalConfig.data", "no_refs"):
        assert needle in message, (needle, message)
    assert not (Path.cwd() / "never").exists()


def test_settings_that_would_train_wrong_are_refused_by_name_before_the_model_loads(
        root, tmp_path, monkeypatch):
    """Issue #45 lists 7 and 9: temperature 0 for GRPO (a zero gradient at every step), a YaRN
    rope_scaling beside default rope_parameters (trained as plain RoPE), a negative learning
    rate (the message did not name it), an error share outside [0, 1]."""
    model = tmp_path / "yarn_model"
    shutil.copytree(root / "model", model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(config))
    argv = _argv(root, "never_wrong", 1, RolloutConfig__temperature="0.0",
                 LearnerConfig__learning_rate="-1e-3", TrainConfig__model_path=repr(str(model)),
                 TrainConfig__max_reward_error_share="2.0", TrainConfig__dtype="'float16'")
    message = _train_error(argv, monkeypatch)
    for needle in ("RolloutConfig.temperature = 0.0: GRPO learns from the differences",
                   "LearnerConfig.learning_rate must be finite and > 0, got -0.001",
                   "rope_scaling.rope_type='yarn' is not supported",
                   "TrainConfig.max_reward_error_share must be in [0, 1], got 2.0",
                   "TrainConfig.dtype = 'float16': float16 overflows"):
        assert needle in message, (needle, message)
    assert not (root / "never_wrong").exists()
    # List 10: found only after minutes of loading before.
    argv = _argv(root, "never_late", 1, RolloutConfig__backend="'fastest'",
                 LearnerConfig__micro_batch_size="3", make_schedule__budgets=str([128] * 20),
                 PromptFormat__use_chat_template="True")
    message = _train_error(argv, monkeypatch)
    for needle in ("RolloutConfig.backend = 'fastest' is not a kernel backend",
                   "LearnerConfig.micro_batch_size = 3 must be a multiple of "
                   "TrainConfig.group_size = 2",
                   "schedule budgets reach 128 tokens but RolloutConfig.max_budget = 64",
                   "PromptFormat.use_chat_template = True but the tokenizer"):
        assert needle in message, (needle, message)


def test_an_unquoted_gin_string_names_the_binding():
    from sparrow_jax import cli
    with pytest.raises(SystemExit) as e:
        cli.parse_gin([], ["TrainConfig.reward = math_verify"])
    gin.clear_config()
    assert "<ast" not in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "a string needs quotes (TrainConfig.reward = 'math_verify')" in str(e.value)


def test_a_mesh_that_does_not_fit_the_devices_stops_before_the_model_loads(root, monkeypatch):
    """In process, on this test's one CPU device: a mesh_model of 2 (silently unsharded before)
    and an explicit data x model mesh are checked against the devices once the processes are
    known, before the model (or the run directory) is touched."""
    message = _train_error(_argv(root, "mesh", 1, TrainConfig__mesh_model="2"), monkeypatch)
    assert message.startswith("sparrow train: ") and "\n" not in message
    assert "TrainConfig.mesh_model = 2 does not divide this run's 1 cpu device(s)" in message
    message = _train_error(_argv(root, "mesh", 1, make_mesh__data="2"), monkeypatch)
    assert "make_mesh.data = 2 x TrainConfig.mesh_model = 1 needs 2 devices" in message
    assert not (root / "mesh").exists()


def test_device_problems_of_meshes_hosts_and_rollout_rows():
    """`preflight.device_problems` with the device counts of real machines (no hardware)."""
    from types import SimpleNamespace

    from sparrow_jax.train.preflight import device_problems

    def cfg(**kw):
        return SimpleNamespace(**{"mesh_model": 1, "rollout_batch_prompts": 0,
                                  "prompts_per_step": 8, "group_size": 8, **kw})

    # A 2 x 4 mesh on 6 GPUs, and a model axis of 4 on 6.
    (p,) = device_problems(cfg(mesh_model=4), devices=6, local_devices=6, processes=1,
                           platform="gpu", mesh_data=2)
    assert "make_mesh.data = 2 x TrainConfig.mesh_model = 4 needs 8 devices, this run has 6 " \
           "gpu device(s)" in p
    (p,) = device_problems(cfg(mesh_model=4), devices=6, local_devices=6, processes=1,
                           platform="gpu")
    assert "mesh_model = 4 does not divide this run's 6 gpu device(s)" in p and "[1, 2, 3, 6]" in p
    # Two hosts of 4 chips: a model axis of 8 would span both.
    (p,) = device_problems(cfg(mesh_model=8), devices=8, local_devices=4, processes=2,
                           platform="tpu")
    assert "spans hosts: each process has 4 device(s)" in p
    # 3 prompts x 2 samples do not split over 4 data shards.
    (p,) = device_problems(cfg(prompts_per_step=3, group_size=2), devices=4, local_devices=4,
                           processes=1, platform="gpu")
    assert "rollout call's 6 rows (3 prompts x group_size 2) do not divide the mesh's data " \
           "axis of 4" in p
    # What the shipped configs ask for fits: 8 GPUs, 1.7B data parallel; v5p hosts of 4, mesh 4.
    assert device_problems(cfg(prompts_per_step=64), devices=8, local_devices=8, processes=1,
                           platform="gpu") == []
    assert device_problems(cfg(mesh_model=4, prompts_per_step=32, rollout_batch_prompts=8),
                           devices=16, local_devices=4, processes=4, platform="tpu") == []


def test_model_directory_without_a_usable_tokenizer(root, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(root / "model" / name, bare / name)
    message = _train_error(_argv(root, "x", 1, TrainConfig__model_path=repr(str(bare))),
                           monkeypatch)
    assert f"model directory {str(bare)!r} has no tokenizer files" in message
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(bare / "tokenizer.json"))
    message = _train_error(_argv(root, "x", 1, TrainConfig__model_path=repr(str(bare))),
                           monkeypatch)
    assert "not a usable vocabulary" in message


def test_user_reward_module_in_the_current_directory(tmp_path, monkeypatch):
    from sparrow_jax.train import preflight

    (tmp_path / "cwd_rewards_28.py").write_text(
        "from sparrow_jax.rewards.registry import register_reward\n"
        "@register_reward('cwd_len_28')\n"
        "def f(completion_text, ground_truth, *, prompt='', meta=None):\n"
        "    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    # As under the `sparrow` console script: neither '' nor the directory on sys.path.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_rewards_28", raising=False)
    assert preflight.reward_problems({"reward": "cwd_rewards_28:cwd_len_28"}) == []
    sys.modules.pop("cwd_rewards_28", None)


def test_sft_does_not_overwrite_a_model_directory(tmp_path):
    from sparrow_jax import cli
    from sparrow_jax.train.sft import SFTConfig, check_output_dir

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    gin.clear_config()
    try:
        with pytest.raises(SystemExit, match="already holds a model.*SFTConfig.overwrite"):
            cli.main(["sft", "--gin_param", f"SFTConfig.output_dir = '{out}'"])
    finally:
        gin.clear_config()
    assert (out / "config.json").read_text() == "{}"
    check_output_dir(SFTConfig(output_dir=str(out), overwrite=True))      # asked: allowed
    check_output_dir(SFTConfig(output_dir=str(tmp_path / "new")))


def test_sft_crop_longer_than_the_sequences_is_a_clear_error(tmp_path):
    """Issue #45 list 8: a crop_length over the sequence length crashed with numpy's error."""
    from sparrow_jax import cli
    gin.clear_config()
    try:
        with pytest.raises(SystemExit, match=r"sparrow sft: SFTConfig.crop_length = 100000 is "
                                             r"longer than a training sequence \(\d+ tokens"):
            cli.main(["sft", "--gin_param", f"SFTConfig.output_dir = '{tmp_path / 'o'}'",
                      "--gin_param", "SFTConfig.crop_length = 100000",
                      "--gin_param", "SFTConfig.crop_steps = 1",
                      "--gin_param", "SFTConfig.long_steps = 1"])
    finally:
        gin.clear_config()
    assert not (tmp_path / "o").exists()


def test_math_verify_timeout_log_is_cut_short(caplog):
    from sparrow_jax.rewards.math_rewards import math_verify_reward

    assert math_verify_reward("\\boxed{2}", "2") == 1.0       # loads math-verify
    with caplog.at_level(logging.WARNING):
        logging.getLogger("math_verify.parser").warning(f"Timeout during parsing: {'9' * 4000}")
    (record,) = [r for r in caplog.records if r.name == "math_verify.parser"]
    assert len(record.getMessage()) < 300 and "more characters" in record.getMessage()
