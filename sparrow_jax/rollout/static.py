"""The static rollout engine: dense prefill of the prompts into a cache row per sample, then one
jitted `lax.while_loop` of block-sparse decode.

The whole generation is a single compiled program: no host round trip per token. Budgets arrive
as a traced `[num_bins]` array, so the schedule controller can change them every RL step without
a recompile; only `max_budget` (the selection width) is static. Callers use
`sparrow_jax.rollout.{start, decode, generate}` (rollout/api.py), which pick the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels import pallas_triton, pallas_triton_select, pallas_triton_write
from pallas_kernels.reference import HeadFinish, contiguous_as_pages
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import dense_attention, fused
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.kv_cache import CACHE_AXES, KVCache, check_cache_fits, write_token
from sparrow_jax.rollout.prefill import prefill
from sparrow_jax.rollout.state import (DecodeState, Trajectories, budget_for_lengths, constrain,
                                       prepare_prompts, record)
from sparrow_jax.runtime import compiler_options, multihost
from sparrow_jax.runtime.shapes import COMPILES
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import block_scores, selection

log = logging.getLogger(__name__)


# -- decode -----------------------------------------------------------------------------------
def _decode_attention(q, k_new, v_new, k_cache, v_cache, centroids, lengths, budget_blocks,
                      covered, cos, sin, q_norm, k_norm, *, sparse: bool, cfg: RolloutConfig,
                      max_selected: int, norm_eps: float, combined: bool = False):
    """One layer, one token. q [B, Hq, D]; k_new/v_new [B, Hkv, D] the fed token's key/value
    (index lengths - 1); k/v_cache [B, Hkv, S, D]; centroids [B, Hkv, NB, D]; returns (out
    [B, Hq, D], k_cache, v_cache, centroids).

    covered [B] bool: the row's budget covers its length (budget >= length, e.g. the dense rung
    `DENSE_BUDGET`): exact dense attention, also when the static selection width
    `max_selected` is narrower than the cache (then the dense kernel runs for those rows; a
    `lax.cond` skips whichever path no row needs). With `fused.fewest_kernels` the layer is
    `_fused_attention` (q/k raw, finished in the kernels with cos/sin [B, D] and the norm
    weights q_norm/k_norm [D]; combined: q, k_new and v_new are one [B, Hq + 2 Hkv, D] array);
    elsewhere those go unused."""
    if fused.fewest_kernels(cfg.backend):
        return _fused_attention(q, k_new, v_new, k_cache, v_cache, centroids, lengths,
                                budget_blocks, covered, HeadFinish(q_norm, cos, sin, norm_eps),
                                HeadFinish(k_norm, cos, sin, norm_eps), sparse=sparse, cfg=cfg,
                                max_selected=max_selected, combined=combined)
    with jax.named_scope("kv_write"):
        k_cache = write_token(k_cache, k_new, lengths - 1)
        v_cache = write_token(v_cache, v_new, lengths - 1)

    def dense():
        with jax.named_scope("dense_attention"):
            return dense_attention.decode(q, k_cache, v_cache, lengths, backend=cfg.backend)[0]
    if not sparse:
        return dense(), k_cache, v_cache, centroids
    with jax.named_scope("centroid_update"):
        centroids = block_scores.update_centroid(centroids, k_cache, lengths,
                                              block_size=cfg.block_size)

    def sparse_out():
        with jax.named_scope("block_select"):
            idx, num = selection.select_blocks(q, centroids, lengths, budget_blocks,
                                               max_selected=max_selected,
                                               block_size=cfg.block_size,
                                               backend=cfg.selection_backend)
        with jax.named_scope("sparse_attention"):
            return pallas_kernels.block_sparse_decode(q, k_cache, v_cache, idx, num, lengths,
                                                      block_size=cfg.block_size,
                                                      backend=cfg.backend)[0]
    if max_selected * cfg.block_size >= k_cache.shape[2]:
        return sparse_out(), k_cache, v_cache, centroids  # selection is dense for covered rows

    def mixed():
        return jnp.where(covered[:, None, None], dense(), sparse_out())
    out = jax.lax.cond(jnp.all(covered), dense,
                       lambda: jax.lax.cond(jnp.any(covered), mixed, sparse_out))
    return out, k_cache, v_cache, centroids


def _fused_attention(q, k_new, v_new, k_cache, v_cache, centroids, lengths, budget_blocks,
                     covered, q_finish: HeadFinish, k_finish: HeadFinish, *, sparse: bool,
                     cfg: RolloutConfig, max_selected: int, combined: bool):
    """`_decode_attention` as the fewest kernels (`fused`): the cache viewed as one page pool
    per row (block i = page i, a reshape), one kernel writing the token's K and V (and the
    filled block's centroid), one selecting (sparse layers), one attending - every row of a
    sparse layer, covered or not."""
    bs = cfg.block_size
    b, hkv, s, _ = k_cache.shape
    hq = q.shape[1] - 2 * hkv if combined else None
    pos = lengths - 1
    with jax.named_scope("kv_write"):
        k_pages, v_pages, written = pallas_triton_write.write_token_triton(
            contiguous_as_pages(k_cache, bs), contiguous_as_pages(v_cache, bs),
            centroids if sparse else None, k_new, v_new, pos // bs, pos % bs, pos < s,
            k_finish=k_finish, k_first=hq or 0, v_first=(hq or 0) + hkv if combined else 0)
    k_cache, v_cache = k_pages.reshape(k_cache.shape), v_pages.reshape(v_cache.shape)
    if not sparse:
        with jax.named_scope("dense_attention"):
            tile, per_step = pallas_triton.dense_tiling(s, k_cache.dtype)
            out = pallas_triton.identity_decode_triton(
                q, contiguous_as_pages(k_cache, tile), contiguous_as_pages(v_cache, tile),
                lengths, q_finish=q_finish, q_heads=hq, blocks_per_step=per_step)[0]
        return out, k_cache, v_cache, centroids
    with jax.named_scope("block_select"):
        picked = pallas_triton_select.select_pages_triton(
            q, written, None, lengths, budget_blocks, width=max_selected, block_size=bs,
            q_finish=q_finish, q_heads=hq, radix_bits=selection.TRITON_RADIX_BITS)[0]
    with jax.named_scope("sparse_attention"):
        out = pallas_triton.identity_decode_triton(
            q, k_pages, v_pages, lengths, selection=picked, covered=covered, q_finish=q_finish,
            q_heads=hq)[0]
    return out, k_cache, v_cache, written


def _sharded(fn, spec: ShardingSpec | None, num_kv_heads: int):
    """Runs per-layer decode attention under shard_map: batch over data, KV heads over model."""
    if spec is None:
        return fn
    model_size = spec.mesh.shape.get("model", 1)
    heads = "model" if num_kv_heads % model_size == 0 else None
    data = spec.rules.get("batch")
    kv, q, row = P(data, heads, None, None), P(data, heads, None), P(data)
    table, weight = P(data, None), P(None)
    return jax.shard_map(fn, mesh=spec.mesh,
                         in_specs=(q, q, q, kv, kv, kv, row, row, row, table, table, weight,
                                   weight),
                         out_specs=(q, kv, kv, kv), check_vma=False)


def layer_attention_fns(cfg: RolloutConfig, spec: ShardingSpec | None, num_kv_heads: int,
                        max_selected: int, norm_eps: float) -> dict:
    """One layer's decode attention over the static cache, for dense (False) and sparse (True)
    layers: `_decode_attention`'s arguments and results, under shard_map when sharded
    (norm_eps: the model's RMSNorm epsilon). Used through `decode_step_hidden`, which
    exact.py's drafts share."""
    combined = fused.combined_heads(cfg, spec)
    return {sp: _sharded(functools.partial(_decode_attention, sparse=sp, cfg=cfg,
                                           max_selected=max_selected, norm_eps=norm_eps,
                                           combined=combined), spec, num_kv_heads)
            for sp in (False, True)}


def decode_step_hidden(model: Qwen3ForCausalLM, attn: dict, cache: list[list], tokens,
                       positions, budget_blocks, covered, *, cfg: RolloutConfig,
                       spec: ShardingSpec | None,
                       own_attention: Mapping[int, Callable] | None = None):
    """One decode step's layers over the static cache (`fused.decode_layers`): tokens [B] fed
    at positions [B] (written at that index) -> final-normed hidden [B, 1, H]. attn:
    `layer_attention_fns`; cache: [ks, vs, cs], each the layers' arrays, updated in place (the
    list entries); budget_blocks, covered [B] as `_decode_attention`. own_attention: layers whose
    attention the caller supplies (exact.py's verify-guided drafts), with attn's arguments and
    results."""
    ks, vs, cs = cache
    lengths = positions + 1

    def layer(i, q, k, v, *finish):
        fn = (own_attention or {}).get(i) or attn[cfg.sparse_layer(i)]
        out, ks[i], vs[i], cs[i] = fn(q, k, v, ks[i], vs[i], cs[i], lengths, budget_blocks,
                                      covered, *finish)
        return out

    return fused.decode_layers(model, layer, tokens, positions, cfg=cfg, spec=spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "group_size", "spec"))
