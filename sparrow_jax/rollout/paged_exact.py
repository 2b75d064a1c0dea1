"""Exact sparse rollout on the paged engine (`mode = "exact_sparse"`, `engine = "paged"`).

The decode chunk program of this mode; the scheduler (rollout/continuous.py) runs it in place of
`paged.decode_chunk_program`. A chunk is `chunk_rounds` rounds of, per active slot:
1. draft: gamma one-token decode steps through the paged engine's own per-layer attention
   (`paged.layer_attention_fns`: the bin's sparse budget, the draft's K/V written into the slot's
   pages at length .. length + gamma - 1, a page's centroid set when a draft token fills it);
2. verify: one dense forward of [x_0, x_1..x_gamma] over the slot's pages (the paged kernel's
   dense selection over the prefix, cascaded with the attention among the new tokens), writing
   their dense K/V over the draft's at length .. length + gamma;
3. the speculative-sampling rule and the round's records (rollout/verify.py, shared with the
   static engine's mode), then rollback.
Rollback: the slot's length advances past the kept tokens only; the K/V written past it (draft
or verify) sit in the slot's own pages and are overwritten before anything reads them (every
read is masked by the length). The centroids of the pages the round filled are recomputed from
the dense keys; a page the draft filled but the round did not keep full has a stale centroid
that selection never scores (it scores full pages only) and that is rewritten when the page
fills. The page tables and the pool are the host's: a round never allocates, so nothing there
rolls back. Every position a round writes is >= the slot's length >= its prompt length, so
it lies in the slot's private pages (the shared prompt pages of a GRPO group are full prompt
blocks, never written). A preempted sample is recomputed by a dense prefill of its prompt and
recorded tokens: the dense K/V the verify passes wrote, so it resumes where it stopped.

A plan per length bin (`gamma_by_bin`, `approximate_from_bin`) runs as on the static engine: a
round per distinct gamma (`verify.run_one_branch`), each slot offering its own bin's drafts, and a
round of gamma + 1 unverified drafts when every active slot is in an approximate bin.
Verify-guided drafts (`draft_scorer = "verify"`) carry each sparse layer's block scores
[S, Hkv, P] from round to round within a chunk; a chunk's first round scores centroids (slots
change between chunks).

Pages: a round advances a slot by at most gamma + 1 tokens and writes positions
< length + gamma + 1, so `chunk_rounds` = chunk_steps // (gamma + 1) rounds stay within the
chunk_steps tokens of pages the scheduler grows each sample by; the pool's per-sample maximum
has gamma slots of slack (`page_pool.pool_layout`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import dense_attention, paged
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.rollout.state import budget_for_lengths
from sparrow_jax.rollout.verify import (accept_round, approximate_round, cascade_attention,
                                        draft_sample, guide_scores, round_blocks,
                                        run_one_branch, verify_guided_layers)
from sparrow_jax.runtime import compiler_options
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import block_scores, selection


def chunk_rounds(cfg: RolloutConfig) -> int:
    """Verify rounds per decode chunk: as many as fit chunk_steps tokens of growth."""
    return max(1, cfg.chunk_steps // (cfg.gamma + 1))


def _write_rows(pool, new, page_table, starts, write):
    """Writes C tokens per slot, new [S, C, Hkv, D] at positions starts .. starts + C - 1, as
    rows of a pool [1, Hkv, N, bs, D] (a row scatter: a round's tokens can share a page);
    slots with write False, and positions without a page (table entry N), are dropped."""
    _, hkv, n_pages, bs, d = pool.shape
    s, c = new.shape[:2]
    pos = starts[:, None] + jnp.arange(c)[None, :]                         # [S, C]
    blk = pos // bs
    page = jnp.take_along_axis(page_table, jnp.clip(blk, 0, page_table.shape[1] - 1), axis=1)
    ok = write[:, None] & (blk < page_table.shape[1])
    flat = jnp.where(ok, page * bs + pos % bs, n_pages * bs).reshape(-1)  # out of range: dropped
    vals = new.reshape(s * c, hkv, d).swapaxes(0, 1).astype(pool.dtype)
    return pool.reshape(hkv, n_pages * bs, d).at[:, flat].set(vals, mode="drop").reshape(
        pool.shape)


def _verify_layer(q, k_new, v_new, k_pool, v_pool, page_table, starts, write, *,
                  block_size: int, backend: str, mass: bool = False):
    """One layer of the verify pass on one pool (under shard_map: this shard's): writes the
    C tokens' dense K/V (k/v_new [S, C, Hkv, D]) and attends q [S, C, Hq, D] densely over the
    slot's pages (keys < starts) and the new tokens. Returns (out [S, C, Hq, D], pools), with
    mass: and the attention mass of each of the slot's logical blocks [S, Hkv, P]."""
    k_pool = _write_rows(k_pool, k_new, page_table, starts, write)
    v_pool = _write_rows(v_pool, v_new, page_table, starts, write)
    masses = []

    def prefix(folded):
        out, lse = dense_attention.paged_decode(folded, k_pool, v_pool, page_table, starts,
                                                backend=backend)
        if mass:
            masses.append(dense_attention.paged_block_mass_from_lse(folded, k_pool, page_table,
                                                                    lse, starts))
        return out, lse
    out = cascade_attention(q, prefix, k_new, v_new)
    return (out, k_pool, v_pool) + tuple(masses)


def _guided_layer(q, k_new, v_new, k_pool, v_pool, c_pool, page_table, lengths, write,
                  budget_blocks, covered, guide, guided, *, cfg: RolloutConfig,
                  max_selected: int):
    """A sparse layer's draft step with verify-guided blocks: as the paged engine's sparse
    decode attention (`paged.layer_attention_fns`: the token written, the centroid of the page
    it fills set, covered slots dense), the blocks ranked by guide [S, Hkv, P] - the verify
    passes' attention mass - in slots where guided [S], by centroid score elsewhere.
    Returns (out [S, Hq, D], k_pool, v_pool, c_pool)."""
    bs = cfg.block_size
    n_pages = k_pool.shape[2]
    s, p = page_table.shape
    pos = lengths - 1
    page = jnp.take_along_axis(page_table, (pos // bs)[:, None], axis=1)[:, 0]
    if paged.writes_whole_pages(cfg.backend):     # the token write the compiler keeps in place
        _, k_pool = paged.write_token_pages(k_pool, k_new, page, pos % bs, write)
        _, v_pool = paged.write_token_pages(v_pool, v_new, page, pos % bs, write)
    else:
        k_pool = paged.write_token_rows(k_pool, k_new, page, pos % bs, write)
        v_pool = paged.write_token_rows(v_pool, v_new, page, pos % bs, write)
    filled = write & (lengths % bs == 0)
    cent = jnp.mean(k_pool[0][:, jnp.clip(page, 0, n_pages - 1)].astype(jnp.float32),
                    axis=2).astype(c_pool.dtype)                           # [Hkv, S, D]
    c_pool = c_pool[0].at[:, jnp.where(filled, page, n_pages)].set(cent, mode="drop")[None]

    def dense():
        return dense_attention.paged_decode(q, k_pool, v_pool, page_table, lengths,
                                            backend=cfg.backend)[0]

    def sparse_out():
        cents = c_pool[0][:, jnp.clip(page_table, 0, n_pages - 1)].swapaxes(0, 1)
        scores = jnp.where(guided[:, None, None], guide,
                           block_scores.centroid_scores(q, cents))
        hkv = scores.shape[1]
        idx, num = selection.select_from_scores(
            scores, jnp.broadcast_to(lengths[:, None], (s, hkv)),
            jnp.broadcast_to(budget_blocks[:, None], (s, hkv)), max_selected=max_selected,
            block_size=bs, backend=cfg.selection_backend)
        return pallas_kernels.paged_block_sparse_decode(q, k_pool, v_pool, page_table, idx, num,
                                                        lengths, backend=cfg.backend)[0]
    if max_selected >= p:
        out = sparse_out()
    else:
        out = jax.lax.cond(jnp.all(covered), dense, lambda: jax.lax.cond(
            jnp.any(covered), lambda: jnp.where(covered[:, None, None], dense(), sparse_out()),
            sparse_out))
    return out, k_pool, v_pool, c_pool


def _refresh(c_pool, k_pool, page_table, starts, new_len, write, *, span: int,
             block_size: int):
    """The centroids [1, Hkv, N, D] of the pages a round over starts .. starts + span - 1 left
    full at new_len, recomputed from the pool's keys [1, Hkv, N, bs, D] (the dense keys)."""
    n_pages, p = k_pool.shape[2], page_table.shape[1]
    blk, full = round_blocks(starts, new_len, span=span, block_size=block_size)   # [S, M]
    page = jnp.take_along_axis(page_table, jnp.clip(blk, 0, p - 1), axis=1)
    keys = k_pool[0][:, jnp.clip(page, 0, n_pages - 1)]                   # [Hkv, S, M, bs, D]
    cent = jnp.mean(keys.astype(jnp.float32), axis=3).astype(c_pool.dtype)
    target = jnp.where(full & (blk < p) & write[:, None], page, n_pages)
    return c_pool[0].at[:, target].set(cent, mode="drop")[None]


def _shard(fn, spec: ShardingSpec | None, num_kv_heads: int, kind: str):
    """fn under shard_map: slots and pools over data, KV heads over model (paged.mesh_axes)."""
    if spec is None:
        return fn
    data, heads = paged.mesh_axes(spec, num_kv_heads)
    tok = P(data, None, heads, None)
    pool, cent, table, row = (P(data, heads, None, None, None), P(data, heads, None, None),
                              P(data, None), P(data))
    guide = P(data, heads, None)
    if kind == "verify":
        ins, outs = (tok, tok, tok, pool, pool, table, row, row), (tok, pool, pool)
    elif kind == "verify_mass":
        ins, outs = (tok, tok, tok, pool, pool, table, row, row), (tok, pool, pool, guide)
    elif kind == "guided":
        one = P(data, heads, None)
        ins = (one, one, one, pool, pool, cent, table, row, row, row, row, guide, row)
        outs = (one, pool, pool, cent)
    else:
        ins, outs = (cent, pool, table, row, row, row), cent
    return jax.shard_map(fn, mesh=spec.mesh, in_specs=ins, out_specs=outs, check_vma=False)


@functools.partial(jax.jit, **paged.DECODE_CHUNK_JIT)
def decode_chunk_program(graphdef, params, kv: paged.PagedKV, slots: paged.Slots, budgets, rng,
                         gamma_table=None, *, cfg: RolloutConfig, steps: int, bin_size: int,
                         spec: ShardingSpec | None):
    """`chunk_rounds(cfg)` draft + verify rounds of every active slot (a `fori_loop`).

    Same inputs and outputs as `paged.decode_chunk_program` (steps = cfg.chunk_steps, the
    tokens a chunk may grow a slot by), the records W = rounds * (gamma + 1) wide and compact
    (a slot's c recorded tokens are its first c entries, `recorded` marks them), two more:
    (tokens, logprobs, budgets (0: the recorded log-probs are the dense policy's), top-k
    values/ids, recorded, accepted [S, W] bool, alpha [S, W] f32). gamma_table: as
    `exact.decode_program`'s (re-planning: the per-bin gamma [bins] int32 an input); with it a
    ninth record, the rounds each round branch ran in this chunk [S, R] int32 (the same in
    every slot)."""
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    mcfg = model.config
    g, bs = cfg.gamma, cfg.block_size
    if steps < g + 1:
        raise ValueError(f"an exact_sparse decode chunk of {steps} steps cannot hold one round "
                         f"of gamma + 1 = {g + 1} tokens")
    width = chunk_rounds(dataclasses.replace(cfg, chunk_steps=steps)) * (g + 1)
    s, p = slots.page_table.shape
    hkv = mcfg.num_key_value_heads
    max_selected = min(cfg.max_budget // bs, p)
    attn = paged.layer_attention_fns(cfg, spec, hkv, max_selected, mcfg.rms_norm_eps)
    sparse_layers = [cfg.sparse_layer(i) for i in range(mcfg.num_hidden_layers)]
    guided_layers = verify_guided_layers(cfg, mcfg.num_hidden_layers)
    verify_layer, verify_mass_layer = (jax.jit(_shard(functools.partial(
        _verify_layer, block_size=bs, backend=cfg.backend, mass=m), spec, hkv,
        "verify_mass" if m else "verify")) for m in (False, True))
    guided_layer = jax.jit(_shard(functools.partial(_guided_layer, cfg=cfg,
                                                    max_selected=max_selected), spec, hkv,
                                  "guided"))
    refresh = jax.jit(_shard(functools.partial(_refresh, span=g + 1, block_size=bs), spec, hkv,
                             "refresh"))
    rows = jnp.arange(s)[:, None]
    k_rec = cfg.record_topk
    rec0 = (jnp.zeros((s, width), jnp.int32), jnp.zeros((s, width), jnp.float32),
            jnp.zeros((s, width), jnp.int32), jnp.zeros((s, width, k_rec), jnp.float32),
            jnp.zeros((s, width, k_rec), jnp.int32), jnp.zeros((s, width), bool),
            jnp.zeros((s, width), bool), jnp.full((s, width), jnp.nan, jnp.float32))
    gammas = cfg.round_gammas
    table = (jnp.asarray(cfg.gamma_by_bin or (g,), jnp.int32) if gamma_table is None
             else gamma_table)
    approx_from = cfg.approximate_from_bin
    counting = gamma_table is not None        # re-planning: rounds per branch (as exact.py)

    def slot_gamma(lengths):
        return table[jnp.minimum(lengths // bin_size, table.shape[0] - 1)]

    def slot_approximate(lengths):
        return (lengths // bin_size >= approx_from) if approx_from else jnp.zeros(s, bool)

    def draft(kv: paged.PagedKV, sl: paged.Slots, guide, n: int):
        """n sparse decode steps from sl.token -> (kv with the draft's K/V, drafts [S, n],
        the draft's log-probs [S, n, V])."""
        scores, guided_rows = guide

        def step(carry, jj):
            ks, vs, cs, tok = list(carry[0]), list(carry[1]), list(carry[2]), carry[3]
            lengths = sl.length + jj + 1
            budget = budget_for_lengths(budgets, lengths, bin_size)
            budget_blocks = jnp.minimum(budget // bs, max_selected).astype(jnp.int32)
            covered = budget >= lengths

            def guided(i):
                """Layer i's draft attention with blocks ranked by the verify passes (unfused:
                the model hands it finished heads)."""
                # args: decode_step_hidden's 11 per-layer arguments, then the head-finishing
                # ones that only the fused kernels use.
                return lambda *args: guided_layer(*args[:11], scores[guided_layers.index(i)],
                                                  guided_rows)

            hidden = paged.decode_step_hidden(model, attn, [ks, vs, cs], tok, sl.length + jj,
                                              sl.page_table, sl.active, budget_blocks, covered,
                                              cfg=cfg, spec=spec,
                                              own_attention={i: guided(i) for i in guided_layers})
            x, q_logp = draft_sample(model.logits(hidden[:, 0]), rng=rng,
                                     sample_ids=sl.sample_id, index=sl.generated + jj, cfg=cfg)
            return (tuple(ks), tuple(vs), tuple(cs), x), (x, q_logp)

        if n == 0:          # a dense step: nothing drafted
            return kv, jnp.zeros((s, 0), jnp.int32), jnp.zeros((s, 0, mcfg.vocab_size),
                                                               jnp.float32)
        (ks, vs, cs, _), (xs, q_logp) = jax.lax.scan(
            step, (kv.k, kv.v, kv.centroids, sl.token), jnp.arange(n))
        return paged.PagedKV(ks, vs, cs), xs.T, q_logp.transpose(1, 0, 2)

    def verify(kv: paged.PagedKV, sl: paged.Slots, drafts):
        """The dense pass over [x_0, drafts] -> (K pools, V pools, logits [S, n+1, V], the
        guided layers' block masses)."""
        ks, vs = list(kv.k), list(kv.v)
        masses = {}

        def attend(i, q, k, v):
            args = (q, k, v, ks[i], vs[i], sl.page_table, sl.length, sl.active)
            if i in guided_layers:
                out, ks[i], vs[i], masses[i] = verify_mass_layer(*args)
            else:
                out, ks[i], vs[i] = verify_layer(*args)
            return out

        seq = jnp.concatenate([sl.token[:, None], drafts], axis=1)
        positions = sl.length[:, None] + jnp.arange(seq.shape[1])[None, :]
        hidden = model.run_layers(model.embed(seq), positions, attend)
        return ks, vs, model.logits(hidden), [masses[i] for i in guided_layers]

    def round_of(n: int):
        """One round of every slot at draft length n (a slot offers min(its bin's gamma, n))."""
        def run(carry):
            kv, sl, count, rec, guide = carry
            kv, drafts, q_logp = draft(kv, sl, guide, n)
            ks, vs, p_logits, masses = verify(kv, sl, drafts)
            rd = accept_round(p_logits, q_logp, drafts, rng=rng, sample_ids=sl.sample_id,
                              generated=sl.generated, active=sl.active, cfg=cfg,
                              limit=slot_gamma(sl.length) if cfg.plans_per_bin else None,
                              approximate=slot_approximate(sl.length) if approx_from else None)
            cs = [refresh(c, k, sl.page_table, sl.length, sl.length + rd.n_new, sl.active)
                  if sp else c for c, k, sp in zip(kv.centroids, ks, sparse_layers)]
            scores, guided = guide
            scores = guide_scores(scores, masses, sl.active)
            unverified = slot_approximate(sl.length) if n else jnp.zeros(s, bool)
            return finish(paged.PagedKV(tuple(ks), tuple(vs), tuple(cs)), sl, count, rec, rd,
                          n + 1, (scores, guided | sl.active), unverified)
        return run

    def approximate_only(carry):
        """Every active slot is in an approximate bin: gamma + 1 sparse steps, unverified."""
        kv, sl, count, rec, guide = carry
        kv, drafts, q_logp = draft(kv, sl, guide, g + 1)
        rd = approximate_round(q_logp, drafts, generated=sl.generated, active=sl.active,
                               cfg=cfg)
        return finish(kv, sl, count, rec, rd, g + 1, guide, jnp.ones(s, bool))

    def finish(kv, sl, count, rec, rd, n: int, guide, unverified):
        """The round's records (rd's fields [S, n]), lengths and done flags."""
        jj = jnp.arange(n)[None, :]
        at = jnp.where(jj < rd.n_new[:, None], count[:, None] + jj, width)  # width: dropped

        def put(buf, val):
            return buf.at[rows, at].set(val, mode="drop")
        # An unverified (approximate) token records its draft budget, a verified one 0.
        used = jnp.where(unverified[:, None],
                         budget_for_lengths(budgets, sl.length[:, None] + jj + 1, bin_size), 0)
        rec = (put(rec[0], rd.tokens), put(rec[1], rd.logprobs), put(rec[2], used),
               put(rec[3], rd.topk_values), put(rec[4], rd.topk_ids), put(rec[5], True),
               put(rec[6], rd.accepted), put(rec[7], rd.alpha))
        generated = sl.generated + rd.n_new
        done = rd.stopped | (generated >= cfg.max_new_tokens)
        sl = dataclasses.replace(sl, token=jnp.where(sl.active, rd.last, sl.token),
                                 length=sl.length + rd.n_new, generated=generated,
                                 active=sl.active & ~done)
        return kv, sl, count + rd.n_new, rec, guide

    def body(_, carry):
        if not cfg.plans_per_bin:
            return round_of(g)(carry)
        # As the static engine: the longest gamma an active verified slot's bin asks for, or
        # a round of unverified drafts when no active slot verifies.
        sl = carry[1]
        verified = sl.active & ~slot_approximate(sl.length)
        need = jnp.max(jnp.where(verified, slot_gamma(sl.length), 0))
        branch = jnp.where(jnp.any(verified),
                           jnp.searchsorted(jnp.asarray(gammas, jnp.int32), need), len(gammas))
        rounds = [round_of(n) for n in gammas] + ([approximate_only] if approx_from else [])
        branch = jnp.minimum(branch, len(rounds) - 1)
        if not counting:
            return run_one_branch(branch, rounds, carry)
        return run_one_branch(branch, rounds, carry[:-1]) + (carry[-1].at[branch].add(1),)

    count0 = jnp.zeros((s,), jnp.int32)
    guide0 = (tuple(jnp.zeros((s, hkv, p), jnp.float32) for _ in guided_layers),
              jnp.zeros((s,), bool))
    carry0 = (kv, slots, count0, rec0, guide0)
    if counting:
        carry0 += (jnp.zeros(len(cfg.round_branches), jnp.int32),)
    final = jax.lax.fori_loop(0, width // (g + 1), body, carry0)
    kv, slots, rec = final[0], final[1], final[3]
    if counting:
        rec = rec + (jnp.broadcast_to(final[-1], (s, final[-1].shape[0])),)
    return kv, slots, rec


def decode_chunk_program_for(cfg: RolloutConfig):
    """`decode_chunk_program` compiled with cfg's GPU decode options
    (`RolloutConfig.decode_compiler_options`: itself at the defaults)."""
    return compiler_options.with_options(decode_chunk_program, paged.DECODE_CHUNK_JIT,
                                         cfg.decode_compiler_options)
