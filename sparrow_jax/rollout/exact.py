"""Exact sparse rollout on the static engine (`RolloutConfig.mode = "exact_sparse"`).

Each round of the decode `while_loop`, per row:
1. draft: gamma one-token decode steps with block-sparse attention at the bin's budget (the
   static engine's decode attention), each sampling x_j from the draft distribution q_j;
2. verify: one dense forward of the gamma + 1 tokens [x_0, x_1..x_gamma] over the full cache,
   writing their *dense* K/V over the draft's (past the first sparse layer the draft's K/V
   differ from the policy's), giving p_0..p_gamma;
3. the speculative-sampling rule (rollout/speculative.py) keeps x_1..x_a and one token sampled
   by the verify pass; the cache length advances past x_0..x_a only (rollback is the length:
   K/V beyond it are overwritten before they are read), and the centroids of blocks the round
   filled are recomputed from the dense keys.
The tokens are distributed exactly as dense sampling; the recorded log-probs are the dense
policy's (from the verify pass), so the learner's TIS weight of every token is 1 up to
rounding, and `budgets` records 0 (dense). Per token the trajectories carry `accepted` and
`alpha` (state.Trajectories).

Drafts choose their blocks by centroid score (`RolloutConfig.draft_scorer = "centroid"`, as
sparse mode does) or by the attention mass the last verify pass gave each block, per KV head
(`"verify"`: the verify already computes every block's attention for gamma + 1 positions;
`verify_forward(..., mass_layers=)` returns it, `verify.guide_scores` accumulates it). A plan
per length bin (`gamma_by_bin`, `approximate_from_bin`) runs, each round, one of a round per
distinct gamma, or a round of unverified drafts when every active row is in an approximate bin
(`verify.run_one_branch`: the cache updated in place, which `lax.switch` did not).

This mode extends the static engine: it reuses static.py's prefill and per-layer decode
attention; what does not touch the cache (the verify's cascade attention, draft sampling, the
round's acceptance and records) is rollout/verify.py's, shared with the paged engine's mode
(paged_exact.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import PartitionSpec as P

import pallas_kernels
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import dense_attention, speculative
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.rollout.static import DECODE_JIT, decode_step_hidden, layer_attention_fns
from sparrow_jax.rollout.kv_cache import KVCache, write_token
from sparrow_jax.rollout.state import (DecodeState, Trajectories, budget_for_lengths, constrain)
from sparrow_jax.runtime import compiler_options
from sparrow_jax.runtime.shapes import COMPILES
from sparrow_jax.rollout.verify import (accept_round, approximate_round, cascade_attention,
                                        draft_sample, guide_scores, round_blocks,
                                        run_one_branch, verify_guided_layers)
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import block_scores, selection


def verify_attention(q, k_cache, v_cache, starts, k_new, v_new, *, backend: str = "auto",
                     mass_block: int = 0):
    """The verify pass's dense causal attention of C consecutive queries per row
    (`verify.cascade_attention`), the prefix (keys < starts[b]) read in one pass on the XLA
    backend, else by the dense decode kernel (`dense_attention.decode`). q [B, C, Hq, D] at
    positions starts[b] + i; k/v_cache [B, Hkv, S, D]; k/v_new [B, C, Hkv, D]. Query i sees keys
    0 .. starts[b] + i. Returns out [B, C, Hq, D]; with mass_block > 0 also the attention mass
    of each block of mass_block keys of the prefix, summed over every query of a KV head
    [B, Hkv, S // mass_block] (what verify-guided drafts rank)."""
    mass = []

    def prefix(folded):
        if not mass_block:
            return dense_attention.decode(folded, k_cache, v_cache, starts, backend=backend)
        if dense_attention.fits_one_pass(backend, *folded.shape[:2], k_cache.shape[2]):
            out, lse, m = dense_attention.one_pass(folded, k_cache, v_cache, starts,
                                                   mass_block=mass_block)
        else:
            out, lse = pallas_kernels.dense_decode(folded, k_cache, v_cache, starts,
                                                   backend=backend)
            m = dense_attention.block_mass_from_lse(folded, k_cache, lse, starts,
                                                    block_size=mass_block)
        mass.append(m)
        return out, lse
    out = cascade_attention(q, prefix, k_new, v_new)
    return (out, mass[0]) if mass_block else out


def write_tokens(buf, new, starts):
    """buf [B, H, S, D], new [B, C, H, D] -> buf with row b's C tokens at starts[b]..+C-1."""
    def one(row, x, i):
        return jax.lax.dynamic_update_slice(row, x.transpose(1, 0, 2).astype(row.dtype),
                                            (0, i, 0))
    return jax.vmap(one)(buf, new, starts)


def refresh_centroids(centroids, k_cache, starts, new_len, *, span: int, block_size: int):
    """Recomputes, from k_cache, the centroids of the blocks overlapping positions
    starts .. starts + span - 1 that are full at new_len (per row; `verify.round_blocks`).
    centroids [B, Hkv, NB, D], k_cache [B, Hkv, S, D], starts/new_len [B]."""
    nb = centroids.shape[2]

    def one_row(c, kc, start, length):
        blocks, full = round_blocks(start, length, span=span, block_size=block_size)
        for m in range(blocks.shape[0]):
            blk = blocks[m]
            safe = jnp.clip(blk, 0, nb - 1)
            keys = jax.lax.dynamic_slice_in_dim(kc, safe * block_size, block_size, axis=1)
            new = jnp.mean(keys.astype(jnp.float32), axis=1, keepdims=True).astype(c.dtype)
            old = jax.lax.dynamic_slice_in_dim(c, safe, 1, axis=1)
            c = jax.lax.dynamic_update_slice_in_dim(c, jnp.where(full[m] & (blk < nb), new, old),
                                                    safe, axis=1)
        return c
    return jax.vmap(one_row)(centroids, k_cache, starts, new_len)


def verify_forward(model: Qwen3ForCausalLM, ks: list, vs: list, starts, seq, *,
                   backend: str = "auto", mass_layers: Sequence[int] = (),
                   block_size: int = 16):
    """The verify pass: dense forward of seq [B, C] at positions starts..starts+C-1 over the
    per-layer caches ks/vs (L x [B, Hkv, S, D]), writing the C tokens' dense K/V.
    Returns (ks, vs, logits [B, C, V] f32, masses): masses, one per layer of mass_layers, the
    attention mass of each block of the prefix [B, Hkv, S // block_size] (`verify_attention`)."""
    ks, vs = list(ks), list(vs)
    masses = {}

    def attend(i, q, k, v):
        ks[i] = write_tokens(ks[i], k, starts)
        vs[i] = write_tokens(vs[i], v, starts)
        if i not in mass_layers:
            return verify_attention(q, ks[i], vs[i], starts, k, v, backend=backend)
        out, masses[i] = verify_attention(q, ks[i], vs[i], starts, k, v, backend=backend,
                                          mass_block=block_size)
        return out

    positions = starts[:, None] + jnp.arange(seq.shape[1])[None, :]
    hidden = model.run_layers(model.embed(seq), positions, attend)
    return ks, vs, model.logits(hidden), [masses[i] for i in mass_layers]


def guided_attention(q, k_cache, v_cache, centroids, lengths, budget_blocks, covered, guide,
                     guided, *, cfg: RolloutConfig, max_selected: int):
    """A sparse layer's draft step with verify-guided blocks: as static.py's decode attention
    of a sparse layer (the fed token's block centroid kept up to date, covered rows dense), but
    the blocks ranked by guide [B, Hkv, NB] - the verify passes' attention mass - in rows where
    guided [B] (a verify pass has run), by centroid score elsewhere. q [B, Hq, D]; returns
    (out [B, Hq, D], centroids)."""
    bs = cfg.block_size
    centroids = block_scores.update_centroid(centroids, k_cache, lengths, block_size=bs)

    def dense():
        return dense_attention.decode(q, k_cache, v_cache, lengths, backend=cfg.backend)[0]

    def sparse_out():
        scores = jnp.where(guided[:, None, None], guide,
                           block_scores.centroid_scores(q, centroids))
        hkv = scores.shape[1]
        idx, num = selection.select_from_scores(
            scores, jnp.broadcast_to(lengths[:, None], (q.shape[0], hkv)),
            jnp.broadcast_to(budget_blocks[:, None], (q.shape[0], hkv)),
            max_selected=max_selected, block_size=bs, backend=cfg.selection_backend)
        return pallas_kernels.block_sparse_decode(q, k_cache, v_cache, idx, num, lengths,
                                                  block_size=bs, backend=cfg.backend)[0]
    if max_selected * bs >= k_cache.shape[2]:
        return sparse_out(), centroids
    out = jax.lax.cond(jnp.all(covered), dense, lambda: jax.lax.cond(
        jnp.any(covered), lambda: jnp.where(covered[:, None, None], dense(), sparse_out()),
        sparse_out))
    return out, centroids


def guided_attention_fn(cfg: RolloutConfig, spec: ShardingSpec | None, num_kv_heads: int,
                        max_selected: int):
    """`guided_attention` for these settings, under shard_map when sharded (rows over data,
    KV heads over model, as static.py's decode attention)."""
    fn = functools.partial(guided_attention, cfg=cfg, max_selected=max_selected)
    if spec is None:
        return fn
    heads = "model" if num_kv_heads % spec.mesh.shape.get("model", 1) == 0 else None
    data = spec.rules.get("batch")
    kv, q, row = P(data, heads, None, None), P(data, heads, None), P(data)
    return jax.shard_map(fn, mesh=spec.mesh, in_specs=(q, kv, kv, kv, row, row, row, q, row),
                         out_specs=(q, kv), check_vma=False)


@functools.partial(jax.jit, **DECODE_JIT)
def decode_program(graphdef, params, state: DecodeState, budgets, gamma_table=None, *,
                   cfg: RolloutConfig, bin_size: int, spec: ShardingSpec | None):
    """The exact-sparse decode `while_loop` (one draft + verify round per iteration).
    gamma_table: None (the plan is cfg's, a constant of the program), or with re-planning
    (`RolloutConfig.traced_plan`) the per-bin gamma [bins] int32, each among cfg.round_gammas:
    an input, so that a new plan runs in the same program. Returns (Trajectories, final carry)
    as static.decode_program does; with a gamma_table the trajectories' `round_counts` hold
    the rounds each branch ran."""
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    mcfg = model.config
    bs = cfg.block_size
    b, t_new = state.tokens.shape
    s_max = state.cache.max_length
    max_selected = min(cfg.max_budget, s_max) // bs
    attn_fns = layer_attention_fns(cfg, spec, mcfg.num_key_value_heads, max_selected,
                                   mcfg.rms_norm_eps)
    sparse_layers = [cfg.sparse_layer(i) for i in range(mcfg.num_hidden_layers)]
    # Verify-guided drafts: the sparse layers' block scores from the verify passes.
    guided_layers = verify_guided_layers(cfg, mcfg.num_hidden_layers)
    guided_fn = guided_attention_fn(cfg, spec, mcfg.num_key_value_heads, max_selected)
    rows = jnp.arange(b)[:, None]
    gammas = cfg.round_gammas                     # the draft lengths a round can run (static)
    table = (jnp.asarray(cfg.gamma_by_bin or (cfg.gamma,), jnp.int32) if gamma_table is None
             else gamma_table)
    approx_from = cfg.approximate_from_bin
    # Re-planning counts the rounds of each branch (the run fits their costs on them); else
    # the carry is as before re-planning existed (the same program).
    counting = gamma_table is not None

    def row_bin(lengths):
        return lengths // bin_size

    def row_gamma(lengths):
        """[B] cache lengths at a round's start -> each row's bin's gamma."""
        return table[jnp.minimum(row_bin(lengths), table.shape[0] - 1)]

    def row_approximate(lengths):
        """[B] whether each row's bin decodes approximately (unverified drafts)."""
        return (row_bin(lengths) >= approx_from) if approx_from else jnp.zeros(b, bool)

    def draft(st: DecodeState, guide, g: int):
        """g sparse decode steps from st.token. Returns the cache (draft K/V written at
        start..start+g-1), drafts [B, g] and the draft's log-probs [B, g, V]."""
        start = st.cache.lengths
        scores, guided = guide

        def step(carry, jj):
            ks, vs, cs, tok = list(carry[0]), list(carry[1]), list(carry[2]), carry[3]
            lengths = start + jj + 1
            budget = budget_for_lengths(budgets, lengths, bin_size)
            budget_blocks = jnp.minimum(budget // bs, max_selected).astype(jnp.int32)
            covered = budget >= lengths

            def guided_layer(i):
                """Layer i's draft attention with blocks ranked by the verify passes (unfused:
                the model hands it finished heads)."""
                def attend(q, k, v, k_cache, v_cache, centroids, lengths, budget_blocks,
                           covered, *unused_finish):   # finish: for the fused kernels only
                    k_cache = write_token(k_cache, k, lengths - 1)
                    v_cache = write_token(v_cache, v, lengths - 1)
                    out, centroids = guided_fn(q, k_cache, v_cache, centroids, lengths,
                                               budget_blocks, covered,
                                               scores[guided_layers.index(i)], guided)
                    return out, k_cache, v_cache, centroids
                return attend

            hidden = decode_step_hidden(model, attn_fns, [ks, vs, cs], tok, start + jj,
                                        budget_blocks, covered, cfg=cfg, spec=spec,
                                        own_attention={i: guided_layer(i) for i in guided_layers})
            x, q_logp = draft_sample(model.logits(hidden[:, 0]), rng=st.rng,
                                     sample_ids=st.sample_ids, index=st.response_lengths + jj,
                                     cfg=cfg)
            return (tuple(ks), tuple(vs), tuple(cs), x), (x, q_logp)

        c = st.cache
        if g == 0:          # a dense step: nothing drafted
            return ((list(c.k), list(c.v), list(c.centroids)), jnp.zeros((b, 0), jnp.int32),
                    jnp.zeros((b, 0, mcfg.vocab_size), jnp.float32))
        (ks, vs, cs, _), (xs, q_logp) = jax.lax.scan(step, (c.k, c.v, c.centroids, st.token),
                                                     jnp.arange(g))
        return (list(ks), list(vs), list(cs)), xs.T, q_logp.transpose(1, 0, 2)

    def verify(st: DecodeState, ks, vs, drafts):
        seq = jnp.concatenate([st.token[:, None], drafts], axis=1)             # [B, g+1]
        return verify_forward(model, ks, vs, st.cache.lengths, seq, backend=cfg.backend,
                              mass_layers=guided_layers, block_size=bs)

    def round_of(g: int):
        """One round of every row at draft length g (a row offers min(its bin's gamma, g))."""
        def run(carry):
            st, acc_buf, alpha_buf, guide = carry
            # Named scopes: a profile attributes each op to its phase (bench/exact.py).
            with jax.named_scope("exact_draft"):
                (ks, vs, cs), drafts, q_logp = draft(st, guide, g)
            with jax.named_scope("exact_verify"):
                ks, vs, p_logits, masses = verify(st, ks, vs, drafts)
            with jax.named_scope("exact_accept"):
                start, active = st.cache.lengths, ~st.done
                rd = accept_round(p_logits, q_logp, drafts, rng=st.rng, sample_ids=st.sample_ids,
                                  generated=st.response_lengths, active=active, cfg=cfg,
                                  limit=row_gamma(start) if cfg.plans_per_bin else None,
                                  approximate=row_approximate(start) if approx_from else None)
                cs = [refresh_centroids(c, k, start, start + rd.n_new, span=g + 1,
                                        block_size=bs) if sp else c
                      for c, k, sp in zip(cs, ks, sparse_layers)]
                scores, guided = guide
                scores = guide_scores(scores, masses, active)
                unverified = row_approximate(start) if g else jnp.zeros(b, bool)
                return finish(st, acc_buf, alpha_buf, ks, vs, cs, rd, g + 1,
                              (scores, guided | active), unverified)
        return run

    def approximate_only(carry):
        """Every active row is in an approximate bin: gamma + 1 sparse steps, unverified."""
        st, acc_buf, alpha_buf, guide = carry
        with jax.named_scope("exact_draft"):
            (ks, vs, cs), drafts, q_logp = draft(st, guide, cfg.gamma + 1)
        rd = approximate_round(q_logp, drafts, generated=st.response_lengths, active=~st.done,
                               cfg=cfg)
        return finish(st, acc_buf, alpha_buf, ks, vs, cs, rd, cfg.gamma + 1, guide,
                      jnp.ones(b, bool))

    def body(carry):
        if not cfg.plans_per_bin:
            return round_of(gammas[0])(carry)
        # The round drafts the longest gamma any active verified row's bin asks for; each row
        # offers its own bin's (verify.accept_round's limit), so its tokens are its bin's
        # rounds. Rounds where no active row verifies are one unverified sparse step.
        st = carry[0]
        start = st.cache.lengths
        verified = ~st.done & ~row_approximate(start)
        need = jnp.max(jnp.where(verified, row_gamma(start), 0))
        branch = jnp.where(jnp.any(verified),
                           jnp.searchsorted(jnp.asarray(gammas, jnp.int32), need), len(gammas))
        rounds = [round_of(g) for g in gammas] + ([approximate_only] if approx_from else [])
        branch = jnp.minimum(branch, len(rounds) - 1)
        if not counting:
            return run_one_branch(branch, rounds, carry)
        out = run_one_branch(branch, rounds, carry[:-1])
        return out + (carry[-1].at[branch].add(1),)

    def finish(st, acc_buf, alpha_buf, ks, vs, cs, rd, width: int, guide, unverified):
        """The round's records, lengths and done flags; rd's fields are [B, width];
        unverified [B]: rows whose kept tokens are unverified drafts (approximate bins)."""
        start, r, active = st.cache.lengths, st.response_lengths, ~st.done
        # Drafted token j (1-based) lands at response index r - 1 + j.
        j = jnp.arange(width)[None, :]
        at = jnp.where(j < rd.n_new[:, None], r[:, None] + j, t_new)   # t_new: dropped

        def put(buf, val):
            return buf.at[rows, at].set(val, mode="drop")
        new_len = start + rd.n_new
        done = st.done | (active & (rd.stopped | (r + rd.n_new >= t_new)
                                    | (new_len + cfg.gamma + 1 > s_max)))
        # An unverified (approximate) token records its draft budget, a verified one 0.
        drafted = budget_for_lengths(budgets, start[:, None] + j + 1, bin_size)
        used = jnp.where(unverified[:, None], drafted, 0)
        st = dataclasses.replace(
            st, step=st.step + 1, done=done, token=jnp.where(active, rd.last, st.token),
            tokens=put(st.tokens, rd.tokens), logprobs=put(st.logprobs, rd.logprobs),
            topk_logprobs=put(st.topk_logprobs, rd.topk_values),
            topk_ids=put(st.topk_ids, rd.topk_ids), budgets=put(st.budgets, used),
            response_lengths=r + rd.n_new,
            cache=KVCache(k=tuple(ks), v=tuple(vs), centroids=tuple(cs), lengths=new_len))
        return st, put(acc_buf, rd.accepted), put(alpha_buf, rd.alpha), guide

    def cond(carry):
        return ~jnp.all(carry[0].done)

    acc0 = jnp.zeros((b, t_new), bool)
    alpha0 = jnp.full((b, t_new), jnp.nan, jnp.float32)
    nb = s_max // bs
    guide0 = (tuple(jnp.zeros((b, mcfg.num_key_value_heads, nb), jnp.float32)
                    for _ in guided_layers), jnp.zeros((b,), bool))
    carry0 = (state, acc0, alpha0, guide0)
    if counting:
        carry0 += (jnp.zeros(len(cfg.round_branches), jnp.int32),)
    final = jax.lax.while_loop(cond, body, carry0)
    st, acc, alpha_buf = final[:3]
    steps = jnp.arange(t_new)
    mask = steps[None, :] < st.response_lengths[:, None]
    traj = Trajectories(
        prompt_tokens=st.prompt_tokens, prompt_lengths=st.prompt_lengths, tokens=st.tokens,
        logprobs=st.logprobs, topk_logprobs=st.topk_logprobs, topk_ids=st.topk_ids,
        budgets=jnp.where(mask, st.budgets, 0),
        cached_lengths=st.prompt_lengths[:, None] + steps[None, :], mask=mask,
        response_lengths=st.response_lengths, accepted=acc & mask,
        alpha=jnp.where(mask, alpha_buf, jnp.nan),
        round_counts=jnp.broadcast_to(final[-1], (b, final[-1].shape[0])) if counting else None)
    traj = jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1), spec), traj)
    return traj, (st.cache, st.step, st.token, st.done, st.rng, st.sample_ids)


