"""XLA reference implementations of block-sparse and dense decode attention.

This is the production path on CPU (``backend="xla"``) and the ground truth the Pallas kernels
are tested against. It also hosts the input validation shared by every backend, so all of them
reject bad inputs with the same messages.

Shapes (one decode step, one new query token per sequence):
  q             [B, Hq, D]
  k, v          [B, Hkv, S, D]            S a multiple of block_size
  block_indices [B, Hkv, K] int32         valid entries first (ascending), padding repeats
                                          the last valid id
  num_blocks    [B, Hkv]    int32         number of valid entries per row
  lengths       [B]         int32         tokens at index >= length are masked
  out           [B, Hq, D]  (q.dtype)     lse [B, Hq] float32 (natural log)
Query head h attends with KV head h // (Hq // Hkv).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Finite "minus infinity" used inside kernels: exp(NEG_INF - x) underflows to exactly 0 in f32,
# while NEG_INF - NEG_INF stays 0 (a true -inf would give NaN in the online-softmax rescale).
NEG_INF = -1e30


def check_decode_inputs(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    block_size: int,
    block_indices: jax.Array | None = None,
    num_blocks: jax.Array | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Validates shapes/dtypes of decode inputs; returns (B, Hq, Hkv, S, D, G).

    Raises ValueError with a message naming the offending argument. All checks are static (shape
    and dtype only), so this is free under jit.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"k and v must be [B, Hkv, S, D], got {k.shape} and {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    b, hq, d = q.shape
    bk, hkv, s, dk = k.shape
    if bk != b:
        raise ValueError(f"batch mismatch: q has B={b}, k/v have B={bk}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has D={d}, k/v have D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a positive multiple of Hkv={hkv} (GQA groups)")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if s % block_size != 0:
        raise ValueError(f"S={s} must be a multiple of block_size={block_size}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]=[{b}], got {lengths.shape}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer, got {lengths.dtype}")
    if block_indices is not None:
        if block_indices.ndim != 3 or block_indices.shape[:2] != (b, hkv):
            raise ValueError(
                f"block_indices must be [B, Hkv, K]=[{b}, {hkv}, K], got {block_indices.shape}")
        if block_indices.shape[2] == 0:
            raise ValueError("block_indices must have K >= 1 entries per row")
        if not jnp.issubdtype(block_indices.dtype, jnp.integer):
            raise ValueError(f"block_indices must be integer, got {block_indices.dtype}")
    if num_blocks is not None:
        if num_blocks.shape != (b, hkv):
            raise ValueError(f"num_blocks must be [B, Hkv]=[{b}, {hkv}], got {num_blocks.shape}")
        if not jnp.issubdtype(num_blocks.dtype, jnp.integer):
            raise ValueError(f"num_blocks must be integer, got {num_blocks.dtype}")
    return b, hq, hkv, s, d, hq // hkv


def default_scale(d: int, scale: float | None) -> float:
    """Softmax scale: 1/sqrt(D) unless given."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _masked_softmax_attend(
    qg: jax.Array, keys: jax.Array, vals: jax.Array, mask: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """Exact masked attention for one query group per KV head.

    qg [B, Hkv, G, D], keys/vals [B, Hkv, T, D], mask [B, Hkv, T] (True = attend).
    Returns out [B, Hkv, G, D] f32 and lse [B, Hkv, G] f32; fully masked rows give 0 / -inf.
    """
    # f32 accumulation regardless of the cache dtype (bf16 logits lose ~3 digits).
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, keys, preferred_element_type=jnp.float32) * scale
    m3 = mask[:, :, None, :]
    s = jnp.where(m3, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    # A fully masked row has m = -inf; use 0 there so exp() never sees inf - inf.
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(m3, jnp.exp(s - m_safe), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgt,bhtd->bhgd", p.astype(vals.dtype), vals,
                   preferred_element_type=jnp.float32)
    # p cast to the value dtype mirrors the kernels (bf16 MXU/tensor-core inputs).
    safe_l = jnp.where(l > 0, l, 1.0)
    out = jnp.where(l > 0, o / safe_l, 0.0)
    lse = jnp.where(l > 0, m_safe + jnp.log(safe_l), -jnp.inf)[..., 0]
    return out, lse


def block_sparse_decode_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    num_blocks: jax.Array,
    lengths: jax.Array,
    *,
    block_size: int = 16,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gather-based block-sparse decode. Shapes as in the module docstring.

    One gather per KV head (shared by its G query heads): k is viewed as flat rows of blocks
    [B*Hkv*NB, bs, D] and indexed with flat block ids, which XLA:CPU turns into a tight memcpy
    loop (per-query-head or multi-dim gathers are pathologically slow there).
    """
    b, hq, hkv, s, d, g = check_decode_inputs(
        q, k, v, lengths, block_size=block_size, block_indices=block_indices,
        num_blocks=num_blocks)
    scale = default_scale(d, scale)
    nb = s // block_size
    kk = block_indices.shape[-1]
    bi = jnp.clip(block_indices.astype(jnp.int32), 0, nb - 1)
    row = (jnp.arange(b, dtype=jnp.int32)[:, None] * hkv
           + jnp.arange(hkv, dtype=jnp.int32)[None, :])               # [B, Hkv]
    flat_ids = (row[:, :, None] * nb + bi).reshape(-1)                # [B*Hkv*K]
    k_rows = k.reshape(b * hkv * nb, block_size, d)
    v_rows = v.reshape(b * hkv * nb, block_size, d)
    kg = k_rows.at[flat_ids].get(mode="promise_in_bounds")
    vg = v_rows.at[flat_ids].get(mode="promise_in_bounds")
    kg = kg.reshape(b, hkv, kk * block_size, d)
    vg = vg.reshape(b, hkv, kk * block_size, d)
    # Token position of every gathered slot; entries >= num_blocks (padding) are masked, as are
    # tokens at or beyond the sequence length (the partially filled last block).
    pos = (bi[..., None] * block_size
           + jnp.arange(block_size, dtype=jnp.int32)).reshape(b, hkv, kk * block_size)
    entry = jnp.arange(kk, dtype=jnp.int32)[None, None, :] < num_blocks[..., None]
    entry = jnp.repeat(entry, block_size, axis=-1)
    mask = entry & (pos < lengths.astype(jnp.int32)[:, None, None])
    qg = q.reshape(b, hkv, g, d)
    out, lse = _masked_softmax_attend(qg, kg, vg, mask, scale)
    return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def dense_decode_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode over all tokens < length (the baseline). Shapes as in the module docstring."""
    b, hq, hkv, s, d, g = check_decode_inputs(q, k, v, lengths, block_size=1)
    scale = default_scale(d, scale)
    mask = jnp.arange(s, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    mask = jnp.broadcast_to(mask[:, None, :], (b, hkv, s))
    out, lse = _masked_softmax_attend(q.reshape(b, hkv, g, d), k, v, mask, scale)
    return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def all_blocks_selection(
    b: int, hkv: int, s: int, lengths: jax.Array, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """The 'select everything' inputs: block_indices [B, Hkv, S//bs] = 0..NB-1 and
    num_blocks [B, Hkv] = ceil(length / bs). Used to run dense decode through sparse kernels."""
    nb = s // block_size
    idx = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, hkv, nb))
    n = (lengths.astype(jnp.int32) + block_size - 1) // block_size
    return idx, jnp.broadcast_to(n[:, None], (b, hkv))