def prefill_program(graphdef, params, prompt_tokens, prompt_lengths, rng, first_sample=0, *,
                     cfg: RolloutConfig, group_size: int, spec: ShardingSpec | None
                     ) -> DecodeState:
    """Dense prefill, cache layout for `group_size` samples per prompt, first sampled token.
    Independent of the rollout mode: dense and sparse decode start from the same state (compress
    mode allocates its bounded cache, cfg.cache_slots, and no centroids)."""
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    bp, plen = prompt_tokens.shape
    b, t_new = bp * group_size, cfg.max_new_tokens
    s_max = cfg.cache_slots(plen)
    ks, vs, first_logits = prefill(model, prompt_tokens, prompt_lengths, chunk=cfg.prefill_chunk)
    # Group sampling: the n samples of a prompt share its prefill; copy the prompt cache n times.
    rep = functools.partial(jnp.repeat, repeats=group_size, axis=0)
    pad = ((0, 0), (0, 0), (0, s_max - plen), (0, 0))
    k_layers = [constrain(jnp.pad(rep(k), pad), CACHE_AXES, spec) for k in ks]
    v_layers = [constrain(jnp.pad(rep(v), pad), CACHE_AXES, spec) for v in vs]
    cents = [constrain(block_scores.block_centroids(k, cfg.block_size), CACHE_AXES, spec)
             if cfg.mode != RolloutMode.COMPRESS else k[:, :, :0]    # compress: no blocks
             for k in k_layers]
    lengths = rep(prompt_lengths)
    k_rec = cfg.record_topk
    state = DecodeState(
        step=jnp.int32(0),
        cache=KVCache(k=tuple(k_layers), v=tuple(v_layers), centroids=tuple(cents),
                      lengths=lengths),
        token=jnp.zeros((b,), jnp.int32),
        tokens=jnp.full((b, t_new), cfg.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((b, t_new), jnp.float32),
        topk_logprobs=jnp.zeros((b, t_new, k_rec), jnp.float32),
        topk_ids=jnp.zeros((b, t_new, k_rec), jnp.int32),
        budgets=jnp.zeros((b, t_new), jnp.int32), done=jnp.zeros((b,), bool),
        response_lengths=jnp.zeros((b,), jnp.int32), rng=rng,
        prompt_tokens=rep(prompt_tokens), prompt_lengths=lengths,
        sample_ids=first_sample + jnp.arange(b, dtype=jnp.int32))
    state = record(state, rep(first_logits), cfg, jnp.ones((b,), bool))
    stop_ids = jnp.asarray(cfg.stop_token_ids or (-1,), jnp.int32)
    return dataclasses.replace(state, step=jnp.int32(1),
                               done=jnp.isin(state.token, stop_ids) | (t_new <= 1))


DECODE_JIT = dict(static_argnames=("graphdef", "cfg", "bin_size", "spec"),
                  donate_argnames=("state",))


@functools.partial(jax.jit, **DECODE_JIT)
def decode_program(graphdef, params, state: DecodeState, budgets, *, cfg: RolloutConfig,
                    bin_size: int, spec: ShardingSpec | None) -> tuple[Trajectories, tuple]:
    """The decode `while_loop`. `state` is donated: the cache is updated in place. The final
    cache and loop scalars are returned, unused, so that every donated buffer aliases an output
    (a donated input with no output to alias would be copied into the loop, doubling the cache)."""
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    mcfg = model.config
    t_new, s_max = state.tokens.shape[1], state.cache.max_length
    max_selected = min(cfg.max_budget, s_max) // cfg.block_size
    stop_ids = jnp.asarray(cfg.stop_token_ids or (-1,), jnp.int32)

    attn_fns = layer_attention_fns(cfg, spec, mcfg.num_key_value_heads, max_selected,
                                   mcfg.rms_norm_eps)

    def cond(st: DecodeState):
        return (st.step < t_new) & ~jnp.all(st.done)

    def body(st: DecodeState) -> DecodeState:
        cache = st.cache
        lengths = cache.lengths + 1  # the fed token is written at index cache.lengths
        budget = budget_for_lengths(budgets, lengths, bin_size)
        budget_blocks = jnp.minimum(budget // cfg.block_size, max_selected).astype(jnp.int32)
        covered = budget >= lengths          # dense for this row (the dense rung, short rows)
        k_new, v_new, c_new = list(cache.k), list(cache.v), list(cache.centroids)
        hidden = decode_step_hidden(model, attn_fns, [k_new, v_new, c_new], st.token,
                                    cache.lengths, budget_blocks, covered, cfg=cfg, spec=spec)
        active = ~st.done
        with jax.named_scope("lm_head"):
            logits = model.logits(hidden[:, 0])
        with jax.named_scope("sample"):
            st = record(st, logits, cfg, active)
        used = budget if cfg.mode == RolloutMode.SPARSE else jnp.zeros_like(budget)
        new_len = jnp.where(active, lengths, cache.lengths)
        done = st.done | (active & (jnp.isin(st.token, stop_ids) | (new_len + 1 > s_max)))
        return dataclasses.replace(
            st, step=st.step + 1, done=done,
            budgets=st.budgets.at[:, st.step].set(jnp.where(active, used, 0)),
            cache=KVCache(k=tuple(k_new), v=tuple(v_new), centroids=tuple(c_new),
                          lengths=new_len))

    st = jax.lax.while_loop(cond, body, state)
    steps = jnp.arange(t_new)
    traj = Trajectories(
        prompt_tokens=st.prompt_tokens, prompt_lengths=st.prompt_lengths, tokens=st.tokens,
        logprobs=st.logprobs, topk_logprobs=st.topk_logprobs, topk_ids=st.topk_ids,
        budgets=st.budgets, cached_lengths=st.prompt_lengths[:, None] + steps[None, :],
        mask=steps[None, :] < st.response_lengths[:, None], response_lengths=st.response_lengths)
    # Rows stay sharded over the data axis: each process then reads its own rows back
    # (multihost.local_rows) and the learner consumes the global arrays as they are.
    traj = jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1), spec), traj)
    return traj, (st.cache, st.step, st.token, st.done, st.rng, st.sample_ids)


