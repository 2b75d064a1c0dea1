"""Ctrl-C and SIGTERM while a command starts: one line, the exit status a shell expects
(130 for Ctrl-C, 128 + the signal otherwise), nothing half-written.

Before `sparrow train`'s loop there is nothing to save, and the start-up is imports, checks,
loading and compiling: a KeyboardInterrupt raised there could unwind through a C++ call of XLA
(an abort, status 134) or be swallowed by a library's `except BaseException` (issue 58: a
Ctrl-C 2.5 s into a start-up with reward workers was lost and the run trained to the end). So
`install` puts a handler on the signals from the command's first line that writes the
command's line and leaves at once (`os._exit`), after the `at_exit` callbacks (a run lock's
release). A record being written (`critical`) is finished first. The train loop replaces the
handler with its own (save at the step boundary: `runtime.checkpoint`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

__all__ = ["install", "restore", "critical", "at_exit", "exit_status", "signal_label",
           "TRAIN_STARTUP_MESSAGE"]

_message = "interrupted ({signal})"
_cleanups: list[Callable[[], None]] = []
_depth = 0                  # open `critical` blocks
_pending: int | None = None  # a signal that came inside one


def exit_status(signum: int) -> int:
    """How a shell reports a process the signal ended: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + signum


def signal_label(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _leave(signum: int) -> None:
    for fn in reversed(_cleanups):
        try:
            fn()
        except Exception:  # noqa: BLE001 - leaving regardless; the line below counts
            pass
    sys.stderr.write("\n" + _message.format(signal=signal_label(signum)) + "\n")
    sys.stderr.flush()
    os._exit(exit_status(signum))


def _on_signal(signum: int, frame: Any) -> None:
    global _pending
    del frame
    if _depth:
        _pending = signum
        return
    _leave(signum)


def install(message: str, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
            ) -> dict[int, Any]:
    """From now on `signals` end the process with `message` (its `{signal}` becomes "Ctrl-C" or
    the signal's name) and their exit status. Returns the previous handlers (for `restore`);
    nothing outside the main thread (signal handlers live there)."""
    global _message
    if threading.current_thread() is not threading.main_thread():
        return {}
    _message = message
    return {sig: signal.signal(sig, _on_signal) for sig in signals}


def restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A block a start-up signal does not cut: the exit waits for its end."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signum, _pending = (_pending, None) if not _depth else (None, _pending)
        if signum is not None:
            _leave(signum)


def at_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Runs `fn` before a start-up signal's exit; returns the undo."""
    _cleanups.append(fn)

    def undo() -> None:
        if fn in _cleanups:
            _cleanups.remove(fn)
    return undo


# `sparrow train`'s line for a signal before its loop (cli.py installs it from the command's
# first line, train.command again around `train()`).
TRAIN_STARTUP_MESSAGE = ("sparrow train: interrupted ({signal}) during start-up, before the "
                         "first step: nothing was trained or saved; the run's checkpoints are "
                         "as they were")
