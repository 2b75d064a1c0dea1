"""Host-side page accounting for the paged rollout engine: a free list with reference counts
per pool, and the pool size a `RolloutConfig` asks for.

A page holds one selection block (block_size tokens) of K, V and the block's key centroid for
every layer. The n samples of a GRPO group hold references to their prompt's full pages; a page
returns to the free list when its last holder releases it.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.rollout.config import RolloutMode


log = logging.getLogger(__name__)


class PoolExhausted(RuntimeError):
    """No free pages left (the scheduler preempts a running sample and retries)."""


class PagePool:
    """Physical pages 0..num_pages-1 of one pool (one data shard), reference counted."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, np.int32)
        # A stack with the lowest ids on top: pages are reused low-first (a compact working set).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages (reference count 1); raises PoolExhausted (taking nothing) if fewer
        than n are free."""
        if n > len(self._free):
            raise PoolExhausted(f"{n} pages wanted, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (a group sample taking its prompt's pages)."""
        if pages and (self._refs[pages] <= 0).any():
            raise ValueError(f"sharing pages that are not allocated: {pages}")
        np.add.at(self._refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """Drops one reference to each of `pages`; pages nobody holds become free."""
        if pages and (self._refs[pages] <= 0).any():
            raise ValueError(f"releasing pages that are not allocated: {pages}")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check_all_free(self) -> None:
        """Raises if any page is still held (a leak: every sample releases its pages)."""
        if len(self._free) == self.num_pages:
            return
        held = np.flatnonzero(self._refs).tolist()
        raise RuntimeError(f"page leak: {len(held)} of {self.num_pages} pages still held "
                           f"after the rollout (first: {held[:8]})")


def pages_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def device_memory_limit() -> int | None:
    """The first local device's memory limit in bytes (None where the backend does not say)."""
    try:
        return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # CPU backends may not implement memory_stats
        return None


def pool_pages(*, page_bytes_per_device: int, pool_bytes: int, pool_fraction: float,
               default_pages: int, memory_limit: int | None = None) -> tuple[int, str]:
    """Pages per pool (one pool per data shard) and where the size came from.

    pool_bytes > 0: that many bytes per device; pool_fraction > 0: that fraction of the
    device's memory limit (`memory_limit`, default: what the local device reports; errors where
    there is none, e.g. CPU); else default_pages (the caller's: every row's worst case, the
    static engine's memory).
    """
    if pool_bytes > 0 and pool_fraction > 0:
        raise ValueError("set RolloutConfig.pool_bytes or pool_fraction, not both")
    if pool_bytes > 0:
        return pool_bytes // page_bytes_per_device, f"pool_bytes={pool_bytes}"
    if pool_fraction > 0:
        limit = memory_limit or device_memory_limit()
        if limit is None:
            raise ValueError("RolloutConfig.pool_fraction needs a device that reports its memory "
                             "limit (CPU does not); set pool_bytes instead")
        return int(pool_fraction * limit) // page_bytes_per_device, \
            f"pool_fraction={pool_fraction} of {limit / 2**30:.1f} GiB"
    return default_pages, "default (every row at full length)"


def page_bytes(cfg: Qwen3Config, dtype, block_size: int) -> int:
    """Bytes of one page over all layers: K, V and the centroid, all KV heads."""
    per_layer = cfg.num_key_value_heads * cfg.head_dim * (2 * block_size + 1)
    return int(cfg.num_hidden_layers * per_layer * jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Where a paged rollout's KV lives: one pool per data shard, each serving its shard's slots."""
    pools: int                   # = data shards
    pages_per_pool: int
    slots_per_pool: int
    max_pages: int               # pages one sample can ever hold (prompt + new tokens)
    page_bytes: int              # all KV heads
    page_bytes_per_device: int   # the heads one device holds
    source: str                  # where the size came from

    @property
    def bytes_per_device(self) -> int:
        return self.pages_per_pool * self.page_bytes_per_device


def pool_layout(mcfg: Qwen3Config, cfg, dtype, *, rows: int, prompt_width: int, group_size: int,
                data: int = 1, model: int = 1, memory_limit: int | None = None) -> PoolLayout:
    """The pool a `RolloutConfig` (cfg) asks for, for `rows` samples of prompts `prompt_width`
    wide on a (data, model) mesh; validated: the pool must hold one whole sample and one
    group's prompt, and the slots a whole group per shard (else the rollout could not finish)."""
    bs = cfg.block_size
    slots = cfg.max_slots or rows
    if slots % data or slots // data < group_size:
        what = (f"RolloutConfig.max_slots={slots}" if cfg.max_slots else
                f"the rollout's {rows} samples (RolloutConfig.max_slots=0: one slot each)")
        raise ValueError(f"{what} must be a multiple of the data axis ({data}) with at least "
                         f"group_size={group_size} slots per data shard: set max_slots to a "
                         f"multiple of {data} that is >= {data * group_size}")
    # The last sampled token is never fed, so never written; exact_sparse's last round writes
    # up to gamma positions past the last fed token (drafts it may not keep).
    extra = cfg.gamma if cfg.mode == RolloutMode.EXACT_SPARSE else 0
    max_pages = pages_for(prompt_width + cfg.max_new_tokens - 1 + extra, bs)
    heads_split = model if mcfg.num_key_value_heads % model == 0 else 1
    full = page_bytes(mcfg, dtype, bs)
    need = max(max_pages, pages_for(prompt_width, bs)
               + group_size * pages_for(cfg.chunk_steps + bs, bs))
    # The default (every row at full length) is at least `need`: with one row per shard and a
    # chunk longer than the row's growth, full length alone is below the admission watermark.
    pages, source = pool_pages(
        page_bytes_per_device=full // heads_split, pool_bytes=cfg.pool_bytes,
        pool_fraction=cfg.pool_fraction, default_pages=max(-(-rows // data) * max_pages, need),
        memory_limit=memory_limit)
    if pages < need:
        raise ValueError(
            f"the page pool ({pages} pages of {bs} tokens per data shard, from {source}) cannot "
            f"hold one sample of {prompt_width} prompt + {cfg.max_new_tokens} new tokens or one "
            f"group's prompt ({need} pages); raise RolloutConfig.pool_bytes or pool_fraction")
    layout = PoolLayout(data, pages, slots // data, max_pages, full, full // heads_split, source)
    limit = memory_limit or device_memory_limit()
    if limit is not None and layout.bytes_per_device > 0.9 * limit:
        raise MemoryError(f"the page pool needs {layout.bytes_per_device / 2**30:.2f} GiB per "
                          f"device ({source}) but the device has {limit / 2**30:.2f} GiB; set "
                          "a smaller RolloutConfig.pool_bytes or pool_fraction")
    return layout
