"""The paged scheduler's host records (`rollout/continuous.py`): a sample, its recorded tokens
(`Records`), a dispatched decode chunk, what a rollout did (`PagedStats`), and the shape buckets
that bound its compiles."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from sparrow_jax.rollout import paged
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.sparsity.schedule import DENSE_BUDGET


def ladder_bucket(n: int, cap: int, factor: int, floor: int = 1) -> int:
    """The smallest floor * factor**k >= n, at most cap: running-slot and prefill-row counts
    (`RolloutConfig.slot_ladder`), page-table widths (`page_bucket`). A coarser ladder compiles
    fewer programs and pads more."""
    if factor < 2 or floor < 1:
        raise ValueError(f"a bucket ladder needs factor >= 2 and floor >= 1, got factor={factor}"
                         f" floor={floor}")
    b = floor
    while b < n:
        b *= factor
    return min(b, cap)


def slot_bucket(n: int, cap: int, cfg: RolloutConfig) -> int:
    """Running slots per pool for n samples: powers of `cfg.slot_ladder` from `cfg.min_slots`,
    at most cap."""
    return ladder_bucket(n, cap, cfg.slot_ladder, cfg.min_slots)


def row_bucket(n: int, cap: int, cfg: RolloutConfig) -> int:
    """Prefill rows per pool for n prompts (or resumed samples): powers of `cfg.slot_ladder`
    from 1 - not `min_slots`: an empty prefill row computes its whole width (a resume's is a
    whole sample long)."""
    return ladder_bucket(n, cap, cfg.slot_ladder)


def page_bucket(n: int, cap: int, cfg: RolloutConfig | None = None) -> int:
    """Pages per slot: powers of `cfg.page_ladder` (default 2) from `cfg.min_table_pages`
    (default 4), at most cap. In sparse mode a wider table costs only the centroid scoring and
    the dense layers; the decode cost follows the live length within the ladder's factor."""
    if cfg is None:
        return ladder_bucket(n, cap, 2, 4)
    return ladder_bucket(n, cap, cfg.page_ladder, cfg.min_table_pages)


def program_config(cfg: RolloutConfig) -> RolloutConfig:
    """The programs' static config without the host-only settings (pool source, slot cap,
    overlap flag, shape ladders) and a re-planned gamma table: one compiled program per shape
    whatever they are."""
    mode = "sparse" if dense_rung(cfg) else cfg.mode
    # Re-planning: the per-bin gamma table is an input of the exact chunk (compiles nothing).
    return dataclasses.replace(cfg.without_traced_plan, pool_bytes=0, pool_fraction=0.0, max_slots=0,
                               overlap_chunks=True, slot_ladder=2, page_ladder=2,
                               min_table_pages=4, min_slots=1, dense_via_sparse=False,
                               mode=mode)


def dense_rung(cfg: RolloutConfig) -> bool:
    """Dense decoding in the sparse programs (`RolloutConfig.dense_via_sparse`)."""
    return cfg.dense_via_sparse and cfg.mode == RolloutMode.DENSE


def decode_budgets(cfg: RolloutConfig, budgets: np.ndarray) -> np.ndarray:
    """The budget table [num_bins] a decode chunk gets: the schedule's, or with `dense_rung`
    the dense rung in every bin (covered rows attend densely; same shape: same program)."""
    return np.full_like(budgets, DENSE_BUDGET) if dense_rung(cfg) else budgets


def recorded_budgets(cfg: RolloutConfig, budgets: np.ndarray) -> np.ndarray:
    """A rollout's recorded budgets [B, T]: dense decoding records none (0), as dense mode."""
    return np.zeros_like(budgets) if dense_rung(cfg) else budgets


def prefill_config(cfg: RolloutConfig) -> RolloutConfig:
    """The prefill program's static config: `program_config` with the decoding mode fixed (a
    prefill attends densely whatever the mode; a resume's sparse replay is its own static
    flag), so that the evaluation's dense and sparse rollouts share their prefill programs."""
    return dataclasses.replace(program_config(cfg), mode="sparse")


def prefill_width(cfg: RolloutConfig, length: int, longest: int | None = None) -> int:
    """Static width of a prefill of sequences up to `length` tokens: a prompt bucket, or for a
    resumed sample's long prompt + generated tokens the prefill chunk times a power of
    `cfg.slot_ladder` (at most `longest`, the longest sequence the rollout can hold, rounded up
    to the chunk), whichever is narrower: a handful of resume programs per run instead of one per
    chunk count (a 34.8K-token resume of a 2048-wide prompt with 32K new tokens and 2048-token
    chunks: 34816, the cap)."""
    chunk = cfg.prefill_chunk
    chunked = ladder_bucket(length, 1 << 40, cfg.slot_ladder, chunk)
    if longest is not None:
        chunked = max(min(chunked, -(-longest // chunk) * chunk), -(-length // chunk) * chunk)
    if length > max(cfg.prompt_ladder):      # past the buckets: a width per 16 tokens otherwise
        return chunked
    return min(cfg.prompt_width(length), chunked)


@dataclasses.dataclass
class Sample:
    index: int                   # row of the result (prompt index * group size + j)
    prompt: int
    generated: int = 0           # tokens recorded
    pages: list = dataclasses.field(default_factory=list)   # logical block -> physical page
    pool: int = -1
    order: int = 0               # admission counter (the newest is preempted first)


class Records:
    """Every sample's recorded tokens, [rows, T] each (the rollout's `Trajectories` fields):
    exact_sparse mode adds per token whether it was an accepted draft and its alpha (the first
    token, from the prefill, neither: False and NaN)."""

    def __init__(self, rows: int, t: int, topk: int, pad_token_id: int, exact: bool):
        self.tokens = np.full((rows, t), pad_token_id, np.int32)
        self.logprobs = np.zeros((rows, t), np.float32)
        self.budgets = np.zeros((rows, t), np.int32)
        self.topk_v = np.zeros((rows, t, topk), np.float32)
        self.topk_i = np.zeros((rows, t, topk), np.int32)
        self.accepted = np.zeros((rows, t), bool) if exact else None
        self.alpha = np.full((rows, t), np.nan, np.float32) if exact else None

    def put(self, row: int, start: int, toks, lps, buds, top_v, top_i, accepted=None,
            alpha=None) -> None:
        """Row `row`'s tokens start .. start + len(toks) - 1."""
        end = start + len(toks)
        for buf, val in ((self.tokens, toks), (self.logprobs, lps), (self.budgets, buds),
                         (self.topk_v, top_v), (self.topk_i, top_i),
                         (self.accepted, accepted), (self.alpha, alpha)):
            if buf is not None and val is not None:
                buf[row, start:end] = val


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


def distinct(fn: Callable[[int], int], lo: int, hi: int) -> tuple[int, ...]:
    """Every value of the monotone bucket function `fn` over the lengths lo..hi (each bucket
    >= its argument: the next length past a bucket starts the next one)."""
    out, n = [], max(lo, 1)
    while n <= hi:
        b = fn(n)
        if b < n:
            raise ValueError(f"bucket {b} of length {n} is below it: not a bucket function")
        out.append(b)
        n = b + 1
    return tuple(out)