def decode_program_for(cfg: RolloutConfig):
    """`decode_program` compiled with cfg's GPU decode options
    (`RolloutConfig.decode_compiler_options`: itself at the defaults)."""
    return compiler_options.with_options(decode_program, DECODE_JIT, cfg.decode_compiler_options)


def start(model: Qwen3ForCausalLM, prompt_tokens, prompt_lengths, *, cfg: RolloutConfig,
          group_size: int = 1, rng: jax.Array | None = None,
          spec: ShardingSpec | None = None, first_sample: int = 0) -> DecodeState:
    """The prefill program: validates and pads the prompts, fills the cache (one copy per
    sample), samples the first token. Arguments as in `generate`; the result feeds `decode`
    (whose `cfg` may differ in mode, dense layers and max_budget only)."""
    prompt_tokens, prompt_lengths = prepare_prompts(prompt_tokens, prompt_lengths, cfg=cfg,
                                                    group_size=group_size, spec=spec)
    plen = prompt_tokens.shape[1]
    multi = multihost.is_multiprocess()
    b = prompt_tokens.shape[0] * group_size * jax.process_count()
    check_cache_fits(model.config, b, cfg.cache_slots(plen), model.dtype, spec,
                     block_size=cfg.block_size)
    graphdef, params = nnx.split(model)
    COMPILES.note("rollout/prefill", prompts=prompt_tokens.shape[0] * jax.process_count(),
                  prompt_width=plen, group_size=group_size, max_new_tokens=cfg.max_new_tokens,
                  dtype=jnp.dtype(model.dtype).name)
    rng = jax.random.key(0) if rng is None else rng
    if multi:
        tokens_in = multihost.rows_to_global(prompt_tokens, spec)
        lengths_in = multihost.rows_to_global(prompt_lengths, spec)
    else:
        tokens_in, lengths_in = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
    # A re-planned gamma table (exact_sparse) changes nothing here: no program per plan.
    return prefill_program(graphdef, params, tokens_in, lengths_in, rng,
                            jnp.int32(first_sample), cfg=cfg.without_traced_plan,
                            group_size=group_size, spec=spec)


