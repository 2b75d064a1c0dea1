"""Continuous batching on the host around the paged engine's compiled programs.

Loop, until every sample has finished:
  1. grow: every running sample gets the pages its next `chunk_steps` tokens need; when a pool
     runs out, the most recently admitted running sample of that pool is preempted (its pages
     released, it goes back to the front of the queue with its recorded tokens kept);
  2. admit: queued work takes free slots while its pages fit, first come first served: a new
     prompt's whole GRPO group at once (one prefill row whose full prompt pages all n samples
     share; each sample gets its own copy of the partly filled last page), or a preempted
     sample (its prompt + generated tokens recomputed, its recorded tokens and log-probs kept);
  3. one compiled decode chunk over the running samples (slots compacted and bucketed);
  4. harvest: finished samples' pages go back to their pool.
Overlap (`RolloutConfig.overlap_chunks`): while chunk i runs, the host
dispatches chunk i+1 as its continuation (the same slots, chunk i's output slot state fed back
on the device, pages grown for a full chunk i) and only then reads back and records chunk i, so
the device never waits for the host's bookkeeping. Where the next chunk needs chunk i's tokens
(samples finished and work is queued: refill; the running samples fit a smaller slot bucket:
compaction; a pool cannot grow without preempting) the host waits for chunk i+1 and decides as
above. Rows finished in chunk i idle through chunk i+1 (inactive: no writes, nothing recorded).
exact_sparse mode runs paged_exact.py's decode chunk (rounds of sparse drafts verified densely)
and recomputes a preempted sample by a plain dense prefill (its cache holds dense K/V).
Sampling keys are per (sample, token index), so a sample's tokens do not depend on which slot
it ran in, what ran beside it, or whether it was preempted (greedy results are bit-identical).
Several processes: every process runs this same scheduler over the global prompts and global
programs, reading chunk results back replicated (rollout/paged_multihost.py); keep every
decision integer and order-stable (no set/dict iteration order, no float ties).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import paged, paged_exact, paged_multihost
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.page_pool import PagePool, PoolExhausted, pages_for, pool_layout
from sparrow_jax.rollout.continuous_state import (Chunk, PagedStats, Records, Sample,
                                                decode_budgets, page_bucket, prefill_config,
                                                prefill_width, program_config, recorded_budgets,
                                                row_bucket, slot_bucket)
from sparrow_jax.rollout.state import Trajectories, check_budgets, prepare_prompts
from sparrow_jax.runtime import multihost
from sparrow_jax.runtime.shapes import COMPILES
from sparrow_jax.runtime.sharding import ShardingSpec

log = logging.getLogger(__name__)


LAST_STATS = PagedStats()


class PagedRollout:
    """One rollout's host state - samples, queue, pools, records - with its slot and page
    bookkeeping (grow, admit, preempt; plain host code) and the compiled programs it runs over
    them (prefill, decode, harvest)."""

    def __init__(self, model, prompt_tokens, prompt_lengths, *, cfg: RolloutConfig,
                 group_size: int, rng, spec: ShardingSpec | None, first_sample: int = 0):
        mcfg = model.config
        self.model, self.cfg, self.spec, self.n = model, cfg, spec, group_size
        self.prompts, self.prompt_lengths = prompt_tokens, prompt_lengths
        bp, self.width = prompt_tokens.shape
        self.rows = bp * group_size
        self.bs, self.t = cfg.block_size, cfg.max_new_tokens
        data = model_size = 1
        if spec is not None:        # one pool per shard of the axis rows are sharded over
            data_axis, heads_axis = paged.mesh_axes(spec, mcfg.num_key_value_heads)
            data = spec.mesh.shape[data_axis] if data_axis else 1
            model_size = spec.mesh.shape[heads_axis] if heads_axis else 1
        layout = pool_layout(mcfg, cfg, model.dtype, rows=self.rows, prompt_width=self.width,
                             group_size=group_size, data=data, model=model_size)
        self.layout = layout
        self.pools, self.pages_per_pool = layout.pools, layout.pages_per_pool
        self.slots_per_pool, self.max_pages = layout.slots_per_pool, layout.max_pages
        self.alloc = [PagePool(self.pages_per_pool) for _ in range(self.pools)]
        self.kv = paged.init_pages(mcfg, self.pools, self.pages_per_pool, self.bs, model.dtype,
                                   spec)
        log.info("paged rollout: %d pool(s) x %d pages (%s, %.2f GiB per device), %d slots, "
                 "chunks of %d steps", self.pools, self.pages_per_pool, layout.source,
                 layout.bytes_per_device / 2**30, layout.slots_per_pool * self.pools,
                 cfg.chunk_steps)
        self.stats = PagedStats(pages_per_pool=self.pages_per_pool, pools=self.pools,
                                page_bytes=layout.page_bytes)
        self.graphdef, self.params = nnx.split(model)
        self.program_cfg, self.prefill_cfg = program_config(cfg), prefill_config(cfg)
        self.rng = jax.random.key(0) if rng is None else rng
        self.rec = Records(self.rows, self.t, cfg.record_topk, cfg.pad_token_id,
                           exact=cfg.mode == RolloutMode.EXACT_SPARSE)
        self.samples = [Sample(i, i // group_size) for i in range(self.rows)]
        self.first_sample = first_sample
        self.queue = collections.deque(("group", g) for g in range(bp))
        self.running: list[list[Sample]] = [[] for _ in range(self.pools)]
        self.admitted = 0
        self.stop_ids = set(cfg.stop_token_ids)
        self.sync = paged_multihost.Coordination(spec)
        self.dispatched = 0          # decode chunks dispatched (the digest check's chunk number)
        self.idle_since: float | None = None   # nothing in flight since (perf_counter)
        # Re-planning exact_sparse: the rounds each round branch ran, over the chunks read.
        self.round_counts = (np.zeros(len(cfg.round_branches), np.int32) if cfg.replans
                             else None)

    # -- bookkeeping ------------------------------------------------------------------------
    def _length(self, s: Sample) -> int:
        """Tokens in the cache while running: prompt + all generated but the last (fed next)."""
        return int(self.prompt_lengths[s.prompt]) + s.generated - 1

    def _pages_wanted(self, s: Sample) -> int:
        return self._pages_at(self._length(s))

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

    def _pages_at(self, cache_length: int) -> int:
        """Pages a sample with `cache_length` tokens cached needs for its next chunk."""
        return min(pages_for(cache_length + self.cfg.chunk_steps, self.bs), self.max_pages)

    def prefill(self, units: list[tuple]) -> None:
        """Prefill programs over the admitted units: new groups together (prompt width), resumed
        samples together (their prompt + generated tokens); rows per pool bucketed."""
        for kind in ("group", "resume"):
            batch = [u for u in units if u[0] == kind]
            if batch:
                self._prefill(batch)

    def _prefill(self, units: list[tuple]) -> None:
        cfg, bs = self.cfg, self.bs
        n = self.n if units[0][0] == "group" else 1       # samples per prefill row
        width = prefill_width(cfg, max(u[3] for u in units), self.width + self.t - 1)
        per_pool = row_bucket(max(sum(u[2] == p for u in units) for p in range(self.pools)),
                               self.slots_per_pool, cfg)
        rows = per_pool * self.pools
        tokens = np.full((rows, width), cfg.pad_token_id, np.int32)
        lengths = np.ones((rows,), np.int32)
        prompt_lengths = np.ones((rows,), np.int32)
        write = np.full((rows, n, width // bs), self.pages_per_pool, np.int32)
        sample_ids = np.zeros((rows, n), np.int32)
        index = np.zeros((rows, n), np.int32)
        where = []
        taken = [0] * self.pools
        for kind, group, pool, length in units:
            r = pool * per_pool + taken[pool]
            taken[pool] += 1
            where.append(r)
            s0 = group[0]
            plen = int(self.prompt_lengths[s0.prompt])
            seq = self.prompts[s0.prompt, :plen]
            if kind == "resume" and s0.generated > 1:
                seq = np.concatenate([seq, self.rec.tokens[s0.index, :s0.generated - 1]])
            tokens[r, :length] = seq
            lengths[r], prompt_lengths[r] = length, plen
            used = pages_for(length, bs)
            for j, s in enumerate(group):
                write[r, j, :used] = s.pages[:used]
                sample_ids[r, j] = self.first_sample + s.index
                index[r, j] = s.generated
        # A resumed sample's generated tokens replay their sparse attention (sparse mode).
        replay = cfg.mode == RolloutMode.SPARSE and units[0][0] == "resume"
        COMPILES.note("rollout/paged_prefill", rows=rows, width=width, group_size=n,
                      pages=self.pages_per_pool, replay=replay,
                      dtype=jnp.dtype(self.model.dtype).name)
        args = [self._rows(x) for x in (tokens, lengths, write, sample_ids, index,
                                        prompt_lengths)]
        self.sync.check("prefill", self.dispatched)
        self._note_dispatch()
        out = paged.prefill_program(self.graphdef, self.params, self.kv, *args[:5], self.rng,
                                    args[5], self.budget_table,
                                    cfg=self.prefill_cfg, spec=self.spec,
                                    bin_size=self.bin_size, replay=replay)
        self.kv = out[0]
        tok, lp, top_v, top_i = self.sync.read_back(out[1:])
        self.idle_since = time.perf_counter()
        self.stats.prefills += 1
        for r, (kind, group, pool, length) in zip(where, units):
            if kind == "resume":
                continue         # its next token is already recorded: decode feeds it
            for j, s in enumerate(group):
                if self._record(s, tok[r, j:j + 1], lp[r, j:j + 1], np.zeros(1, np.int32),
                                top_v[r, j:j + 1], top_i[r, j:j + 1]):
                    self.running[pool].remove(s)
                    self._finish(s)

    def _rows(self, x: np.ndarray) -> jax.Array:
        """Host rows (laid out by pool) to the device: over the data axis when sharded (and
        into the cross-process digest of the next program's inputs)."""
        self.sync.add(x)
        return jnp.asarray(x) if self.spec is None else _place(x, self.spec)

    # -- 3. decode ----------------------------------------------------------------------------
    def _note_dispatch(self) -> None:
        """Counts the host time since the device last had nothing to do (stats.host_seconds)."""
        if self.idle_since is not None:
            self.stats.host_seconds += time.perf_counter() - self.idle_since
            self.idle_since = None

    def _table(self, order: list[tuple[int, Sample]], total: int) -> np.ndarray:
        """[total, width] page tables of the rows' samples (finished ones and empty rows: N)."""
        live = [s for _, s in order if s.pages]
        width = page_bucket(max(len(s.pages) for s in live), self.max_pages, self.cfg)
        table = np.full((total, width), self.pages_per_pool, np.int32)
        for row, s in order:
            table[row, :len(s.pages)] = s.pages
        return table

    def decode(self, budgets, pending: Chunk | None = None) -> Chunk | None:
        """Dispatches a decode chunk and starts reading its records back (not waiting for it).
        Without `pending`: over the running samples (slots compacted and bucketed). With it (a
        chunk still running): its continuation over the same slots, fed pending's output slot
        state on the device - or None where the next chunk needs pending's results first
        (samples finished and work is queued, a smaller slot bucket, a pool short of pages)."""
        cfg = self.cfg
        if pending is None:
            per_pool = slot_bucket(max(len(r) for r in self.running), self.slots_per_pool, cfg)
            total = per_pool * self.pools
            host = [np.zeros(total, t) for t in (np.int32, np.int32, np.int32, bool, np.int32)]
            order: list[tuple[int, Sample]] = []
            for pool, running in enumerate(self.running):
                for k, s in enumerate(running):
                    row = pool * per_pool + k
                    for x, v in zip(host, (self.rec.tokens[s.index, s.generated - 1],
                                           self._length(s), s.generated, True,
                                           self.first_sample + s.index)):
                        x[row] = v
                    order.append((row, s))
            slots = paged.Slots(*(self._rows(x) for x in host),
                                self._rows(self._table(order, total)))
        else:
            order = [(row, s) for row, s in pending.order if s.pages]   # host: still running
            # Samples that reach max_new_tokens in the running chunk (it decodes chunk_steps
            # tokens for each of its live rows) will have finished: a continuation would carry
            # them as idle rows, and one of only such rows would run empty (measured: the extra
            # chunk at the end of every rollout whose last samples end at the cap).
            going = [s for _, s in order if s.generated + cfg.chunk_steps < self.t]
            # Not where the running samples would compact into fewer slots (a bucket down): a
            # continuation keeps its slots, finished or not. Several processes alike: every
            # decision here is on host state all of them share (chunks harvested so far).
            live = max(sum(s.pool == p for s in going) for p in range(self.pools))
            slots_now = pending.slots.token.shape[0] // self.pools
            if (not cfg.overlap_chunks or not going
                    or slot_bucket(live, self.slots_per_pool, cfg) < slots_now
                    or (self.queue and len(order) < len(pending.order))
                    or not self._grow_ahead(going)):
                return None
            slots = dataclasses.replace(pending.slots, page_table=self._rows(
                self._table(order, pending.slots.token.shape[0])))
            self.stats.overlapped_chunks += 1
        self.sync.check("decode", self.dispatched)
        self.dispatched += 1
        COMPILES.note("rollout/paged_decode", slots=slots.token.shape[0],
                      pages_per_slot=slots.page_table.shape[1], steps=cfg.chunk_steps,
                      mode=self.program_cfg.mode, pages=self.pages_per_pool,
                      dtype=jnp.dtype(self.model.dtype).name)
        self._note_dispatch()
        program = (paged_exact.decode_chunk_program_for(self.program_cfg)
                   if cfg.mode == RolloutMode.EXACT_SPARSE
                   else paged.decode_chunk_program_for(self.program_cfg))
        table = cfg.traced_plan(len(budgets))[1]       # re-planning: the plan is an input
        self.kv, out_slots, rec = program(
            self.graphdef, self.params, self.kv, slots, jnp.asarray(decode_budgets(cfg, budgets)),
            self.rng, *(() if table is None else (jnp.asarray(table),)), cfg=self.program_cfg,
            steps=cfg.chunk_steps, bin_size=self.bin_size, spec=self.spec)
        return Chunk(order, out_slots, self.sync.start_read(rec))

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

    def harvest(self, chunk: Chunk, idle: bool) -> None:
        """Waits for chunk's records and appends them; finished samples give back their pages
        (a continuation in flight holds them as inactive rows: it neither writes nor records
        them, and later programs run after it). idle: nothing else is in flight."""
        # exact_sparse chunks (paged_exact.py) record accepted and alpha after `recorded`.
        toks, lps, buds, top_v, top_i, recorded, *exact = self.sync.finish_read(chunk.records)
        if self.round_counts is not None:   # re-planning: the chunk's rounds per branch, last
            self.round_counts += exact.pop()[0]
        if idle:
            self.idle_since = time.perf_counter()
        self.stats.chunks += 1
        for row, s in chunk.order:
            c = int(recorded[row].sum())
            if s.pages and self._record(s, *(x[row, :c] for x in (toks, lps, buds, top_v, top_i,
                                                                  *exact))):
                self.running[s.pool].remove(s)
                self._finish(s)

    def run(self, budgets, bin_size: int) -> None:
        self.bin_size = bin_size
        self.budget_table = jnp.asarray(budgets, jnp.int32)
        pending = None
        while pending is not None or self.queue or any(self.running):
            if pending is not None:             # chunk i in flight: dispatch i+1, then read i
                after = self.decode(budgets, pending)
                self.harvest(pending, idle=after is None)
                pending = after
                continue
            self.grow()
            units = self.admit()
            if units:
                self.prefill(units)
            if any(self.running):
                pending = self.decode(budgets)
            elif self.queue and not units:
                raise RuntimeError("paged rollout made no progress: the queue's head does not "
                                   "fit an empty pool (a bug: the pool size was checked)")
        for a in self.alloc:
            a.check_all_free()
        self.stats.sync_seconds = self.sync.read_seconds
        self.stats.guard_seconds = self.sync.check_seconds


def _place(x: np.ndarray, spec: ShardingSpec) -> jax.Array:
    """Rows over the data axis (slot arrays: each shard's slots on its devices); several
    processes: each copies its devices' rows of the replicated host array."""
    return multihost.host_to_global(x, spec.sharding(("batch",) + (None,) * (x.ndim - 1),
                                                     x.shape))


def generate(model: Qwen3ForCausalLM, prompt_tokens, prompt_lengths, *, cfg: RolloutConfig,
             budgets, bin_size: int = 2000, group_size: int = 1, rng: jax.Array | None = None,
             spec: ShardingSpec | None = None, first_sample: int = 0) -> Trajectories:
    """The paged engine's `rollout.generate`: same arguments, same `Trajectories` (rows grouped
    in prompt order, shapes as the static engine's). Several processes: each passes its own
    prompts; every process schedules the global batch (process p's prompts are row block p)."""
    global LAST_STATS
    budgets = check_budgets(cfg, budgets)
    prompt_tokens, prompt_lengths = prepare_prompts(prompt_tokens, prompt_lengths, cfg=cfg,
                                                    group_size=group_size, spec=spec)
    prompt_tokens, prompt_lengths = paged_multihost.global_prompts(prompt_tokens,
                                                                   prompt_lengths, spec)
    ro = PagedRollout(model, prompt_tokens, prompt_lengths, cfg=cfg, group_size=group_size,
                      rng=rng, spec=spec, first_sample=first_sample)
    ro.run(budgets, bin_size)
    LAST_STATS = st = ro.stats
    log.info("paged rollout: %d samples in %d decode chunks and %d prefills, %d preemptions, "
             "peak %d of %d pages (%.1f MiB), %d prompt pages shared", ro.rows, st.chunks,
             st.prefills, st.preemptions, st.peak_pages, st.pages_per_pool * st.pools,
             st.peak_bytes / 2**20, st.shared_prompt_pages)
    if ro.sync.enabled:
        log.info("paged rollout: %d processes, per decode chunk %.1f ms of replicated readback "
                 "and %.1f ms of digest checks", jax.process_count(),
                 1e3 * st.sync_seconds / max(st.chunks, 1),
                 1e3 * st.guard_seconds / max(st.chunks, 1))
    rows_lengths = np.array([s.generated for s in ro.samples], np.int32)
    def rep(x):
        return np.repeat(x, group_size, axis=0)
    t = np.arange(cfg.max_new_tokens)
    plens = rep(prompt_lengths)
    rec = ro.rec
    traj = Trajectories(
        prompt_tokens=rep(prompt_tokens), prompt_lengths=plens, tokens=rec.tokens,
        logprobs=rec.logprobs, topk_logprobs=rec.topk_v, topk_ids=rec.topk_i,
        budgets=recorded_budgets(cfg, rec.budgets), cached_lengths=plens[:, None] + t[None],
        mask=t[None] < rows_lengths[:, None], response_lengths=rows_lengths,
        accepted=rec.accepted, alpha=rec.alpha,
        round_counts=None if ro.round_counts is None else np.broadcast_to(
            ro.round_counts, (ro.rows, ro.round_counts.size)).copy())
    # Host arrays (whole on every process) -> rows over the data axis: process p's rows on p's
    # devices, the static engine's layout.
    return jax.tree.map(jnp.asarray if spec is None else (lambda x: _place(x, spec)), traj)
