"""Teacher-forced forwards over finished trajectories: dense (the learner's policy) and sparse.

The sparse forward reproduces the rollout's attention at every generated position in one
whole-sequence pass: each query at position t selects among the blocks before it with the same
rule, scores and budget the decode loop used (length t + 1, budget from the schedule bin), so its
log-probabilities of the sampled tokens equal the rollout's recorded ones, and full-vocabulary
acceptance rates can be computed exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sparrow_jax.model.attention import (alike_layers, chunked_causal_attention,
                                         dense_causal_attention, visible_causal_attention)
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout.config import padded_length
from sparrow_jax.rollout.state import Trajectories, budget_for_lengths
from sparrow_jax.sparsity import block_scores, selection


def build_sequences(traj: Trajectories, block_size: int = 16) -> tuple[jax.Array, jax.Array]:
    """Prompt ++ response per row, contiguous as in the KV cache.

    Returns tokens [B, S] (S = P + T padded to a block multiple) and attention mask [B, S].
    """
    b, plen = traj.prompt_tokens.shape
    t = traj.tokens.shape[1]
    s = padded_length(plen + t, block_size)
    seq = jnp.zeros((b, s), jnp.int32).at[:, :plen].set(
        jnp.where(jnp.arange(plen)[None] < traj.prompt_lengths[:, None], traj.prompt_tokens, 0))
    resp_idx = traj.prompt_lengths[:, None] + jnp.arange(t)[None]
    seq = jnp.put_along_axis(seq, resp_idx, jnp.where(traj.mask, traj.tokens, 0), axis=1,
                             inplace=False)
    total = traj.prompt_lengths + traj.response_lengths
    return seq, (jnp.arange(s)[None] < total[:, None]).astype(jnp.int32)


def response_hidden(hidden: jax.Array, traj: Trajectories) -> jax.Array:
    """hidden [B, S, H] -> [B, T, H]: the states whose logits predict each generated token."""
    t = traj.tokens.shape[1]
    idx = traj.prompt_lengths[:, None] - 1 + jnp.arange(t)[None]
    return jnp.take_along_axis(hidden, idx[..., None], axis=1)


# Block scorers the teacher-forced replay can use: "centroid" is the rollout's rule (the only
# one the KV cache supports); "quest" (per-block key bounds) and "oracle" (each block's true
# softmax mass, the best any block scorer could pick) exist to measure how much of the mismatch
# is the scorer's (sparrow_jax.bench.selection_quality).
REPLAY_SCORERS = ("centroid", "quest", "oracle")


def oracle_block_mass(q: jax.Array, keys: jax.Array, positions: jax.Array,
                      block_size: int) -> jax.Array:
    """Each block's share of the true causal attention, summed over each KV head's query group.

    q [B, C, Hq, D] at positions [B, C], keys [B, Hkv, S, D] (post-RoPE) -> [B, C, Hkv, S//bs]
    f32: sum over the group's heads of softmax(q.k / sqrt(D)) over keys <= position."""
    b, c, hq, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = q.astype(jnp.float32).reshape(b, c, hkv, hq // hkv, d)
    logits = jnp.einsum("bckgd,bksd->bckgs", qg, keys.astype(jnp.float32)) * (d ** -0.5)
    causal = jnp.arange(s)[None, None] <= positions[..., None]              # [B, C, S]
    probs = jax.nn.softmax(jnp.where(causal[:, :, None, None], logits, -jnp.inf), axis=-1)
    return probs.sum(3).reshape(b, c, hkv, s // block_size, block_size).sum(-1)


def sparse_attention_fn(*, budgets: jax.Array, bin_size: int, prompt_lengths: jax.Array,
                        max_selected: int, block_size: int = 16,
                        dense_layers: tuple[int, ...] = (0, 1), query_chunk: int = 0,
                        scorer: str = "centroid"):
    """A FullAttentionFn for `Qwen3ForCausalLM.hidden_states` that replays block top-k selection.

    Queries inside the prompt (prefill) and all queries of dense layers attend densely.
    query_chunk > 0 processes that many queries at a time (`map_causal_query_chunks`), so the
    [B, H, T, S] scores and the [B, T, Hkv, S] selection mask exist one chunk at a time.
    scorer: one of REPLAY_SCORERS (the rollout decodes with "centroid").
    """
    if scorer not in REPLAY_SCORERS:
        raise ValueError(f"scorer must be one of {REPLAY_SCORERS}, got {scorer!r}")
    dense_fn = chunked_causal_attention(query_chunk) if query_chunk else dense_causal_attention

    def attend(layer_idx, q, k, v, positions, attention_mask):
        if layer_idx in dense_layers:
            return dense_fn(layer_idx, q, k, v, positions, attention_mask)
        kt = k.transpose(0, 2, 1, 3)                                   # [B, Hkv, S, D]
        if scorer == "centroid":
            centroids = block_scores.block_centroids(kt, block_size)       # [B, Hkv, NB, D]
        elif scorer == "quest":
            key_min, key_max = block_scores.block_minmax(kt, block_size)
        key_mask = attention_mask.astype(bool)

        def chunk_scores(q_c, pos_c):
            """[B, C, Hkv, NB] scores of the queries q_c [B, C, Hq, D] at positions pos_c."""
            if scorer == "centroid":
                return block_scores.centroid_scores(q_c, centroids[:, None])
            if scorer == "quest":
                return block_scores.quest_scores(q_c, key_min[:, None], key_max[:, None])
            return oracle_block_mass(q_c, kt, pos_c, block_size)

        def visible(q_c, pos_c, q_idx, k_idx):
            """Which keys k_idx [M, C'] the queries q_c [B, C, Hq, D] at positions pos_c [B, C]
            see besides causality: all in the prompt, the blocks decode-time selection picked
            after it -> [B, Hkv, M, C, C'] (`map_causal_query_chunks`)."""
            scores = chunk_scores(q_c, pos_c)                                 # [B, C, Hkv, NB]
            budget = budget_for_lengths(budgets, pos_c + 1, bin_size)
            budget_blocks = jnp.minimum(budget // block_size, max_selected)
            chosen = selection.selected_blocks(scores, pos_c, budget_blocks,
                                               max_selected=max_selected,
                                               block_size=block_size)     # [B, C, Hkv, NB]
            # A budget covering the length is dense, also beyond the selection width (the
            # rollout's dense path for such rows, e.g. the controller's dense rung).
            chosen = chosen | (budget >= pos_c + 1)[..., None, None]
            is_decode = pos_c >= prompt_lengths[:, None]                         # [B, C]
            # Per block, not per key: k_idx's rows are runs of consecutive keys starting at
            # multiples of C' (`map_causal_query_chunks`; clipped to T - 1, which T % bs == 0
            # keeps inside one block), so with C' % bs == 0 each run of bs keys is one block and
            # the mask is gathered, transposed and combined bs times smaller, then repeated.
            runs = k_idx.shape[-1] % block_size == 0
            blk = k_idx[:, ::block_size] // block_size if runs else k_idx // block_size
            seen = jnp.where(is_decode[..., None, None, None], chosen[..., blk], True)
            seen = seen.transpose(0, 2, 3, 1, 4)                    # [B, Hkv, M, C, C'(/bs)]
            if runs:
                seen = jnp.repeat(seen, block_size, axis=-1)
            return seen & key_mask[:, k_idx][:, None, :, None]                # [B, Hkv, M, C, C']

        return visible_causal_attention(visible, query_chunk, q, k, v, positions)
    # Runs of dense layers and the sparse ones between them (`run_layers` scans each): a split
    # only where dense-ness changes, so adjacent dense layers (the default 0, 1) share one scan -
    # each run costs the compiler one attention body (`map_causal_query_chunks`).
    dense = set(dense_layers)
    return alike_layers(attend, tuple(sorted({j for i in dense for j in (i, i + 1)
                                              if (j in dense) != (j - 1 in dense)})))


def trajectory_hidden(model: Qwen3ForCausalLM, traj: Trajectories, *, attention_fn=None,
                      block_size: int = 16, remat: str | None = None,
                      residual_spec=None) -> jax.Array:
    """Final-normed hidden states that predict each generated token: [B, T, H].
    residual_spec: see `Qwen3ForCausalLM.run_layers`."""
    seq, mask = build_sequences(traj, block_size)
    positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
    hidden = model.hidden_states(seq, positions, mask, attention_fn=attention_fn, remat=remat,
                                 residual_spec=residual_spec)
    return response_hidden(hidden, traj)


def replay_hidden(model: Qwen3ForCausalLM, traj: Trajectories, budgets: jax.Array | None, *,
                  bin_size: int, max_selected: int, block_size: int = 16,
                  dense_layers: tuple[int, ...] = (0, 1), query_chunk: int = 0,
                  scorer: str = "centroid") -> jax.Array:
    """The teacher-forced forward every replay scores from: hidden states [B, T, H] predicting
    each response token, under the dense policy (budgets None) or the rollout's block-sparse
    attention replayed at the per-bin `budgets` [num_bins] (`sparse_attention_fn`)."""
    fn = None
    if budgets is not None:
        fn = sparse_attention_fn(budgets=budgets, bin_size=bin_size,
                                 prompt_lengths=traj.prompt_lengths, max_selected=max_selected,
                                 block_size=block_size, dense_layers=dense_layers,
                                 query_chunk=query_chunk, scorer=scorer)
    return trajectory_hidden(model, traj, attention_fn=fn, block_size=block_size)


def token_logprobs(model: Qwen3ForCausalLM, hidden: jax.Array, tokens: jax.Array, *,
                   temperature: float = 1.0, chunk: int = 256) -> jax.Array:
    """hidden [B, T, H], tokens [B, T] -> log p(token) [B, T], logits built `chunk` steps at a time
    so the full [B, T, V] tensor never exists."""
    def one(h, tok):
        logits = model.logits(h) / (temperature if temperature > 0 else 1.0)
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[..., None], -1)[..., 0]
    return map_time_chunks(one, chunk, hidden, tokens)


def map_time_chunks(fn, chunk: int, *arrays: jax.Array):
    """Applies fn to slices [:, i:i+chunk] of arrays shaped [B, T, ...]; concatenates on axis 1.

    A `lax.scan` over the chunks (T padded up to a multiple of `chunk`, the padding dropped
    from the result) whose body is rematerialised (`jax.checkpoint`): one chunk's [B, chunk, V]
    logits exist at a time, in the forward and in the backward pass, and a gradient saves only
    each chunk's inputs (e.g. hidden states [B, chunk, H]). An unrolled Python loop would let
    XLA schedule the chunks side by side: measured by `sparrow dryrun`, Qwen3-1.7B's gradient
    program at one 35K-token row kept ~[B, T, V] f32 alive (55 GiB at 3 layers).
    """
    t = arrays[0].shape[1]
    n = -(-t // chunk)
    if n == 1:
        return jax.checkpoint(fn)(*arrays)

    def to_chunks(a):
        a = jnp.pad(a, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(a.shape[0], n, chunk, *a.shape[2:]).swapaxes(0, 1)

    body = jax.checkpoint(lambda xs: fn(*xs))
    _, out = jax.lax.scan(lambda carry, xs: (carry, body(xs)), None,
                          tuple(to_chunks(a) for a in arrays))

    def from_chunks(x):
        x = x.swapaxes(0, 1)
        return x.reshape(x.shape[0], n * chunk, *x.shape[3:])[:, :t]
    return jax.tree.map(from_chunks, out)


@functools.partial(jax.jit, static_argnames=("graphdef", "bin_size", "max_selected",
                                             "block_size", "dense_layers", "sparse"))
def _rollout_logprobs(graphdef, state, traj, budgets, *, bin_size, max_selected, block_size,
                      dense_layers, sparse):
    from flax import nnx
    model = nnx.merge(graphdef, state)
    hidden = replay_hidden(model, traj, budgets if sparse else None, bin_size=bin_size,
                           max_selected=max_selected, block_size=block_size,
                           dense_layers=dense_layers)
    return jnp.where(traj.mask, token_logprobs(model, hidden, traj.tokens), 0.0)


def replay_logprobs(model: Qwen3ForCausalLM, traj: Trajectories, *, budgets=None,
                    bin_size: int = 2000, max_budget: int = 4096, block_size: int = 16,
                    dense_layers: tuple[int, ...] = (0, 1)) -> jax.Array:
    """Teacher-forced log p of the generated tokens [B, T] (T = 1): dense if budgets is None,
    else replaying the rollout's block-sparse attention."""
    from flax import nnx
    graphdef, state = nnx.split(model)
    sparse = budgets is not None
    budgets = jnp.zeros((1,), jnp.int32) if budgets is None else jnp.asarray(budgets, jnp.int32)
    return _rollout_logprobs(graphdef, state, traj, budgets, bin_size=bin_size,
                             max_selected=max_budget // block_size, block_size=block_size,
                             dense_layers=tuple(dense_layers), sparse=sparse)
