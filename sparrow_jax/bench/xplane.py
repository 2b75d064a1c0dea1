"""Where a compiled program spends its time, by phase: one run under the JAX profiler, its ops'
exclusive times attributed to the `jax.named_scope` names in their HLO metadata.

Used by `sparrow bench rollout --workload exact` for the exact-sparse round's breakdown (draft /
verify / accept: rollout/exact.py names those scopes). The trace (an XSpace protobuf) is read
with a minimal wire-format reader here, so no profiler plugin is needed. A phase's time is the
wall-clock union of its ops' intervals over the runtime's worker threads (an op partitioned
over two threads counts once, not twice: summing thread times overstated the draft, whose
sparse-selection ops run on two threads, 66 vs 39 ms a round at 8K), and the result is
a *share* per phase, to be scaled by a wall-clock time (the gaps between ops are not in it).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from typing import Callable, Iterable, Iterator, Sequence

import jax


def _varint(b: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        c = b[i]
        i += 1
        out |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return out, i


def _fields(b: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as int, the rest as bytes."""
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(b, i)
        elif wire == 2:
            size, i = _varint(b, i)
            val, i = b[i:i + size], i + size
        elif wire == 1:
            val, i = b[i:i + 8], i + 8
        elif wire == 5:
            val, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield num, val


def _events(space: bytes) -> Iterator[tuple[str, list[tuple[int, int, str]]]]:
    """Per XLine of every XPlane: (line name, [(offset_ps, duration_ps, event name)])."""
    for num, plane in _fields(space):
        if num != 1:                                     # XSpace.planes
            continue
        names: dict[int, str] = {}
        lines = []
        for f, v in _fields(plane):
            if f == 3:                                   # XPlane.lines
                lines.append(v)
            elif f == 4:                                 # XPlane.event_metadata map entry
                key, meta = 0, b""
                for g, x in _fields(v):
                    key, meta = (x, meta) if g == 1 else (key, x if g == 2 else meta)
                for g, x in _fields(meta):
                    if g == 2:                           # XEventMetadata.name
                        names[key] = x.decode(errors="replace")
        for line in lines:
            lname, evs = "", []
            for f, v in _fields(line):
                if f == 2:
                    lname = v.decode(errors="replace")
                elif f == 4:                             # XLine.events
                    mid = off = dur = 0
                    for g, x in _fields(v):
                        if g == 1:
                            mid = x
                        elif g == 2:
                            off = x
                        elif g == 3:
                            dur = x
                    evs.append((off, dur, names.get(mid, "")))
            yield lname, evs


def _union(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by [start, end) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a >= end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def scope_times(lines: Iterable[tuple[str, list[tuple[int, int, str]]]],
                op_names: dict[str, str], scopes: Sequence[str]) -> dict[str, int]:
    """Per scope (the first of `scopes` in an op's op_name; "other" for the rest), the
    wall-clock union of its ops' intervals over every line (thread) of the trace.
    lines: (line name, [(offset, duration, event name)]) as `_events` yields."""
    spans: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for _, evs in lines:
        # Ops of this program only (their own sub-events, e.g. a library call's, are not).
        ops = sorted((e for e in evs if e[2] in op_names), key=lambda e: (e[0], -e[1]))
        for i, (off, dur, name) in enumerate(ops):
            # An op enclosing the next op (a loop, a call) is its children's time: skipped.
            if i + 1 < len(ops) and ops[i + 1][0] < off + dur:
                continue
            op = op_names[name]
            spans[next((s for s in scopes if s in op), "other")].append((off, off + dur))
    return {s: _union(spans.get(s, [])) for s in (*scopes, "other")}


def phase_shares(space: bytes, hlo_text: str, scopes: Sequence[str]) -> dict[str, float]:
    """Share of the program's op time in each scope (`scope_times`) from an XSpace trace and
    the compiled HLO text."""
    op_names = {m.group(1): m.group(2) for m in re.finditer(
        r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text, re.M)}
    totals = scope_times(_events(space), op_names, scopes)
    whole = sum(totals.values())
    if not whole:
        raise RuntimeError("the profiler trace holds no op of the program (a backend that does "
                           "not trace its ops?)")
    return {s: totals.get(s, 0) / whole for s in (*scopes, "other")}


def profile(call: Callable[[], object], hlo_text: str, scopes: Sequence[str]
            ) -> dict[str, float]:
    """Runs `call()` once under the JAX profiler; returns `phase_shares` of its ops."""
    with tempfile.TemporaryDirectory(prefix="sparrow-xplane-") as d:
        jax.profiler.start_trace(d)
        try:
            jax.block_until_ready(call())
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"the JAX profiler wrote no .xplane.pb under {d}")
        with open(files[0], "rb") as f:
            space = f.read()
    return phase_shares(space, hlo_text, scopes)
