"""The worker processes of `RewardPool` (sparrow_jax.rewards.pool): start-up, signals, scoring loop.

A worker receives its reward function pickled (`pickle.dumps((fn, preload))`) and unpickles it
itself, inside a `try`: unpickling imports the function's module, so a module that fails to
import in the worker (or a `preload` module that is not installed) is reported to the trainer as
the worker's own error text, not as a traceback of the worker and an unexplained dead pipe.

Messages from worker to pool: ("ready",) once, or ("failed", traceback) and exit; then
(index, True, reward) or (index, False, traceback) per item.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import threading
import traceback
from typing import Any, Iterator

import numpy as np

# Job-control signals go to the whole process group (Ctrl-C; SIGTERM from Kubernetes, SLURM,
# `docker stop`). Reward workers ignore them: the trainer finishes the step's scoring, saves,
# and stops the workers itself (`RewardPool.close`, or `RewardPool.kill_now` when a second
# signal stops the run at once). They are blocked from spawn to the worker's first line (a
# blocked signal stays blocked across fork and exec), so no start-up window is open.
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TRACEBACK_CHARS = 4000


def as_reward(value: Any) -> float:
    """A reward function's result as a finite float; anything else (a string - even "1" -, None,
    a list, NaN/inf) raises, and the pool scores the item 0 and counts it as an error."""
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1 and (
            np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward must be a number, got {type(value).__name__} {value!r:.60}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"non-finite reward {value}")
    return value


def _exit_with_parent() -> None:
    """A worker ignores Ctrl-C and SIGTERM, so it must not outlive a trainer that died without
    stopping it (kill -9, an exit at once): a daemon thread waits on the parent's sentinel."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="reward-worker-parent-watch", daemon=True).start()


def worker_main(conn: Any, payload: bytes) -> None:
    """Worker loop: unpickle the reward and import its modules, report ready (or the error),
    then score items until told to stop."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    _exit_with_parent()
    try:
        fn, preload = pickle.loads(payload)
        for module in preload:
            importlib.import_module(module)
    except BaseException:  # noqa: BLE001 - SystemExit of a module too: the trainer reports it
        conn.send(("failed", traceback.format_exc()[-TRACEBACK_CHARS:]))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, completion, truth, prompt, meta = msg
        try:
            value = as_reward(fn(completion, truth, prompt=prompt, meta=meta))
            conn.send((idx, True, value))
        except Exception:  # noqa: BLE001 - any reward bug costs its item; the trainer decides
            conn.send((idx, False, traceback.format_exc()[-TRACEBACK_CHARS:]))


@contextlib.contextmanager
def job_signals_blocked() -> Iterator[None]:
    """JOB_SIGNALS blocked in this thread (the main thread; elsewhere nothing changes): a worker
    started inside inherits the block until `worker_main` ignores them.

    multiprocessing's resource tracker, which a spawn or forkserver start launches the first
    time, *unblocks* SIGINT and SIGTERM once it has started (resource_tracker.ensure_running,
    CPython 3.11-3.12): launched inside this block it would reopen the window for the first
    worker (issue 58: a Ctrl-C 3.5 s into a start-up killed a worker still importing, about
    half the runs on a loaded machine). So it is started first, outside the block."""
    if not (hasattr(signal, "pthread_sigmask")
            and threading.current_thread() is threading.main_thread()):
        yield
        return
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Worker:
    """One worker process and the pool's end of its pipe; `job` is (item index, deadline).
    Construct it inside `job_signals_blocked()` (RewardPool does)."""

    def __init__(self, ctx: Any, payload: bytes):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child, payload), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.job: tuple[int, float] | None = None

    def exit_code(self) -> int | None:
        """The exit code of a worker whose pipe closed (it may take a moment to be reaped)."""
        self.process.join(timeout=2)
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def describe_exit(code: int | None) -> str:
    """"exit code 3", "killed by SIGSEGV", or "still running" for a worker's exit code."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
