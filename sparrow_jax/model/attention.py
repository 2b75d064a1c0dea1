"""Whole-sequence attention for the training / teacher-forced forwards of `Qwen3ForCausalLM`.

A FullAttentionFn maps one layer's post-RoPE q/k/v of whole sequences to its attention output.
Long sequences run query-chunked (`map_causal_query_chunks`): two query chunks' causal key
blocks at a time, in one scan whose body is rematerialised in the backward pass. `alike_layers`
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


MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free


def masked_gqa_attention(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """GQA attention of C queries over S keys under an explicit visibility mask (f32 softmax).

    q [B, C, Hq, D], k/v [B, S, Hkv, D], visible [B, Hkv or 1, C, S] bool -> [B, C, Hq, D].
    """
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, c, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, :, None], scores * (d ** -0.5), MASK_VALUE)
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


def _per_row(x: Array, row: Array, reduce, fill: float) -> Array:
    """x [..., M, C] per block and query -> the figure of each block's query row: `reduce` over
    chunk a's blocks (row [M, 1]) or over chunk b's (the others), broadcast back to [..., M, C]."""
    xa = reduce(jnp.where(row, x, fill), axis=-2, keepdims=True)
    xb = reduce(jnp.where(row, fill, x), axis=-2, keepdims=True)
    return jnp.where(row, xa, xb)


@jax.custom_vjp
def _two_row_softmax(scores: Array, row: Array) -> Array:
    """Softmax of scores [..., M, C, E] over the blocks of each query row (chunk a's blocks,
    row [M, 1], or chunk b's) and their keys. A custom gradient, as jax.nn.softmax's: the
    backward keeps only the probabilities (one [..., M, C, E] f32 buffer, not the exponentials
    and the normaliser as well)."""
    return _two_row_softmax_fwd(scores, row)[0]


def _two_row_softmax_fwd(scores, row):
    p = jnp.exp(scores - _per_row(scores.max(-1), row, jnp.max, -jnp.inf)[..., None])
    probs = p / _per_row(p.sum(-1), row, jnp.sum, 0.0)[..., None]
    return probs, (probs, row)


def _two_row_softmax_bwd(res, g):
    probs, row = res
    dot = _per_row(jnp.sum(g * probs, -1), row, jnp.sum, 0.0)[..., None]
    return probs * (g - dot), None


_two_row_softmax.defvjp(_two_row_softmax_fwd, _two_row_softmax_bwd)


def _block_softmax_attention(q_sel: Array, k_sel: Array, v_sel: Array, visible: Array,
                             first: Array) -> tuple[Array, Array]:
    """Attention of two query chunks over blocks of keys, one block-matmul per block.

    q_sel [B, M, C, Hq, D] (block m's queries: chunk a where first[m], else chunk b), k_sel /
    v_sel [B, M, C, Hkv, D], visible [B, Hkv or 1, M, C, C] bool, first [M] bool -> (out_a,
    out_b), each [B, C, Hq, D]: chunk a's softmax runs over the blocks with first[m], chunk b's
    over the others (f32, as `masked_gqa_attention`; a fully masked row stays finite)."""
    b, m, c, hq, d = q_sel.shape
    hkv = k_sel.shape[3]
    qg = q_sel.reshape(b, m, c, hkv, hq // hkv, d)
    scores = jnp.einsum("bmckgd,bmekd->bkgmce", qg, k_sel, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, :, None], scores * (d ** -0.5), MASK_VALUE)
    row = first[:, None]                                                  # [M, 1]: a's blocks
    probs = _two_row_softmax(scores, row).astype(v_sel.dtype)
    out = jnp.einsum("bkgmce,bmekd->bkgmcd", probs, v_sel, preferred_element_type=jnp.float32)
    out_a = jnp.sum(jnp.where(row[:, :, None], out, 0.0), axis=3)         # [B, Hkv, G, C, D]
    out_b = jnp.sum(jnp.where(row[:, :, None], 0.0, out), axis=3)

    def heads(o):
        return o.transpose(0, 3, 1, 2, 4).reshape(b, c, hq, d).astype(q_sel.dtype)
    return heads(out_a), heads(out_b)


def map_causal_query_chunks(visible: Callable[[Array, Array, Array, Array], Array],
                            query_chunk: int, q: Array, k: Array, v: Array,
                            positions: Array) -> Array:
    """Causal attention `query_chunk` queries at a time, computing only the key blocks some
    query of a chunk can see, in one `lax.scan` (issue 40: one traced body, whatever the length).

    The n query chunks (n padded to even) are taken in pairs - chunk i with chunk n-1-i: the
    two see i+1 and n-i key blocks of `query_chunk` keys, n+1 together, so every scan step
    computes the same n+1 [C, C] score blocks (exactly the causal blocks, no masked-out
    future block beyond the diagonal ones). The step's body is rematerialised in the backward
    pass: forward and gradient hold one pair's [B, Hq, n+1, C, C] scores at a time.

    visible(q_c [B, C, Hq, D], pos_c [B, C], q_idx [C], k_idx [M, C]) -> [B, Hkv or 1, M, C, C]
    bool: whether query q_idx[c] of the chunk may see key k_idx[m, e] (indices into the
    sequence, < T), besides causality (k_idx <= q_idx), which is applied here.
    q [B, T, Hq, D], k/v [B, T, Hkv, D], positions [B, T] -> [B, T, Hq, D].
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")
    b, t, hq, d = q.shape
    hkv, c = k.shape[2], query_chunk
    n = -(-t // c)
    n += n % 2                         # pairs (i, n-1-i); padded queries are dropped at the end
    half, pad = n // 2, n * c - t
    q_chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, c, hq, d)
    pos_chunks = jnp.pad(positions, ((0, 0), (0, pad)), mode="edge").reshape(b, n, c)
    kb, vb = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, c, hkv, d)
              for x in (k, v))
    k_fwd, v_fwd = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0), (0, 0))) for x in (kb, vb))
    k_rev, v_rev = (jnp.pad(x[:, ::-1], ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))
                    for x in (kb, vb))
    blocks = jnp.arange(n + 1)

    def step(i):
        j = n - 1 - i
        first = blocks <= i                                               # [M]: chunk a's
        col = jnp.where(first, blocks, n - blocks)                        # key block per m
        k_idx = jnp.minimum(col[:, None] * c + jnp.arange(c)[None, :], t - 1)      # [M, C]
        # Chunk a's blocks 0..i at m = 0..i, chunk b's n-1-i..0 at m = i+1..n: both are static
        # layouts of K and V (as is, reversed), so XLA's SPMD partitioner splits the blocks
        # like the sequence (a gather or dynamic slice of the blocks replicated them, or held
        # a padded copy's cotangent: +1.4 / +1.5 GB of temporaries for Qwen3-0.6B on v5e-8).
        ks, vs = (jnp.where(first[None, :, None, None, None], fwd, rev) for fwd, rev in
                  ((k_fwd, k_rev), (v_fwd, v_rev)))
        qa, qb = q_chunks[:, i], q_chunks[:, j]
        q_sel = jnp.where(first[None, :, None, None, None], qa[:, None], qb[:, None])
        masks = []
        for chunk, q_c in ((i, qa), (j, qb)):
            q_idx = chunk * c + jnp.arange(c)
            causal = (col[:, None] * c + jnp.arange(c))[:, None, :] <= q_idx[None, :, None]
            masks.append(causal & visible(q_c, pos_chunks[:, chunk], q_idx, k_idx))
        vis = jnp.where(first[:, None, None], masks[0], masks[1])          # [B, H, M, C, C]
        return _block_softmax_attention(q_sel, ks, vs, vis, first)

    body = jax.checkpoint(step)
    _, (out_a, out_b) = jax.lax.scan(lambda carry, i: (carry, body(i)), None,
                                     jnp.arange(half, dtype=jnp.int32))  # [half, B, C, Hq, D]
    out = jnp.concatenate([out_a, out_b[::-1]], axis=0)                   # chunks 0..n-1
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n * c, hq, d)[:, :t]


def visible_causal_attention(visible: Callable[[Array, Array, Array, Array], Array],
                              query_chunk: int, q: Array, k: Array, v: Array,
                              positions: Array) -> Array:
    """Causal attention under `visible` (`map_causal_query_chunks`' callback), chunked when
    query_chunk > 0, else in one shot over [B, H, T, T] scores. Shapes as there."""
    if query_chunk:
        return map_causal_query_chunks(visible, query_chunk, q, k, v, positions)
    t = q.shape[1]
    idx = jnp.arange(t)
    mask = (idx[None, :] <= idx[:, None]) & visible(q, positions, idx, idx[None])[:, :, 0]
    return masked_gqa_attention(q, k, v, mask)


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
            lambda q_c, pos_c, q_idx, k_idx: key_mask[:, k_idx][:, None, :, None, :],
            query_chunk, q, k, v, positions)

    return alike_layers(attention)
