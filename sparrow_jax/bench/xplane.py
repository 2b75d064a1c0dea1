"""Where a compiled program spends its time, by phase: one run under the JAX profiler, its ops'
exclusive times attributed to the `jax.named_scope` names in their HLO metadata.

Used by `sparrow bench rollout --workload exact` for the exact-sparse round's breakdown (draft /
verify / accept: rollout/exact.py names those scopes). The trace (an XSpace protobuf) is read
with a minimal wire-format reader here, so no profiler plugin is needed. A phase's time is the
wall-clock union of its ops' intervals over the runtime's worker threads (an op partitioned
over two threads counts once, not twice: summing thread times overstated the draft, whose
sparse-selection ops run on two threads, 66 vs 39 ms a round at 8K), and the result is
a *share* per phase, to be scaled by a wall-clock time (the gaps between ops are not in it).

    python -m sparrow_jax.bench.xplane DIR [DIR ...] [--program decode_program] [--json]

reads what `sparrow bench rollout --profile` leaves in each DIR (the profiler's trace.json.gz and
the program's optimized hlo.txt) and prints where the program's device time went: per decode-step
phase (`DECODE_SCOPES`, the `jax.named_scope`s of rollout/static.py and model/qwen3.py; a kernel
outside them is listed by name), its kernel time, launches and share, and how busy the device
was (kernel time over the program's span: the rest is launch gaps and host waits).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
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


# The decode step's named scopes (rollout/static.py, model/qwen3.py), most specific first.
DECODE_SCOPES = ("block_select", "centroid_update", "sparse_attention", "dense_attention",
                 "kv_write", "qkv_proj", "o_proj", "mlp", "lm_head", "sample")


# The Pallas Triton kernels' name prefixes and their phases (a Pallas kernel has no HLO twin to
# name it): the one-kernel block selection, the fused decode's page selection and K/V write.
PALLAS_PHASES = (("sparrow_block_select_triton", "block_select"),
                 ("sparrow_select_pages_triton", "block_select"),
                 ("sparrow_write_token_triton", "kv_write"))


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its op_name metadata, under both spellings a trace uses (XLA:GPU names
    a fusion's kernel with '_' where the instruction has '.')."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text,
                         re.M):
        out[m.group(1)] = out[m.group(1).replace(".", "_")] = m.group(2)
    return out


def program_events(trace: dict, program: str) -> tuple[list[dict], str]:
    """The complete events of jit(`program`) on the device that ran it: the GPU/TPU plane when
    the trace has one, else the host's XLA:CPU ops. Returns (events, plane name)."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    mine = [e for e in trace["traceEvents"] if e.get("ph") == "X"
            and e.get("args", {}).get("hlo_module") == f"jit_{program}"]
    device = [e for e in mine if procs.get(e["pid"], "").startswith("/device:")]
    if device:     # kernels; those of one CUDA graph may overlap on a stream row: all count
        return sorted(device, key=lambda e: e["ts"]), procs[device[0]["pid"]]
    plane = procs.get(mine[0]["pid"], "?") if mine else "none"
    # An op enclosing the next op of its thread (XLA:CPU's while / conditional around the loop
    # body's ops) is its children's time, counted once through them.
    leaves = []
    by_thread = collections.defaultdict(list)
    for e in mine:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        leaves += [e for i, e in enumerate(evs)
                   if not (i + 1 < len(evs) and evs[i + 1]["ts"] < e["ts"] + e["dur"])]
    return sorted(leaves, key=lambda e: e["ts"]), plane


def breakdown(trace: dict, hlo_text: str, program: str = "decode_program",
              scopes: Sequence[str] = DECODE_SCOPES) -> dict:
    """Per phase: kernel time (us), launches, share of the kernel time; and the program's span,
    busy time (union of its kernels' intervals) and plane. A kernel whose op_name holds none of
    `scopes` is its own row, by op_name (or kernel name: a Pallas kernel has no HLO twin)."""
    events, plane = program_events(trace, program)
    if not events:
        raise RuntimeError(f"the trace holds no op of jit({program})")
    names = hlo_op_names(hlo_text)
    time_us: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for e in events:
        op = names.get(e["name"]) or names.get(e["args"].get("hlo_op", ""), "")
        key = next((sc for sc in scopes if f"/{sc}/" in f"{op}/"), None)
        if key is None:
            key = next((phase for prefix, phase in PALLAS_PHASES
                        if e["name"].startswith(prefix)), None)
        if key is None:
            key = "other: " + (e["name"] if e["name"].startswith("sparrow_") or not op
                               else op.split("/")[-1])
        time_us[key] += e["dur"]
        count[key] += 1
    total = sum(time_us.values())
    ps = 1_000_000                                   # us -> ps, integer intervals for _union
    busy = _union([(int(e["ts"] * ps), int((e["ts"] + e["dur"]) * ps)) for e in events]) / ps
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    rows = [{"phase": k, "us": round(v, 1), "launches": count[k], "share": v / total}
            for k, v in sorted(time_us.items(), key=lambda kv: -kv[1])]
    return {"plane": plane, "program": program, "span_us": round(span, 1),
            "busy_us": round(busy, 1), "kernel_us": round(total, 1), "launches": len(events),
            "phases": rows}


def save_profile(call: Callable[[], object], folder: str, hlo_text: str) -> str:
    """Runs `call()` once under the JAX profiler, its trace in `folder` beside the program's
    optimized HLO (hlo.txt: the map from the trace's kernels to their named scopes), as
    `read_profile` reads them. Returns the folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hlo.txt"), "w") as f:
        f.write(hlo_text)
    with jax.profiler.trace(folder):
        jax.block_until_ready(call())
    return folder


def read_profile(folder: str) -> tuple[dict, str]:
    """(trace, hlo text) from a `sparrow bench rollout --profile` folder."""
    traces = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    hlo = os.path.join(folder, "hlo.txt")
    if not traces or not os.path.exists(hlo):
        raise SystemExit(f"xplane: {folder} has no *.trace.json.gz and hlo.txt (made by "
                         "`sparrow bench rollout --profile DIR`)")
    with gzip.open(sorted(traces)[-1], "rt") as f:
        trace = json.load(f)
    with open(hlo) as f:
        return trace, f.read()


def format_breakdown(name: str, b: dict, top: int = 14) -> str:
    lines = [f"== {name} ({b['plane']}): span {b['span_us'] / 1e3:.2f} ms, kernels "
             f"{b['kernel_us'] / 1e3:.2f} ms, busy {b['busy_us'] / b['span_us']:.0%}, "
             f"{b['launches']} launches"]
    for r in b["phases"][:top]:
        lines.append(f"   {r['phase'][:48]:<48} {r['us'] / 1e3:8.2f} ms {r['share']:6.1%} "
                     f"{r['launches']:6d} launches")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Where a profiled program spent its device time, "
                                             "by decode-step phase")
    ap.add_argument("folders", nargs="+", help="folders made by sparrow bench rollout --profile")
    ap.add_argument("--program", default="decode_program")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for folder in args.folders:
        b = breakdown(*read_profile(folder), program=args.program)
        if args.json:
            print(json.dumps({"folder": folder, **b}), flush=True)
        print(format_breakdown(os.path.basename(os.path.normpath(folder)), b), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
