"""Whole-sequence attention for the training / teacher-forced forwards of `Qwen3ForCausalLM`.

A FullAttentionFn maps one layer's post-RoPE q/k/v of whole sequences to its attention output.
Long sequences run query-chunked (`map_query_chunks`, `map_causal_query_chunks`): one
[B, H, chunk, S] score block at a time, rematerialised in the backward pass. `alike_layers`
declares which layers an attention fn treats alike, so the model can scan over them.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp

Array = jax.Array


class FullAttentionFn(Protocol):
    def __call__(self, layer_idx: int, q: Array, k: Array, v: Array, positions: Array,
                 attention_mask: Array) -> Array: ...


def alike_layers(fn: FullAttentionFn, splits: tuple[int, ...] = ()) -> FullAttentionFn:
    """Declares that `fn` treats every layer alike except that its behaviour may change at the
    layer indices in `splits` (e.g. (2,) for "layers 0 and 1 dense, the rest sparse"), so
    that `run_layers` may scan runs of alike layers, calling `fn` with the run's first index."""
    fn.layer_splits = tuple(splits)
    return fn


def layer_splits_of(fn) -> tuple[int, ...] | None:
    """`alike_layers`' declaration of `fn`, or None when `fn` made none (layers stay unrolled)."""
    return getattr(fn, "layer_splits", None)


_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free


def masked_gqa_attention(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """GQA attention of C queries over S keys under an explicit visibility mask (f32 softmax).

    q [B, C, Hq, D], k/v [B, S, Hkv, D], visible [B, Hkv or 1, C, S] bool -> [B, C, Hq, D].
    """
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, c, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, :, None], scores * (d ** -0.5), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, c, hq, d).astype(q.dtype)


def _causal_attention_rows(q: Array, k: Array, v: Array, key_mask: Array, *,
                           q_offset) -> Array:
    """Queries at absolute indices q_offset.. against keys 0..S-1: key j is visible to query i
    iff j <= i and key_mask[j]. q [B, C, Hq, D], k/v [B, S, Hkv, D], key_mask [B, S] bool."""
    c, s_len = q.shape[1], k.shape[1]
    causal = jnp.arange(s_len)[None, :] <= (q_offset + jnp.arange(c))[:, None]      # [C, S]
    return masked_gqa_attention(q, k, v, (causal[None] & key_mask[:, None, :])[:, None])


def map_query_chunks(rows: Callable[[Array, Array, Array], Array], query_chunk: int, q: Array,
                     positions: Array) -> Array:
    """Whole-sequence attention `query_chunk` queries at a time.

    rows(q_chunk [B, C, Hq, D], positions_chunk [B, C], offset []) -> [B, C, Hq, D] computes the
    chunk whose first query has index `offset`. Runs as a `lax.scan` (so XLA cannot schedule
    the chunks side by side) whose body is rematerialised in the backward pass: forward and
    gradient hold one chunk's [B, H, C, S] scores at a time. q [B, T, Hq, D] -> [B, T, Hq, D].
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")
    b, t, hq, d = q.shape
    n = -(-t // query_chunk)
    pad = n * query_chunk - t          # padded queries (beyond T) are dropped at the end
    q_chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
        b, n, query_chunk, hq, d).swapaxes(0, 1)                          # [n, B, C, Hq, D]
    pos_chunks = jnp.pad(positions, ((0, 0), (0, pad)), mode="edge").reshape(
        b, n, query_chunk).swapaxes(0, 1)                                   # [n, B, C]
    offsets = jnp.arange(n, dtype=jnp.int32) * query_chunk
    body = jax.checkpoint(lambda xs: rows(*xs))
    _, out = jax.lax.scan(lambda carry, xs: (carry, body(xs)), None,
                          (q_chunks, pos_chunks, offsets))
    return out.swapaxes(0, 1).reshape(b, n * query_chunk, hq, d)[:, :t]


# Query chunks are scanned in at most this many groups, each against the keys its last query can
# see, so causal attention computes ~(1 + 1/groups)/2 of the full T x T scores instead of all of
# them, while the program unrolls only `groups` scans per layer (compile time stays flat at 32K).
CAUSAL_GROUPS = 8


def map_causal_query_chunks(rows: Callable[[Array, Array, Array, int], Array], query_chunk: int,
                            q: Array, positions: Array, *, groups: int = CAUSAL_GROUPS) -> Array:
    """`map_query_chunks` for causal attention: skips keys no query of a chunk can see.

    The chunks are split into up to `groups` consecutive groups; rows(q_chunk, positions_chunk,
    offset, key_end) is called with the static number of keys the group's queries may need
    (keys >= key_end are in every query's future) and must attend to keys [0, key_end) only.
    q [B, T, Hq, D] -> [B, T, Hq, D].
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")
    t = q.shape[1]
    n = -(-t // query_chunk)
    g = max(1, min(groups, n))
    bounds = [round(i * n / g) * query_chunk for i in range(g + 1)]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        hi = min(hi, t)
        outs.append(map_query_chunks(
            lambda q_c, p_c, offset, lo=lo, hi=hi: rows(q_c, p_c, offset + lo, hi),
            query_chunk, q[:, lo:hi], positions[:, lo:hi]))
    return jnp.concatenate(outs, axis=1)


def dense_causal_attention(layer_idx: int, q: Array, k: Array, v: Array, positions: Array,
                           attention_mask: Array) -> Array:
    """Exact causal GQA attention over a whole sequence.

    q [B, T, Hq, D], k/v [B, T, Hkv, D], attention_mask [B, T] (1 = real token). Causality is by
    index (key j visible to query i iff j <= i), so left- and right-padded batches both work.
    Materialises [B, Hq, T, T] scores: see `chunked_causal_attention` for long sequences.
    """
    del layer_idx, positions
    return _causal_attention_rows(q, k, v, attention_mask.astype(bool), q_offset=0)


alike_layers(dense_causal_attention)


def chunked_causal_attention(query_chunk: int) -> FullAttentionFn:
    """`dense_causal_attention`, computed `query_chunk` queries at a time
    (`map_causal_query_chunks`): one [B, Hq, query_chunk, <=T] score block at a time instead of
    [B, Hq, T, T], in the forward and the gradient, and only against keys some query of the
    group can see (about half the score FLOPs and bytes of the one-shot form). Same values.
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")

    def attention(layer_idx: int, q: Array, k: Array, v: Array, positions: Array,
                  attention_mask: Array) -> Array:
        del layer_idx
        key_mask = attention_mask.astype(bool)
        return map_causal_query_chunks(
            lambda q_c, _, offset, key_end: _causal_attention_rows(
                q_c, k[:, :key_end], v[:, :key_end], key_mask[:, :key_end], q_offset=offset),
            query_chunk, q, positions)

    return alike_layers(attention)
