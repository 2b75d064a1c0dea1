"""The paged scheduler's host records (`rollout/scheduler.py`): a sample, a dispatched decode
chunk, what a rollout did (`PagedStats`), and the shape buckets that bound its compiles."""

from __future__ import annotations

import dataclasses

from sparrow_jax.rollout import paged
from sparrow_jax.rollout.config import RolloutConfig


def pow2_bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most cap (slot and prefill-row counts)."""
    return min(cap, 1 << max(0, int(n) - 1).bit_length())


def page_bucket(n: int, cap: int) -> int:
    """Pages per slot, two buckets per octave from 4 (the decode cost follows the live length
    within 1.5x; a rollout touches ~2 log2(cap / 4) widths), at most cap."""
    b = 4
    while b < n:
        b = b + b // 2 if (b & (b - 1)) == 0 else 1 << b.bit_length()
    return min(b, cap)


def prefill_width(cfg: RolloutConfig, length: int) -> int:
    """Static width of a prefill of sequences up to `length` tokens: a prompt bucket, or for a
    resumed sample's long prompt + generated tokens a multiple of the prefill chunk, whichever is
    narrower (a 34.8K-token resume is prefilled at 36864 = 18 scanned chunks, not the 49152
    bucket)."""
    chunked = -(-length // cfg.prefill_chunk) * cfg.prefill_chunk
    return min(cfg.prompt_width(length), chunked)


@dataclasses.dataclass
class Sample:
    index: int                   # row of the result (prompt index * group size + j)
    prompt: int
    generated: int = 0           # tokens recorded
    pages: list = dataclasses.field(default_factory=list)   # logical block -> physical page
    pool: int = -1
    order: int = 0               # admission counter (the newest is preempted first)


@dataclasses.dataclass
class Chunk:
    """A dispatched decode chunk whose records are not read yet."""
    order: list                  # (row, sample) of its active rows
    slots: paged.Slots           # its output slot state (device): a continuation's input
    records: object              # Coordination.start_read of its records


@dataclasses.dataclass
class PagedStats:
    """What the last paged rollout did (`LAST_STATS`; logged, read by benchmarks and tests)."""
    pages_per_pool: int = 0
    pools: int = 1
    page_bytes: int = 0
    peak_pages: int = 0          # most pages held at once, summed over pools
    preemptions: int = 0
    chunks: int = 0
    prefills: int = 0
    shared_prompt_pages: int = 0  # page references served by sharing instead of a copy
    # Several processes: seconds in replicated readbacks of program results (after they were
    # computed) and in the cross-process digest checks (rollout/paged_multihost.py).
    sync_seconds: float = 0.0
    guard_seconds: float = 0.0
    # Host seconds with no program in flight (the device idle, waiting for the host's
    # bookkeeping: between a blocking readback and the next dispatch), and the decode chunks
    # dispatched as continuations while their predecessor ran (`overlap_chunks`).
    host_seconds: float = 0.0
    overlapped_chunks: int = 0

    @property
    def host_ms_per_chunk(self) -> float:
        return 1e3 * self.host_seconds / max(self.chunks, 1)

    @property
    def peak_bytes(self) -> int:
        return self.peak_pages * self.page_bytes
