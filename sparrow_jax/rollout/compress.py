"""Compressed rollout (`RolloutConfig.mode = "compress"`): Sparse-RL's KV eviction with a real
memory bound, and its exact teacher-forced replay.

Decode. Every layer's cache holds the row's live tokens compacted at the front of a buffer of
`cfg.cache_slots(P)` = max(prompt width, kv_budget) + compress_every slots (rounded up to the
block size, never more than the dense cache) - allocated that size by the prefill program, not
prompt + max_new_tokens. Each step writes the new token's K/V at the row's next free slot and
attends densely over the live slots. At decode steps that are multiples of `compress_every`, a
row holding more than `kv_budget` tokens is compressed, per layer: the `window` most recent tokens
are kept, the rest of the `kv_budget` is chosen among the older ones (the prompt included, from
the first compression on) by R-KV or SnapKV scores (`sparrow_jax.sparsity.compression`; one kept set per
row and layer, scores summed over KV heads), and the kept tokens are written to the front of the
buffer in their original order. Keys are cached after RoPE, so a kept token keeps its position;
a new token gets its true position (prompt length + tokens generated), not its slot index. So a
row never holds more than max(prompt length, kv_budget) + compress_every tokens (checked in
tests on the arrays and on the live-slot counts). The window's queries come from a per-layer ring
of the last `window` decode queries (post-RoPE).

Recorded per token as in the other modes, with `budgets` = the number of keys the token's
attention saw (kept + new; equal to the cached length until the first compression), and per row,
layer and position `evicted_at` = the first query position that no longer sees that key. That is
all the replay needs: `replay_attention_fn` attends each query to exactly the keys the rollout
kept for it, so the teacher-forced log-probabilities equal the recorded ones (to f32 rounding)
and the learner's full-vocabulary alpha is exact (`SparseReplay(mode="compress")`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from sparrow_jax.model.attention import visible_causal_attention
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.rollout.kv_cache import KVCache, write_token
from sparrow_jax.rollout.state import DecodeState, Trajectories, constrain, record
from sparrow_jax.rollout.teacher_forced import token_logprobs, trajectory_hidden
from sparrow_jax.runtime.shapes import COMPILES
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import compression

NEVER = int(np.iinfo(np.int32).max)   # evicted_at of a key that is never evicted


def _dense_attention(cfg: RolloutConfig, spec: ShardingSpec | None, num_kv_heads: int):
    """q [B, Hq, D], k/v [B, Hkv, S, D], lengths [B] -> [B, Hq, D] over slots < length; under
    shard_map with a spec (batch over data, KV heads over model when divisible)."""
    def fn(q, k, v, lengths):
        return pallas_kernels.dense_decode(q, k, v, lengths, backend=cfg.backend)[0]
    if spec is None:
        return fn
    model_size = spec.mesh.shape.get("model", 1)
    heads = "model" if num_kv_heads % model_size == 0 else None
    data = spec.rules.get("batch")
    kv, q = P(data, heads, None, None), P(data, heads, None)
    return jax.shard_map(fn, mesh=spec.mesh, in_specs=(q, kv, kv, P(data)), out_specs=q,
                         check_vma=False)


def _compact(cfg: RolloutConfig, need, live, pos, ks, vs, queries, slot_pos, evicted):
    """Compresses the rows `need` [B] of every layer; the others are returned unchanged.
    live [B] tokens held, pos [B] position of the step's query; ks/vs L x [B, Hkv, C, D],
    queries L x [B, w, Hq, D], slot_pos L x [B, C] position of each slot, evicted [B, L, S]."""
    b, c = slot_pos[0].shape
    budget, rows = cfg.kv_budget, jnp.arange(b)[:, None]
    ks, vs, slot_pos = list(ks), list(vs), list(slot_pos)
    for i in range(len(ks)):
        head_scores = compression.scores(cfg.compress_scorer, queries[i], ks[i], live,
                                         window=cfg.window, lam=cfg.rkv_lambda)
        keep = compression.kept_slots(head_scores, live, budget=budget, window=cfg.window)
        keep = jnp.where(need[:, None], keep, jnp.arange(budget)[None, :])       # [B, budget]
        for buf in (ks, vs):
            kept = jnp.take_along_axis(buf[i], keep[:, None, :, None], axis=2)
            buf[i] = jax.lax.dynamic_update_slice_in_dim(buf[i], kept, 0, axis=2)
        kept_mask = jnp.zeros((b, c), bool).at[rows, keep].set(True)
        gone = need[:, None] & (jnp.arange(c)[None, :] < live[:, None]) & ~kept_mask
        target = jnp.where(gone, slot_pos[i], evicted.shape[2])                  # S: dropped
        evicted = evicted.at[rows, i, target].set(
            jnp.broadcast_to((pos + 1)[:, None], target.shape), mode="drop")
        slot_pos[i] = slot_pos[i].at[:, :budget].set(jnp.take_along_axis(slot_pos[i], keep, 1))
    return tuple(ks), tuple(vs), tuple(slot_pos), evicted


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "spec"),
                   donate_argnames=("state",))
def compressed_decode_program(graphdef, params, state: DecodeState, *, cfg: RolloutConfig,
                    spec: ShardingSpec | None):
    """The compress-mode decode `while_loop` (state donated, as in the engine's program)."""
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    mcfg = model.config
    b, t_new = state.tokens.shape
    cap, n_layers, w = state.cache.max_length, mcfg.num_hidden_layers, cfg.window
    seq = state.prompt_tokens.shape[1] + t_new
    stop_ids = jnp.asarray(cfg.stop_token_ids or (-1,), jnp.int32)
    attn = _dense_attention(cfg, spec, mcfg.num_key_value_heads)
    queries = tuple(constrain(jnp.zeros((b, w, mcfg.num_attention_heads, mcfg.head_dim),
                                         model.dtype), ("batch", None, "q_heads", None), spec)
                    for _ in range(n_layers))
    slot_pos = tuple(jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (b, cap))
                     for _ in range(n_layers))
    evicted = jnp.full((b, n_layers, seq), NEVER, jnp.int32)

    def cond(carry):
        st = carry[0]
        return (st.step < t_new) & ~jnp.all(st.done)

    def body(carry):
        st, queries, slot_pos, evicted = carry
        cache = st.cache
        slot = cache.lengths                        # the fed token's slot
        live = slot + 1
        pos = st.prompt_lengths + st.step - 1       # its true position (RoPE)
        active = ~st.done
        ks, vs, qs, sp = list(cache.k), list(cache.v), list(queries), list(slot_pos)
        ring = (st.step - 1) % w

        def attend(i, q, k, v):
            ks[i] = write_token(ks[i], k[:, 0], slot)
            vs[i] = write_token(vs[i], v[:, 0], slot)
            qs[i] = jax.lax.dynamic_update_slice_in_dim(qs[i], q.astype(qs[i].dtype), ring, 1)
            sp[i] = sp[i].at[jnp.arange(b), slot].set(pos, mode="drop")
            return attn(q[:, 0], ks[i], vs[i], live)[:, None]

        hidden = model.run_layers(model.embed(st.token[:, None]), pos[:, None], attend)
        st = record(st, model.logits(hidden[:, 0]), cfg, active)
        # (a cache no larger than the budget never needs compressing: nothing to trace)
        need = active & (st.step % cfg.compress_every == 0) & (live > cfg.kv_budget) & (
            cfg.kv_budget < cap)
        ks, vs, sp = tuple(ks), tuple(vs), tuple(sp)
        if cfg.kv_budget < cap:
            ks, vs, sp, evicted = jax.lax.cond(
                jnp.any(need), functools.partial(_compact, cfg),
                lambda need, live, pos, ks, vs, qs, sp, ev: (ks, vs, sp, ev),
                need, live, pos, ks, vs, tuple(qs), sp, evicted)
        lengths = jnp.where(need, cfg.kv_budget, jnp.where(active, live, slot))
        st = dataclasses.replace(
            st, step=st.step + 1, done=st.done | (active & jnp.isin(st.token, stop_ids)),
            budgets=st.budgets.at[:, st.step].set(jnp.where(active, live, 0)),
            cache=KVCache(k=ks, v=vs, centroids=cache.centroids, lengths=lengths))
        return st, tuple(qs), sp, evicted

    st, queries, slot_pos, evicted = jax.lax.while_loop(
        cond, body, (state, queries, slot_pos, evicted))
    steps = jnp.arange(t_new)
    traj = Trajectories(
        prompt_tokens=st.prompt_tokens, prompt_lengths=st.prompt_lengths, tokens=st.tokens,
        logprobs=st.logprobs, topk_logprobs=st.topk_logprobs, topk_ids=st.topk_ids,
        budgets=st.budgets, cached_lengths=st.prompt_lengths[:, None] + steps[None, :],
        mask=steps[None, :] < st.response_lengths[:, None], response_lengths=st.response_lengths,
        evicted_at=evicted)
    traj = jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1), spec), traj)
    return traj, (st.cache, st.step, st.token, st.done, st.rng, st.sample_ids)