def decode(model: Qwen3ForCausalLM, state: DecodeState, *, cfg: RolloutConfig, budgets,
           bin_size: int = 2000, spec: ShardingSpec | None = None) -> Trajectories:
    """Exact-sparse decode of `state` (from `start`, consumed); budgets [num_bins] int32 (the
    draft's), already checked. The state must have been prefilled with an exact_sparse config
    (its cache has gamma slots of slack: `RolloutConfig.cache_slots`)."""
    plen, t_new = state.prompt_tokens.shape[1], state.tokens.shape[1]
    need = cfg.cache_slots(plen)
    if state.cache.max_length < need or t_new != cfg.max_new_tokens:
        raise ValueError(f"exact_sparse decode needs a cache of {need} slots for prompt width "
                         f"{plen} (max_new_tokens={cfg.max_new_tokens} + gamma={cfg.gamma}); the "
                         f"state has {state.cache.max_length} slots and {t_new} new tokens: "
                         "prefill with the exact_sparse config")
    graphdef, params = nnx.split(model)
    # Re-planning: the plan is an input (a new one compiles nothing), cfg without it.
    cfg, table = cfg.traced_plan(len(budgets))
    COMPILES.note("rollout/decode", rows=state.tokens.shape[0], prompt_width=plen,
                  max_new_tokens=cfg.max_new_tokens, mode=cfg.mode, gamma=cfg.gamma,
                  gamma_by_bin=cfg.gamma_by_bin, approximate_from_bin=cfg.approximate_from_bin,
                  replan_gammas=cfg.replan_gammas, draft_scorer=cfg.draft_scorer,
                  max_budget=cfg.max_budget, dtype=jnp.dtype(model.dtype).name)
    traj, _ = decode_program_for(cfg)(graphdef, params, state, jnp.asarray(budgets),
                                      None if table is None else jnp.asarray(table), cfg=cfg,
                                      bin_size=bin_size, spec=spec)
    return traj


