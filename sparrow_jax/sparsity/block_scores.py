"""Block metadata and block scores for sparse decode (docs/method.md): per 16-token block of the
KV cache its centroid (the mean post-RoPE key; kept up to date one block per decode step) or its
elementwise key bounds (Quest), and per KV head the score of every block for the current query -
what `selection` ranks. Pure functions on arrays, jit-friendly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["block_centroids", "block_minmax", "update_centroid", "centroid_scores",
           "quest_scores"]


def _blocked(keys: jax.Array, block_size: int) -> jax.Array:
    """[..., S, D] -> [..., S//bs, bs, D]; S must be a multiple of block_size."""
    *lead, s, d = keys.shape
    if s % block_size:
        raise ValueError(f"sequence length {s} is not a multiple of block_size={block_size}")
    return keys.reshape(*lead, s // block_size, block_size, d)


def block_centroids(keys: jax.Array, block_size: int = 16) -> jax.Array:
    """Mean key of every block. keys [..., S, D] (e.g. [B, Hkv, S, D]) -> [..., S//bs, D].

    Accumulates in f32 (bf16 sums of 16 keys lose ~2 digits) and returns keys.dtype.
    """
    kb = _blocked(keys, block_size)
    return jnp.mean(kb.astype(jnp.float32), axis=-2).astype(keys.dtype)


def block_minmax(keys: jax.Array, block_size: int = 16) -> tuple[jax.Array, jax.Array]:
    """Per-block elementwise min and max key (Quest metadata).
    keys [..., S, D] -> (kmin, kmax), each [..., S//bs, D] in keys.dtype."""
    kb = _blocked(keys, block_size)
    return jnp.min(kb, axis=-2), jnp.max(kb, axis=-2)


def update_centroid(centroids: jax.Array, k_cache: jax.Array, lengths: jax.Array,
                    block_size: int = 16) -> jax.Array:
    """Recomputes the centroid of the block that just became full, per row.

    centroids [B, Hkv, NB, D], k_cache [B, Hkv, S, D], lengths [B] = tokens in the cache after
    writing the new key. Rows with lengths % bs == 0 and lengths > 0 get block lengths//bs - 1
    recomputed; all other rows are returned unchanged. Cost: one [Hkv, bs, D] slice per row
    (dynamic_slice), not a full recompute, so it is cheap enough for every decode step.
    """
    b, hkv, nb, d = centroids.shape
    if k_cache.shape[:2] != (b, hkv) or k_cache.shape[-1] != d:
        raise ValueError(f"k_cache {k_cache.shape} does not match centroids {centroids.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]=[{b}], got {lengths.shape}")

    def one_row(c, kc, length):                        # c [Hkv, NB, D], kc [Hkv, S, D]
        full = (length > 0) & (length % block_size == 0)
        blk = jnp.clip(length // block_size - 1, 0, nb - 1)
        keys = lax.dynamic_slice_in_dim(kc, blk * block_size, block_size, axis=1)
        new = jnp.mean(keys.astype(jnp.float32), axis=1, keepdims=True).astype(c.dtype)
        old = lax.dynamic_slice_in_dim(c, blk, 1, axis=1)
        return lax.dynamic_update_slice_in_dim(c, jnp.where(full, new, old), blk, axis=1)

    return jax.vmap(one_row)(centroids, k_cache, lengths.astype(jnp.int32))


def _group_mean_query(q: jax.Array, hkv: int) -> jax.Array:
    """[..., Hq, D] -> [..., Hkv, D] f32: mean over each KV head's query group."""
    *lead, hq, d = q.shape
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    return jnp.mean(q.astype(jnp.float32).reshape(*lead, hkv, hq // hkv, d), axis=-2)


def centroid_scores(q: jax.Array, centroids: jax.Array) -> jax.Array:
    """Block scores = (group-mean query) . centroid, no scale, no softmax.

    q [..., Hq, D], centroids [..., Hkv, NB, D] -> [..., Hkv, NB] f32. Leading dims must be equal
    or broadcastable. Teacher-forced use: q [B, T, Hq, D] with centroids [B, 1, Hkv, NB, D];
    jnp.einsum treats the size-1 time axis of the centroids as a free axis of q (one batched
    matmul per (B, Hkv) with T*1 rows), so the centroids are never materialised T times.
    """
    hkv = centroids.shape[-3]
    qm = _group_mean_query(q, hkv)
    return jnp.einsum("...hd,...hnd->...hn", qm, centroids.astype(jnp.float32),
                      preferred_element_type=jnp.float32)


def quest_scores(q: jax.Array, key_min: jax.Array, key_max: jax.Array) -> jax.Array:
    """Quest-style upper bound on q.k within a block, with the group-mean query:
    sum_d max(q_d * kmin_d, q_d * kmax_d). q [..., Hq, D], key_min/key_max [..., Hkv, NB, D]
    -> [..., Hkv, NB] f32 (for comparison with the centroid rule)."""
    qm = _group_mean_query(q, key_min.shape[-3])[..., None, :]          # [..., Hkv, 1, D]
    lo = qm * key_min.astype(jnp.float32)
    hi = qm * key_max.astype(jnp.float32)
    return jnp.sum(jnp.maximum(lo, hi), axis=-1)
