"""Verifiable rewards: a name -> function registry and a process pool with hard per-item timeouts.

A reward function has the signature
    fn(completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None)
        -> float
and is registered with `@register_reward("name")`. Names resolve through `get_reward`, which
also accepts "package.module:name" (imports the module first, so user rewards can be referenced
from gin files without touching this package).

`RewardPool` scores a batch of items. With `processes > 0` every item runs in a separate worker
process started with a *spawn* (or forkserver) context - the trainer holds JAX/XLA threads, which
must never be forked - and an item that overruns `timeout_s` gets reward 0 while its worker is
killed and replaced, so a hostile or huge answer cannot stall training. A worker that cannot
start (its reward module fails to import there) stops the run with the worker's own error
(`wait_ready`); the worker side is sparrow_jax.rl.reward_workers.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import gin
import numpy as np

# extract_last_boxed is re-exported: callers import it from here.
from sparrow_jax.rl.answers import (ANSWER_FORMATS, dapo_score, extract_answer,  # noqa: F401
                                    extract_last_boxed)
from sparrow_jax.rl.reward_workers import Worker, as_reward, describe_exit

RewardFn = Callable[..., float]
log = logging.getLogger(__name__)

# Modules that register rewards when imported; loaded lazily on the first unknown name so that
# importing this module stays cheap (no sympy) and free of import cycles.
_BUILTIN_REWARD_MODULES = ("sparrow_jax.data.synthetic",)


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: RewardFn
    preload: tuple[str, ...]  # heavy modules a pool worker imports before reporting ready


_REGISTRY: dict[str, _Entry] = {}


def register_reward(name: str, *, preload: Sequence[str] = ()) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`. `preload`: modules pool workers import at start
    (so the first item's timeout is not eaten by e.g. importing sympy)."""

    def decorator(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        # Re-importing the same module (spawned workers, pytest) re-registers the same function.
        same = old is not None and (old.fn.__module__, old.fn.__qualname__) == (
            fn.__module__,
            fn.__qualname__,
        )
        if old is not None and not same:
            owner = f"{old.fn.__module__}.{old.fn.__qualname__}"
            raise ValueError(f"reward {name!r} is already registered by {owner}")
        _REGISTRY[name] = _Entry(fn, tuple(preload))
        return fn

    return decorator


def _lookup(name: str) -> _Entry:
    if ":" in name:
        module, name = name.rsplit(":", 1)
        importlib.import_module(module)
    if name not in _REGISTRY:
        for module in _BUILTIN_REWARD_MODULES:
            importlib.import_module(module)
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise KeyError(f"unknown reward {name!r}; registered rewards: {known}")
    return _REGISTRY[name]


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name` (or "module.path:name")."""
    return _lookup(name).fn


def reward_names() -> list[str]:
    """Names of all registered rewards (after loading the built-in reward modules)."""
    for module in _BUILTIN_REWARD_MODULES:
        importlib.import_module(module)
    return sorted(_REGISTRY)


@gin.configurable
def make_reward_fn(name: str = "math_verify") -> RewardFn:
    """gin factory: `make_reward_fn.name = "synthetic_exact"`."""
    return get_reward(name)


# ----------------------------------------------------------------------------- math_verify


def _normalize_plain(s: str) -> str:
    return "".join(s.split()).rstrip(".").strip("$")


class _ShortLogs(logging.Filter):
    """Cuts a log message to `LOG_CHARS` characters: math-verify logs the whole input it timed
    out on ("Timeout during parsing: <pred>"), and a hostile completion is thousands of them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > LOG_CHARS:
            record.msg = f"{message[:LOG_CHARS]} [... {len(message) - LOG_CHARS} more characters]"
            record.args = None
        return True


LOG_CHARS = 200
# Logger filters do not apply to child loggers' records: each math-verify module's own logger.
_MATH_VERIFY_LOGGERS = ("math_verify", "math_verify.parser", "math_verify.grader",
                        "math_verify.metric", "math_verify.utils")


def shorten_math_verify_logs() -> None:
    """Installs the `_ShortLogs` filter on math-verify's loggers (idempotent)."""
    for name in _MATH_VERIFY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ShortLogs) for f in logger.filters):
            logger.addFilter(_ShortLogs())


def _math_verify(completion_text: str, ground_truth: str, formats: tuple[str, ...]) -> float:
    """1.0 iff the completion's final answer (by `formats`, see sparrow_jax.rl.answers) equals
    the ground truth per math-verify (symbolic/numeric: "\\frac{1}{2}" == "0.5"), else 0.0."""
    answer = extract_answer(completion_text, formats)
    if answer is None or not answer.strip():
        return 0.0
    from math_verify import parse, verify  # lazy: sympy is slow to import

    shorten_math_verify_logs()    # here: also in spawned reward workers
    # math-verify's own timeouts use SIGALRM, which only works on the main thread.
    main = threading.current_thread() is threading.main_thread()
    limit = 5 if main else None
    gt = str(ground_truth).strip()
    gold_box = extract_last_boxed(gt)
    if gold_box is not None:
        gt = gold_box
    gold = parse(gt if "$" in gt else f"${gt}$", parsing_timeout=limit)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if gold and pred and verify(gold, pred, timeout_seconds=limit):
        return 1.0
    # Non-math ground truths (names, labels) that math-verify cannot parse: exact text match.
    return 1.0 if _normalize_plain(answer) == _normalize_plain(gt) else 0.0


@register_reward("math_verify", preload=("math_verify",))
def math_verify_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """The last `\\boxed{}` or `Answer:` line (whichever comes last) checked with math-verify."""
    del prompt, meta
    return _math_verify(completion_text, ground_truth, ANSWER_FORMATS)


@register_reward("math_verify_boxed", preload=("math_verify",))
def math_verify_boxed_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """Only the last `\\boxed{}` counts (prompts that ask for a box)."""
    del prompt, meta
    return _math_verify(completion_text, ground_truth, ("boxed",))


@register_reward("math_verify_answer_line", preload=("math_verify",))
def math_verify_answer_line_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """Only the last `Answer: ...` line counts (DAPO-style prompts, strictly)."""
    del prompt, meta
    return _math_verify(completion_text, ground_truth, ("answer_line",))


@register_reward("dapo")
def dapo_reward(completion_text: str, ground_truth: str, *, prompt: str = "",
                meta: dict | None = None) -> float:
    """The DAPO-Math rule (sparrow_jax.rl.answers.dapo_score): +1 / -1, no math-verify."""
    del prompt, meta
    return dapo_score(completion_text, ground_truth)


# ----------------------------------------------------------------------------- worker pool


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
            entry = _lookup(reward)
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
            try:    # the worker unpickles it (reward_workers): its import errors are reported
                self._payload = pickle.dumps((self._fn, self._preload))
            except Exception as e:  # noqa: BLE001 - lambdas, local functions, closures
                raise ValueError(f"reward {self.label} cannot be sent to reward worker "
                                 f"processes ({type(e).__name__}: {e}); define it at module "
                                 f"level, or score in-process (processes=0)") from e
        self._workers: list[Worker] = []
        self._workers = [self._spawn() for _ in range(processes)]
        self.total = collections.Counter()

    def _spawn(self) -> Worker:
        return Worker(self._ctx, self._payload)

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
            raise self._startup_failure(
                f"it died before reporting ready ({describe_exit(w.exit_code())}); any output "
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

    def score(self, items: Sequence[Item]) -> tuple[np.ndarray, dict[str, Any]]:
        """Rewards `[len(items)]` float32 and info {timeouts, errors, restarts, crashed
        (workers that died while scoring), seconds, timed_out (indices), failed (indices)}, and
        for the first failed item first_error (its last line), first_error_index and
        first_traceback. Failed or timed-out items score 0."""
        t0 = time.monotonic()
        items = [_normalize_item(it) for it in items]
        rewards = np.zeros(len(items), np.float32)
        info: dict[str, Any] = {
            "timeouts": 0,
            "errors": 0,
            "restarts": 0,
            "crashed": 0,
            "timed_out": [],
            "failed": [],
        }
        if self.processes == 0:
            for i, (completion, truth, prompt, meta) in enumerate(items):
                try:
                    rewards[i] = as_reward(self._fn(completion, truth, prompt=prompt, meta=meta))
                except Exception:  # noqa: BLE001 - counted; the trainer decides (its threshold)
                    self._fail(i, info, "errors", "failed", traceback.format_exc()[-4000:])
        else:
            self._score_in_pool(items, rewards, info)
        info["seconds"] = time.monotonic() - t0
        self.total.update({k: info[k] for k in ("timeouts", "errors", "restarts")})
        return rewards, info

    def _score_in_pool(self, items: list, rewards: np.ndarray, info: dict[str, Any]) -> None:
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
                        self._replace(k, info)
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
                        info["crashed"] += 1
                        self._fail(w.job[0], info, "errors", "failed",
                                   f"the reward worker (pid {w.process.pid}) died while scoring "
                                   f"this item ({describe_exit(w.exit_code())})")
                    self._replace(k, info)
                    continue
                i, ok, value = msg
                w.job = None
                if ok:
                    rewards[i] = value
                else:
                    self._fail(i, info, "errors", "failed", value)
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.job is not None and now >= w.job[1]:
                    self._fail(w.job[0], info, "timeouts", "timed_out")
                    self._replace(k, info)
            if not any(w.ready for w in self._workers) and now - started > self.startup_timeout_s:
                raise self._startup_failure(f"none reported ready in {self.startup_timeout_s}s")

    def _fail(self, i: int, info: dict[str, Any], counter: str, indices: str,
              error: str | None = None) -> None:
        info[counter] += 1
        info[indices].append(i)
        if error is not None and "first_error" not in info:
            # The last line names the exception; the whole traceback goes with it.
            lines = error.strip().splitlines()
            info["first_error"] = lines[-1][:500] if lines else error[:500]
            info["first_error_index"], info["first_traceback"] = i, error

    def _replace(self, k: int, info: dict[str, Any]) -> None:
        # A stuck worker cannot be interrupted cooperatively; kill it and start a fresh one.
        self._workers[k].kill()
        self._workers[k] = self._spawn()
        info["restarts"] += 1


def _normalize_item(item: Item) -> tuple[str, str, str, dict | None]:
    if not 2 <= len(item) <= 4:
        raise ValueError(
            f"a reward item is (completion, ground_truth[, prompt[, meta]]), got {item!r:.200}"
        )
    completion, truth = item[0], item[1]
    prompt = item[2] if len(item) > 2 else ""
    meta = item[3] if len(item) > 3 else None
    return str(completion), str(truth), str(prompt), meta
