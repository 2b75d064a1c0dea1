"""`RewardPool`: scores a batch of completions with a registered reward, hard timeouts per item.

With `processes > 0` every item runs in a separate worker process started with a *spawn* (or
forkserver) context - the trainer holds JAX/XLA threads, which must never be forked - and an
item that overruns `timeout_s` gets reward 0 while its worker is killed and replaced, so a
hostile or huge answer cannot stall training. A worker that cannot start (its reward module
fails to import there) stops the run with the worker's own error (`wait_ready`); the worker
side is sparrow_jax.rewards.workers. `score` returns a `RewardReport`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import time
import traceback
import weakref
from typing import Sequence

import gin
import numpy as np

from sparrow_jax.rewards.registry import RewardFn, reward_entry
from sparrow_jax.rewards.workers import (JOB_SIGNALS, Worker, as_reward, describe_exit,
                                         job_signals_blocked)
from sparrow_jax.runtime import interrupts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)    # eq=False: an array has no truth value
class RewardReport:
    """One batch's rewards and what went wrong while scoring it.

    rewards [N] float32, in item order; failed or timed-out items score 0. `failed` /
    `timed_out`: item indices; `crashed`: workers that died while scoring; `restarts`: workers
    replaced (timed out or died). For the first failed item: `first_error` (its error's last
    line), `first_error_index`, `first_traceback` (all None when no item failed)."""
    rewards: np.ndarray
    seconds: float = 0.0
    timed_out: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    restarts: int = 0
    crashed: int = 0
    first_error: str | None = None
    first_error_index: int | None = None
    first_traceback: str | None = None

    @property
    def timeouts(self) -> int:
        return len(self.timed_out)

    @property
    def errors(self) -> int:
        return len(self.failed)


@dataclasses.dataclass
class _Tally:
    """What happened to a batch being scored, so far (frozen into its RewardReport)."""
    timed_out: list[int] = dataclasses.field(default_factory=list)
    failed: list[int] = dataclasses.field(default_factory=list)
    restarts: int = 0
    crashed: int = 0
    first_failure: tuple[int, str] | None = None    # (item index, its traceback)

    def fail(self, i: int, error: str) -> None:
        """Item `i` raised (or its worker died): `error` is its traceback or what happened."""
        self.failed.append(i)
        if self.first_failure is None:
            self.first_failure = (i, error)

    def report(self, rewards: np.ndarray, seconds: float) -> RewardReport:
        first = {}
        if self.first_failure is not None:
            i, error = self.first_failure
            # The last line names the exception; the whole traceback goes with it.
            lines = error.strip().splitlines()
            first = {"first_error": lines[-1][:500] if lines else error[:500],
                     "first_error_index": i, "first_traceback": error}
        return RewardReport(rewards=rewards, seconds=seconds, timed_out=tuple(self.timed_out),
                            failed=tuple(self.failed), restarts=self.restarts,
                            crashed=self.crashed, **first)


Item = tuple  # (completion, ground_truth[, prompt[, meta]])


@gin.configurable
class RewardPool:
    """Scores (completion, ground_truth[, prompt[, meta]]) items; see the module docstring.

    processes=0 evaluates in-process (cheap rewards, tests); `timeout_s` is then not enforced.
    Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        reward: str | RewardFn = "math_verify",
        *,
        processes: int = 4,
        timeout_s: float = 10.0,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
    ):
        if start_method not in ("spawn", "forkserver"):
            # fork would copy the trainer's JAX runtime threads/locks into the child.
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if isinstance(reward, str):
            entry = reward_entry(reward)
            self._fn, self._preload = entry.fn, entry.preload
        else:
            self._fn, self._preload = reward, ()
        where = (f"{getattr(self._fn, '__module__', '?')}."
                 f"{getattr(self._fn, '__qualname__', type(self._fn).__name__)}")
        self.label = f"{reward!r} ({where})" if isinstance(reward, str) else where
        self.processes = processes
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context(start_method)
        self._payload = b""
        if processes > 0:
            try:    # the worker unpickles it (rewards.workers): its import errors are reported
                self._payload = pickle.dumps((self._fn, self._preload))
            except Exception as e:  # noqa: BLE001 - lambdas, local functions, closures
                raise ValueError(f"reward {self.label} cannot be sent to reward worker "
                                 f"processes ({type(e).__name__}: {e}); define it at module "
                                 f"level, or score in-process (processes=0)") from e
        self._workers: list[Worker] = []
        # A start-up signal ends the trainer at once (runtime.interrupts): the workers go with
        # it, killed, also one still reading its start-up data (else a traceback of its own).
        # (A weak reference: the registration must not keep an unclosed pool from `__del__`.)
        kill_now = weakref.WeakMethod(self.kill_now)
        self._undo_at_exit = (interrupts.at_exit(lambda: (kill_now() or (lambda: None))())
                              if processes > 0 else None)
        for _ in range(processes):
            self._spawn()
        self.total = collections.Counter()

    def _spawn(self, k: int | None = None) -> None:
        """Starts a worker as self._workers[k] (appended when k is None).

        A job signal must not come between the start and the registration: the child would
        outlive an exit at once that kills the registered workers (`kill_now`), or read a
        half-written start-up hand-off (an EOFError traceback of its own). Blocking the
        signal in this thread is not enough - the kernel hands a process-directed signal to
        any thread that does not block it (XLA's, the data loader's) and Python runs the
        handler in this thread at its next bytecode - so `interrupts.critical` defers a
        start-up exit to the end of the block as well."""
        with interrupts.critical(), job_signals_blocked():
            worker = Worker(self._ctx, self._payload)
            if k is None:
                self._workers.append(worker)
            else:
                self._workers[k] = worker

    def _startup_failure(self, cause: str, worker_traceback: str | None = None) -> Exception:
        """The error that stops a run whose reward worker could not start (one line)."""
        from sparrow_jax.runtime.faults import RunError   # lazy: workers never load orbax

        if worker_traceback:
            log.debug("reward worker start-up traceback:\n%s", worker_traceback)
        return RunError(f"reward {self.label}: a reward worker process could not start: "
                        f"{cause} (--log_level DEBUG shows the worker's traceback; "
                        f"RewardPool.processes = 0 scores in the trainer's process)")

    def _startup_message(self, w: Worker) -> None:
        """Reads a not-yet-ready worker's first message: ready, or its start-up error."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            # Died before it could say why (os._exit, a crash in an extension's import).
            code = w.exit_code()
            if code is not None and -code in JOB_SIGNALS:
                # A job signal (Ctrl-C, SIGTERM) went to the process group and reached the
                # worker before it could ignore it (seen under load, 3.5 s into a start-up):
                # the trainer got it too, so its own handler decides (one line, 130 / 143),
                # not a reward error. Re-raised here in case this thread has not run it yet.
                signal.raise_signal(-code)
            raise self._startup_failure(
                f"it died before reporting ready ({describe_exit(code)}); any output "
                f"of its own is above") from None
        if msg == ("ready",):
            w.ready = True
            return
        if isinstance(msg, tuple) and msg and msg[0] == "failed":
            lines = str(msg[1]).strip().splitlines()
            raise self._startup_failure(lines[-1][:500] if lines else "(no message)", msg[1])
        raise self._startup_failure(f"its first message was {msg!r:.100}, not 'ready'")

    def wait_ready(self) -> None:
        """Blocks until every worker reported ready (none with processes=0). A worker that fails
        or dies at start-up raises RunError naming the reward and the worker's own error: the
        trainer calls this before its first step, so a broken reward module costs no rollout."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(w.ready for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._startup_failure(f"none reported ready in {self.startup_timeout_s}s")
            waiting = [w.conn for w in self._workers if not w.ready]
            for conn in multiprocessing.connection.wait(waiting, timeout=left):
                self._startup_message(next(w for w in self._workers if w.conn is conn))

    def kill_now(self) -> None:
        """SIGKILL to every worker, nothing waited for: for a process about to exit at once
        (a second Ctrl-C), which must not leave workers behind."""
        for w in self._workers:
            try:
                w.process.kill()
            except (OSError, ValueError, AttributeError):  # already gone / never started
                pass

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_undo_at_exit", None) is not None:
            self._undo_at_exit()
            self._undo_at_exit = None
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.process.join(timeout=2)
            w.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def score(self, items: Sequence[Item]) -> RewardReport:
        """The rewards of `items` and the timeouts, errors and worker restarts on the way (see
        RewardReport). Failed or timed-out items score 0."""
        t0 = time.monotonic()
        items = [_normalize_item(it) for it in items]
        rewards = np.zeros(len(items), np.float32)
        tally = _Tally()
        if self.processes == 0:
            for i, (completion, truth, prompt, meta) in enumerate(items):
                try:
                    rewards[i] = as_reward(self._fn(completion, truth, prompt=prompt, meta=meta))
                except Exception:  # noqa: BLE001 - counted; the trainer decides (its threshold)
                    tally.fail(i, traceback.format_exc()[-4000:])
        else:
            self._score_in_pool(items, rewards, tally)
        report = tally.report(rewards, time.monotonic() - t0)
        self.total.update(timeouts=report.timeouts, errors=report.errors,
                          restarts=report.restarts)
        return report

    def _score_in_pool(self, items: list, rewards: np.ndarray, tally: _Tally) -> None:
        pending = collections.deque(range(len(items)))
        started = time.monotonic()
        while pending or any(w.job for w in self._workers):
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.ready and w.job is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((i, *items[i]))
                    except OSError:
                        # The worker died while idle: requeue the item on a fresh worker.
                        pending.appendleft(i)
                        self._replace(k, tally)
                        continue
                    # The deadline starts at dispatch, so queueing time never counts.
                    w.job = (i, now + self.timeout_s)
            deadlines = [w.job[1] for w in self._workers if w.job]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.5
            ready = multiprocessing.connection.wait([w.conn for w in self._workers], timeout=wait_s)
            for k, w in enumerate(self._workers):
                if w.conn not in ready:
                    continue
                if not w.ready:
                    self._startup_message(w)    # ready, or the run stops with its error
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    # Crashed (segfault, OOM kill): its item fails, the worker is replaced.
                    if w.job is not None:
                        tally.crashed += 1
                        tally.fail(w.job[0], f"the reward worker (pid {w.process.pid}) died "
                                             f"while scoring this item "
                                             f"({describe_exit(w.exit_code())})")
                    self._replace(k, tally)
                    continue
                i, ok, value = msg
                w.job = None
                if ok:
                    rewards[i] = value
                else:
                    tally.fail(i, value)
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.job is not None and now >= w.job[1]:
                    tally.timed_out.append(w.job[0])
                    self._replace(k, tally)
            if not any(w.ready for w in self._workers) and now - started > self.startup_timeout_s:
                raise self._startup_failure(f"none reported ready in {self.startup_timeout_s}s")

    def _replace(self, k: int, tally: _Tally) -> None:
        # A stuck worker cannot be interrupted cooperatively; kill it and start a fresh one.
        self._workers[k].kill()
        self._spawn(k)
        tally.restarts += 1


def _normalize_item(item: Item) -> tuple[str, str, str, dict | None]:
    if not 2 <= len(item) <= 4:
        raise ValueError(
            f"a reward item is (completion, ground_truth[, prompt[, meta]]), got {item!r:.200}"
        )
    completion, truth = item[0], item[1]
    prompt = item[2] if len(item) > 2 else ""
    meta = item[3] if len(item) > 3 else None
    return str(completion), str(truth), str(prompt), meta
