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
from pallas_kernels.reference import all_blocks_selection
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import paged
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.rollout.state import budget_for_lengths
from sparrow_jax.rollout.verify import (accept_round, cascade_attention, draft_sample,
                                        round_blocks)
from sparrow_jax.runtime import compiler_options
from sparrow_jax.runtime.sharding import ShardingSpec


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
                  block_size: int, backend: str):
    """One layer of the verify pass on one pool (under shard_map: this shard's): writes the
    C tokens' dense K/V (k/v_new [S, C, Hkv, D]) and attends q [S, C, Hq, D] densely over the
    slot's pages (keys < starts) and the new tokens. Returns (out [S, C, Hq, D], pools)."""
    k_pool = _write_rows(k_pool, k_new, page_table, starts, write)
    v_pool = _write_rows(v_pool, v_new, page_table, starts, write)
    s, p = page_table.shape
    idx, num = all_blocks_selection(s, k_pool.shape[1], p * block_size, starts, block_size)

    def prefix(folded):
        return pallas_kernels.paged_block_sparse_decode(folded, k_pool, v_pool, page_table, idx,
                                                        num, starts, backend=backend)
    return cascade_attention(q, prefix, k_new, v_new), k_pool, v_pool


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
    if kind == "verify":
        ins, outs = (tok, tok, tok, pool, pool, table, row, row), (tok, pool, pool)
    else:
        ins, outs = (cent, pool, table, row, row, row), cent
    return jax.shard_map(fn, mesh=spec.mesh, in_specs=ins, out_specs=outs, check_vma=False)


@functools.partial(jax.jit, **paged.DECODE_CHUNK_JIT)
def decode_chunk_program(graphdef, params, kv: paged.PagedKV, slots: paged.Slots, budgets, rng,
                         *, cfg: RolloutConfig, steps: int, bin_size: int,
                         spec: ShardingSpec | None):
    """`chunk_rounds(cfg)` draft + verify rounds of every active slot (a `fori_loop`).

    Same inputs and outputs as `paged.decode_chunk_program` (steps = cfg.chunk_steps, the
    tokens a chunk may grow a slot by), the records W = rounds * (gamma + 1) wide and compact
    (a slot's c recorded tokens are its first c entries, `recorded` marks them), two more:
    (tokens, logprobs, budgets (0: the recorded log-probs are the dense policy's), top-k
    values/ids, recorded, accepted [S, W] bool, alpha [S, W] f32)."""
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
    verify_layer = jax.jit(_shard(functools.partial(
        _verify_layer, block_size=bs, backend=cfg.backend), spec, hkv, "verify"))
    refresh = jax.jit(_shard(functools.partial(_refresh, span=g + 1, block_size=bs), spec, hkv,
                             "refresh"))
    sparse_layers = [cfg.sparse_layer(i) for i in range(mcfg.num_hidden_layers)]
    rows, j = jnp.arange(s)[:, None], jnp.arange(g + 1)[None, :]
    k_rec = cfg.record_topk
    rec0 = (jnp.zeros((s, width), jnp.int32), jnp.zeros((s, width), jnp.float32),
            jnp.zeros((s, width), jnp.int32), jnp.zeros((s, width, k_rec), jnp.float32),
            jnp.zeros((s, width, k_rec), jnp.int32), jnp.zeros((s, width), bool),
            jnp.zeros((s, width), bool), jnp.full((s, width), jnp.nan, jnp.float32))

    def draft(kv: paged.PagedKV, sl: paged.Slots):
        """gamma sparse decode steps from sl.token -> (kv with the draft's K/V, drafts [S, G],
        the draft's log-probs [S, G, V])."""
        def step(carry, jj):
            ks, vs, cs, tok = list(carry[0]), list(carry[1]), list(carry[2]), carry[3]
            lengths = sl.length + jj + 1
            budget = budget_for_lengths(budgets, lengths, bin_size)
            budget_blocks = jnp.minimum(budget // bs, max_selected).astype(jnp.int32)
            covered = budget >= lengths
            hidden = paged.decode_step_hidden(model, attn, [ks, vs, cs], tok, sl.length + jj,
                                              sl.page_table, sl.active, budget_blocks, covered,
                                              cfg=cfg, spec=spec)
            x, q_logp = draft_sample(model.logits(hidden[:, 0]), rng=rng,
                                     sample_ids=sl.sample_id, index=sl.generated + jj, cfg=cfg)
            return (tuple(ks), tuple(vs), tuple(cs), x), (x, q_logp)

        (ks, vs, cs, _), (xs, q_logp) = jax.lax.scan(
            step, (kv.k, kv.v, kv.centroids, sl.token), jnp.arange(g))
        return paged.PagedKV(ks, vs, cs), xs.T, q_logp.transpose(1, 0, 2)

    def verify(kv: paged.PagedKV, sl: paged.Slots, drafts):
        """The dense pass over [x_0, drafts] -> (K pools, V pools, logits [S, G+1, V])."""
        ks, vs = list(kv.k), list(kv.v)

        def attend(i, q, k, v):
            out, ks[i], vs[i] = verify_layer(q, k, v, ks[i], vs[i], sl.page_table, sl.length,
                                             sl.active)
            return out

        seq = jnp.concatenate([sl.token[:, None], drafts], axis=1)
        hidden = model.run_layers(model.embed(seq), sl.length[:, None] + j, attend)
        return ks, vs, model.logits(hidden)

    def body(_, carry):
        kv, sl, count, rec = carry
        kv, drafts, q_logp = draft(kv, sl)
        ks, vs, p_logits = verify(kv, sl, drafts)
        rd = accept_round(p_logits, q_logp, drafts, rng=rng, sample_ids=sl.sample_id,
                          generated=sl.generated, active=sl.active, cfg=cfg)
        new_len = sl.length + rd.n_new
        cs = [refresh(c, k, sl.page_table, sl.length, new_len, sl.active) if sp else c
              for c, k, sp in zip(kv.centroids, ks, sparse_layers)]
        at = jnp.where(j < rd.n_new[:, None], count[:, None] + j, width)   # width: dropped

        def put(buf, val):
            return buf.at[rows, at].set(val, mode="drop")
        rec = (put(rec[0], rd.tokens), put(rec[1], rd.logprobs), rec[2],
               put(rec[3], rd.topk_values), put(rec[4], rd.topk_ids), put(rec[5], True),
               put(rec[6], rd.accepted), put(rec[7], rd.alpha))
        generated = sl.generated + rd.n_new
        done = rd.stopped | (generated >= cfg.max_new_tokens)
        sl = dataclasses.replace(sl, token=jnp.where(sl.active, rd.last, sl.token),
                                 length=new_len, generated=generated, active=sl.active & ~done)
        return paged.PagedKV(tuple(ks), tuple(vs), tuple(cs)), sl, count + rd.n_new, rec

    count0 = jnp.zeros((s,), jnp.int32)
    kv, slots, _, rec = jax.lax.fori_loop(0, width // (g + 1), body, (kv, slots, count0, rec0))
    return kv, slots, rec


def decode_chunk_program_for(cfg: RolloutConfig):
    """`decode_chunk_program` compiled with cfg's GPU decode options
    (`RolloutConfig.decode_compiler_options`: itself at the defaults)."""
    return compiler_options.with_options(decode_chunk_program, paged.DECODE_CHUNK_JIT,
                                         cfg.decode_compiler_options)