def decode(model: Qwen3ForCausalLM, state: DecodeState, *, cfg: RolloutConfig, budgets=None,
           bin_size: int = 2000, spec: ShardingSpec | None = None, return_cache: bool = False):
    """Runs a compress-mode prefill `state` (from `rollout.start` with this cfg; consumed) to the
    end (a `rollout.api.Decoder`: the cache bound is `cfg.kv_budget`, so `budgets` and
    `bin_size` are not read). Returns Trajectories (with `evicted_at`), and the final KVCache if
    return_cache."""
    plen = state.prompt_tokens.shape[1]
    if (state.cache.max_length != cfg.cache_slots(plen) or state.cache.centroids[0].shape[2]
            or state.tokens.shape[1] != cfg.max_new_tokens):
        raise ValueError(f"state was not prefilled for this compress config (cache of "
                         f"{state.cache.max_length} slots, want {cfg.cache_slots(plen)}; "
                         f"{state.tokens.shape[1]} new tokens, want {cfg.max_new_tokens})")
    graphdef, params = nnx.split(model)
    COMPILES.note("rollout/decode", rows=state.tokens.shape[0], prompt_width=plen,
                  max_new_tokens=cfg.max_new_tokens, mode="compress", kv_budget=cfg.kv_budget,
                  scorer=cfg.compress_scorer, dtype=jnp.dtype(model.dtype).name)
    traj, aux = compressed_decode_program(graphdef, params, state, cfg=cfg, spec=spec)
    return (traj, aux[0]) if return_cache else traj