def decode_program_for(cfg: RolloutConfig):
    """`decode_program` compiled with cfg's GPU decode options
    (`RolloutConfig.decode_compiler_options`: itself at the defaults)."""
    return compiler_options.with_options(decode_program, DECODE_JIT, cfg.decode_compiler_options)


def acceptance_by_bin(traj: Trajectories, *, gamma: int | Sequence[int], bin_size: int,
                      drop_last_round: bool = False) -> list[dict]:
    """`acceptance_by_bin_arrays` of a trajectory batch (one process's rows; tokens that
    record a budget are unverified drafts of approximate bins, left out)."""
    return acceptance_by_bin_arrays(np.asarray(traj.accepted), np.asarray(traj.alpha),
                                    np.asarray(traj.mask) & (np.asarray(traj.budgets) == 0),
                                    np.asarray(traj.cached_lengths), gamma=gamma,
                                    bin_size=bin_size, drop_last_round=drop_last_round)


def acceptance_by_bin_arrays(acc: np.ndarray, alpha: np.ndarray, mask: np.ndarray,
                             cached: np.ndarray, *, gamma: int | Sequence[int], bin_size: int,
                             drop_last_round: bool = False) -> list[dict]:
    """Per length bin (of the cache length when a verify round started): measured tokens per
    verify pass (and its standard error over rounds) beside the prediction
    (1 - a^(g+1)) / (1 - a) from the bin's mean alpha; gamma: one for every bin, or per bin
    (`RolloutConfig.gamma_by_bin`, the last entry beyond; 0: dense steps, predicted 1).
    acc/alpha/mask/cached [B, T] as Trajectories.accepted/alpha/mask/cached_lengths (mask:
    the verified tokens; a row's unverified tokens, approximate bins', come after them).
    A round ends at each token the verify pass sampled (accepted False); rounds cut short by a
    stop or max_new_tokens count with the tokens they gave, unless `drop_last_round` leaves
    each row's last round out (the only one a stop or the length cap can cut short)."""
    per_bin: dict[int, list] = {}
    for r in range(acc.shape[0]):
        n = int(np.cumprod(mask[r]).sum())          # the row's leading verified tokens
        t = 1
        while t < n:                               # token 0 came from the prefill
            e = t
            while e < n - 1 and acc[r, e]:
                e += 1
            if drop_last_round and e == n - 1:
                break
            # The round started with cache length cached[r, t] - 1 (x_0 was fed).
            rec = per_bin.setdefault(int((cached[r, t] - 1) // bin_size), [[], []])
            rec[0].append(e - t + 1)
            rec[1].extend(a for a in alpha[r, t:e + 1] if np.isfinite(a))
            t = e + 1
    out = []
    for k in sorted(per_bin):
        sizes, alphas = np.asarray(per_bin[k][0], np.float64), per_bin[k][1]
        a = float(np.mean(alphas)) if alphas else float("nan")
        # Standard error of the mean over rounds (rounds of one row are not quite independent).
        se = float(sizes.std(ddof=1) / np.sqrt(len(sizes))) if len(sizes) > 1 else float("nan")
        g = int(gamma) if np.ndim(gamma) == 0 else int(gamma[min(k, len(gamma) - 1)])
        out.append({"bin": k, "gamma": g, "rounds": len(sizes),
                    "tokens_per_pass": float(sizes.mean()), "tokens_per_pass_se": se,
                    "mean_alpha": a,
                    "predicted": 1.0 if g == 0 else float(
                        speculative.expected_tokens_per_pass(a, g))})
    return out
