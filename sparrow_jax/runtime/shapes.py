"""Static shapes: length buckets and a log of every program shape a run compiles.

XLA compiles one program per distinct input shape. An RL batch's prompt widths and response
lengths change every step, so without rounding every new width would recompile prefill, decode,
the learner's analysis and its gradient program (minutes each at real scale). Lengths are rounded
up to a small ladder of buckets; `CompileLog` records each (program, shapes) pair the first time a
run uses it and logs it, so a user sees exactly what compiled and why.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

log = logging.getLogger(__name__)


def default_buckets(cap: int, *, multiple: int = 16, smallest: int = 64) -> tuple[int, ...]:
    """Two buckets per octave (64, 96, 128, 192, 256, ...; multiples of `multiple`) up to and
    including `cap` (rounded up to `multiple`): padding wastes at most 1.5x, and a run touches at
    most ~2 log2(cap / smallest) shapes."""
    cap = -(-cap // multiple) * multiple
    out, b = [], max(smallest, multiple)
    while b < cap:
        out.append(-(-b // multiple) * multiple)
        half = b + b // 2
        if half < cap:
            out.append(-(-half // multiple) * multiple)
        b *= 2
    out.append(cap)
    return tuple(sorted(set(out)))


def bucket_length(n: int, buckets: Sequence[int], *, multiple: int = 16) -> int:
    """The smallest bucket >= n; beyond the largest bucket, n rounded up to `multiple` (a shape of
    its own, logged by the caller's CompileLog)."""
    if n < 0:
        raise ValueError(f"length must be >= 0, got {n}")
    for b in sorted(buckets):
        if b >= n:
            return int(b)
    return -(-n // multiple) * multiple


class CompileLog:
    """Which (program, shapes) pairs this process has compiled; logs each new one once.

    `note` returns True for a new pair. Programs are named by what they are ("rollout/prefill",
    "learner/grads", ...), shapes by the dimensions that select the program.
    """

    def __init__(self) -> None:
        self._seen: dict[str, set[tuple]] = {}
        self._lock = threading.Lock()

    def note(self, program: str, **shapes: object) -> bool:
        key = tuple(sorted(shapes.items()))
        with self._lock:
            seen = self._seen.setdefault(program, set())
            if key in seen:
                return False
            seen.add(key)
            n = len(seen)
        desc = ", ".join(f"{k}={v}" for k, v in key)
        log.info("compile %s #%d: %s", program, n, desc)
        return True

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {k: len(v) for k, v in self._seen.items()}

    def shapes(self, program: str) -> list[dict[str, object]]:
        with self._lock:
            return [dict(k) for k in sorted(self._seen.get(program, ()))]


# The process-wide log the rollout engine and the learner report to.
COMPILES = CompileLog()