# -- teacher-forced replay ----------------------------------------------------------------------
def _fit(x: jax.Array, length: int) -> jax.Array:
    """[B, S'] -> [B, length]: truncated, or padded with NEVER."""
    if x.shape[1] >= length:
        return x[:, :length]
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=NEVER)


def replay_attention_fn(evicted_at: jax.Array, *, query_chunk: int = 0):
    """A FullAttentionFn for `Qwen3ForCausalLM.hidden_states` (positions = sequence indices, as
    `teacher_forced.trajectory_hidden` builds them) that replays a compressed rollout: the query
    at position t of layer l sees key p iff p <= t, p is a real token and t < evicted_at[:, l, p].
    evicted_at [B, L, S'] from the rollout. query_chunk > 0: that many queries at a time."""
    def attend(layer_idx, q, k, v, positions, attention_mask):
        t = q.shape[1]
        alive_until = _fit(evicted_at[:, layer_idx], t)                     # [B, T]
        key_mask = attention_mask.astype(bool)

        def visible(q_c, pos_c, q_idx, k_idx):      # -> [B, 1, M, C, C'] (causality aside)
            kept = q_idx[None, None, :, None] < alive_until[:, k_idx][:, :, None, :]
            return (kept & key_mask[:, k_idx][:, :, None, :])[:, None]

        return visible_causal_attention(visible, query_chunk, q, k, v, positions)
    return attend


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "block_size"))
def _replay_program(graphdef, state, traj, *, temperature, block_size):
    model = nnx.merge(graphdef, state)
    hidden = trajectory_hidden(model, traj, attention_fn=replay_attention_fn(traj.evicted_at),
                               block_size=block_size)
    lp = token_logprobs(model, hidden, traj.tokens, temperature=temperature)
    return jnp.where(traj.mask, lp, 0.0)


def replay_logprobs(model: Qwen3ForCausalLM, traj: Trajectories, *, temperature: float = 1.0,
                    block_size: int = 16) -> jax.Array:
    """Teacher-forced log p [B, T] of a compressed rollout's tokens, replaying its evictions
    (untruncated sampling at `temperature`)."""
    if traj.evicted_at is None:
        raise ValueError("trajectories carry no evicted_at: not a compress-mode rollout")
    graphdef, state = nnx.split(model)
    return _replay_program(graphdef, state, traj, temperature=float(temperature),
                           block_size=block_size)


def visible_counts(traj: Trajectories) -> np.ndarray:
    """[B, T]: from the eviction record, how many keys each generated token's query saw (on the
    host; equals `traj.budgets` for a compressed rollout - a check of the record)."""
    ev = np.asarray(traj.evicted_at)                                           # [B, L, S]
    plen = np.asarray(traj.prompt_lengths)
    b, n_layers, s = ev.shape
    t = traj.tokens.shape[1]
    out = np.zeros((b, n_layers, t), np.int64)
    for r in range(b):
        for j in range(1, t):
            q = plen[r] + j - 1
            out[r, :, j] = np.sum(ev[r, :, :q + 1] > q, axis=-1)
    if not (out == out[:, :1]).all():
        raise AssertionError("layers kept different numbers of tokens")
    return out[:, 0]