def decode(model: Qwen3ForCausalLM, state: DecodeState, *, cfg: RolloutConfig, budgets,
           bin_size: int = 2000, spec: ShardingSpec | None = None) -> Trajectories:
    """The static decode program (dense or sparse mode): runs `state` (from `start`, consumed:
    its buffers are donated) until every row stopped or reached cfg.max_new_tokens.
    budgets [num_bins] int32 tokens per length bin, already checked (`state.check_budgets`)."""
    shapes = (state.tokens.shape[1], state.topk_ids.shape[2],
              state.cache.max_length // max(state.cache.centroids[0].shape[2], 1))
    wanted = (cfg.max_new_tokens, cfg.record_topk, cfg.block_size)
    if shapes != wanted:
        raise ValueError(f"state was prefilled for (max_new_tokens, record_topk, block_size) = "
                         f"{shapes}, cfg has {wanted}")
    graphdef, params = nnx.split(model)
    COMPILES.note("rollout/decode", rows=state.tokens.shape[0],
                  prompt_width=state.prompt_tokens.shape[1], max_new_tokens=cfg.max_new_tokens,
                  mode=cfg.mode, max_budget=cfg.max_budget, dtype=jnp.dtype(model.dtype).name)
    traj, _ = decode_program_for(cfg)(graphdef, params, state, jnp.asarray(budgets), cfg=cfg,
                                      bin_size=bin_size, spec=spec)
    return traj
