"""The paged scheduler's slot and page bookkeeping (`rollout/scheduler.py` runs the programs).

Which samples run in which pool, the queue of work waiting for a slot, and each running sample's
pages, with the scheduler's steps 1 and 2:
  grow: every running sample gets the pages its next `chunk_steps` tokens need; when a pool runs
        out, the most recently admitted running sample of that pool is preempted (its pages
        released, it goes back to the front of the queue with its recorded tokens kept);
  admit: queued work takes free slots while its pages fit, first come first served: a new
        prompt's whole GRPO group at once (its full prompt pages shared by all n samples), or a
        preempted sample (its prompt + generated tokens recomputed).
Plain host code, no device work. Every process of a multi-process rollout runs it on the same
inputs: keep every decision integer and order-stable (no set/dict iteration order, no float ties).
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.rollout.page_pool import PagePool, PoolExhausted, PoolLayout, pages_for
from sparrow_jax.rollout.schedule_state import PagedStats, Records, Sample

log = logging.getLogger(__name__)


class Admission:
    """One rollout's samples, queue, pools and running lists; `_Rollout` (scheduler.py) adds the
    compiled programs on top.

    prompt_lengths: [prompts] tokens of each prompt; samples are numbered prompt-major (sample i
    is prompt i // group_size). rec: the samples' recorded tokens; stats: where preemptions, the
    peak page use and shared prompt pages are counted."""

    def __init__(self, prompt_lengths: np.ndarray, *, cfg: RolloutConfig, group_size: int,
                 layout: PoolLayout, rec: Records, stats: PagedStats):
        self.cfg, self.n, self.prompt_lengths, self.rec, self.stats = (cfg, group_size,
                                                                       prompt_lengths, rec, stats)
        self.bs, self.t = cfg.block_size, cfg.max_new_tokens
        self.pools, self.pages_per_pool = layout.pools, layout.pages_per_pool
        self.slots_per_pool, self.max_pages = layout.slots_per_pool, layout.max_pages
        self.alloc = [PagePool(self.pages_per_pool) for _ in range(self.pools)]
        prompts = len(prompt_lengths)
        self.samples = [Sample(i, i // group_size) for i in range(prompts * group_size)]
        self.queue = collections.deque(("group", g) for g in range(prompts))
        self.running: list[list[Sample]] = [[] for _ in range(self.pools)]
        self.admitted = 0
        self.stop_ids = set(cfg.stop_token_ids)

    # -- bookkeeping ------------------------------------------------------------------------
    def _length(self, s: Sample) -> int:
        """Tokens in the cache while running: prompt + all generated but the last (fed next)."""
        return int(self.prompt_lengths[s.prompt]) + s.generated - 1

    def _pages_wanted(self, s: Sample) -> int:
        return self._pages_at(self._length(s))

    def _pages_at(self, cache_length: int) -> int:
        """Pages a sample with `cache_length` tokens cached needs for its next chunk."""
        return min(pages_for(cache_length + self.cfg.chunk_steps, self.bs), self.max_pages)

    def _record(self, s: Sample, toks, *rest) -> bool:
        """Appends recorded tokens (and their `Records.put` fields) to sample s; True if it
        finished."""
        c = len(toks)
        self.rec.put(s.index, s.generated, toks, *rest)
        s.generated += c
        return s.generated >= self.t or (c > 0 and int(toks[-1]) in self.stop_ids)

    def _finish(self, s: Sample) -> None:
        self.alloc[s.pool].release(s.pages)
        s.pages = []

    def _preempt(self, s: Sample) -> None:
        self.running[s.pool].remove(s)
        self._finish(s)
        self.stats.preemptions += 1
        self.queue.appendleft(("resume", s.index))
        log.info("paged rollout: preempted sample %d at %d tokens (pool %d full)", s.index,
                 s.generated, s.pool)

    def _note_peak(self) -> None:
        used = sum(a.used_pages for a in self.alloc)
        self.stats.peak_pages = max(self.stats.peak_pages, used)

    # -- 1. grow ------------------------------------------------------------------------------
    def grow(self) -> None:
        for pool, running in enumerate(self.running):
            for s in sorted(running, key=lambda x: x.order):
                if s not in running:
                    continue                                  # preempted below
                while len(s.pages) < self._pages_wanted(s):
                    try:
                        s.pages += self.alloc[pool].alloc(self._pages_wanted(s) - len(s.pages))
                    except PoolExhausted:
                        victim = max(running, key=lambda x: x.order)
                        self._preempt(victim)
                        if victim is s:
                            break

    def _grow_ahead(self, samples: list[Sample]) -> bool:
        """Pages for a chunk after the one in flight (each sample `chunk_steps` tokens further
        than recorded), if every pool has them free: no preemption while a chunk runs."""
        ahead = self.cfg.chunk_steps
        need = [self._pages_at(self._length(s) + ahead) - len(s.pages) for s in samples]
        for pool, alloc in enumerate(self.alloc):
            if sum(n for n, s in zip(need, samples) if s.pool == pool and n > 0) > \
                    alloc.free_pages:
                return False
        for n, s in zip(need, samples):
            if n > 0:
                s.pages += self.alloc[s.pool].alloc(n)
        self._note_peak()
        return True

    # -- 2. admit -----------------------------------------------------------------------------
    def admit(self) -> list[tuple]:
        """Takes queued work while slots and pages allow; returns prefill units
        (kind, samples, pool, cache length)."""
        units, resumed = [], set()
        grow = pages_for(self.cfg.chunk_steps, self.bs)
        while self.queue:
            kind, i = self.queue[0]
            group = ([self.samples[i * self.n + j] for j in range(self.n)] if kind == "group"
                     else [self.samples[i]])
            length = (int(self.prompt_lengths[i]) if kind == "group"
                      else self._length(group[0]))
            shared = length // self.bs if kind == "group" else 0
            private = [self._pages_at(length) - shared for _ in group]
            need = shared + sum(private)
            # Free pages beyond what the pool's running samples take at the next chunks (a
            # watermark: admitting into them would only get the newcomers preempted), in pools
            # with free slots; at most one resume per pool and prefill call (a resume's prefill
            # is a whole sample long: the dryrun compiles exactly that).
            free = [(a.free_pages - grow * len(self.running[p]), p)
                    for p, a in enumerate(self.alloc)
                    if self.slots_per_pool - len(self.running[p]) >= len(group)
                    and not (kind == "resume" and p in resumed)]
            if not free or max(free)[0] < need:
                break
            pool = max(free)[1]
            if kind == "resume":
                resumed.add(pool)
            self.queue.popleft()
            shared_pages = self.alloc[pool].alloc(shared)
            for s, n_priv in zip(group, private):
                if kind == "group":
                    self.alloc[pool].share(shared_pages)
                s.pages = shared_pages + self.alloc[pool].alloc(n_priv)
                s.pool, s.order = pool, self.admitted
                self.admitted += 1
                self.running[pool].append(s)
            if kind == "group" and shared:
                self.alloc[pool].release(shared_pages)    # the samples hold them now
                self.stats.shared_prompt_pages += shared * (len(group) - 1)
            units.append((kind, group, pool, length))
        self._note_peak()
        return units
