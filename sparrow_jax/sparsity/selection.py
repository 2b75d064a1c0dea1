"""Block top-k selection for sparse decode (SPEC.md section 1), in plain jit-friendly JAX.

The KV cache is split into blocks of ``block_size`` (16) tokens. Each full block has a centroid
(mean of its post-RoPE keys, accumulated in f32, stored in the cache dtype). Per KV head, a block's
score is the mean of the GQA group's query heads dotted with the centroid. We always keep block 0
(attention sink) and the last two blocks (local window incl. the partial current block), and fill
the rest of the budget with the top-scoring full blocks in between. If the sequence has no more
blocks than the budget, every block is selected (exactly dense).

Outputs feed ``pallas_kernels.block_sparse_decode``: indices ascending, valid entries first,
padding repeats the last valid id (so kernels re-read nothing for padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["block_centroids", "update_centroid", "block_minmax", "centroid_scores",
           "quest_scores", "select_from_scores", "select_blocks", "selected_keys"]

# Blocks always kept in the sparse regime: the sink (block 0) and the two most recent blocks.
NUM_RESERVED = 3


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


def _min_if_concrete(x: jax.Array) -> int | None:
    """min(x) when x is a concrete array, None under tracing (jit/vmap)."""
    try:
        return int(jnp.min(x)) if x.size else None
    except jax.errors.ConcretizationTypeError:
        return None


def select_from_scores(scores: jax.Array, lengths: jax.Array, budget_blocks: jax.Array, *,
                       max_selected: int, block_size: int = 16) -> tuple[jax.Array, jax.Array]:
    """Chooses the blocks to attend from per-block scores.

    Args:
      scores: [..., NB] f32 block scores (only full middle blocks' scores are used).
      lengths: [...] int32 tokens in the cache INCLUDING the current token.
      budget_blocks: [...] int32 blocks allowed (>= 3; clamped to [3, max_selected]; under jit a
        value < 3 cannot be rejected and is clamped to 3).
      max_selected: static K of the output (the largest budget in blocks).
      block_size: tokens per block.

    Returns:
      block_indices [..., max_selected] int32 ascending, valid first, padding repeats the last
      valid id; num_blocks [...] int32. With total = ceil(length / bs): if total <= budget, all
      blocks 0..total-1; else block 0, blocks total-2 and total-1, and the top (budget - 3)
      blocks among 1..total-3 by score (ties: lowest index wins).
    """
    if max_selected < NUM_RESERVED:
        raise ValueError(f"max_selected must be >= {NUM_RESERVED}, got {max_selected}")
    nb = scores.shape[-1]
    lead = scores.shape[:-1]
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), lead)
    budget_in = jnp.broadcast_to(jnp.asarray(budget_blocks, jnp.int32), lead)
    smallest = _min_if_concrete(budget_in)
    if smallest is not None and smallest < NUM_RESERVED:
        raise ValueError(f"budget_blocks must be >= {NUM_RESERVED} (sink + 2 local blocks), "
                         f"got min {smallest}")
    budget = jnp.clip(budget_in, NUM_RESERVED, max_selected)
    total = jnp.clip((lengths + block_size - 1) // block_size, 0, nb)
    slots = jnp.arange(max_selected, dtype=jnp.int32)

    # Dense regime: 0..total-1, padded with total-1 (or 0 for an empty row).
    dense_ids = jnp.minimum(slots, jnp.maximum(total - 1, 0)[..., None])

    # Sparse regime: sink + top-(budget-3) middle blocks + the last two blocks.
    k_top = min(max_selected - NUM_RESERVED, nb)
    blk = jnp.arange(nb, dtype=jnp.int32)
    cand = (blk >= 1) & (blk <= (total - 3)[..., None])                    # [..., NB]
    masked = jnp.where(cand, scores.astype(jnp.float32), -jnp.inf)
    big = jnp.int32(nb + max_selected)                                       # sorts last
    if k_top > 0:
        _, top_ids = lax.top_k(masked, k_top)            # score-descending, lowest index on ties
        rank = jnp.arange(k_top, dtype=jnp.int32)
        top_ids = jnp.where(rank < (budget - NUM_RESERVED)[..., None], top_ids.astype(jnp.int32),
                            big)
    else:
        top_ids = jnp.zeros(lead + (0,), jnp.int32)
    reserved = jnp.stack([jnp.zeros_like(total), total - 2, total - 1], axis=-1)
    parts = [reserved, top_ids]
    pad = max_selected - NUM_RESERVED - k_top
    if pad > 0:
        parts.append(jnp.full(lead + (pad,), big, jnp.int32))
    sparse_ids = jnp.sort(jnp.concatenate(parts, axis=-1), axis=-1)         # valid ones first
    last_valid = jnp.take_along_axis(sparse_ids, (budget - 1)[..., None], axis=-1)
    sparse_ids = jnp.where(slots < budget[..., None], sparse_ids, last_valid)

    is_dense = (total <= budget)[..., None]
    block_indices = jnp.where(is_dense, dense_ids, sparse_ids)
    num_blocks = jnp.where(total <= budget, total, budget)
    return block_indices.astype(jnp.int32), num_blocks.astype(jnp.int32)


def select_blocks(q: jax.Array, centroids: jax.Array, lengths: jax.Array,
                  budget_blocks: jax.Array, *, max_selected: int, block_size: int = 16,
                  scorer: str = "centroid", key_min: jax.Array | None = None,
                  key_max: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scores + selection for one decode step.

    q [B, Hq, D], centroids [B, Hkv, NB, D], lengths [B], budget_blocks [B] (or scalar) ->
    block_indices [B, Hkv, max_selected] int32, num_blocks [B, Hkv] int32.
    scorer: "centroid" (the paper's rule) or "quest" (needs key_min/key_max from block_minmax).
    """
    if scorer == "centroid":
        scores = centroid_scores(q, centroids)
    elif scorer == "quest":
        if key_min is None or key_max is None:
            raise ValueError("scorer='quest' needs key_min and key_max (see block_minmax)")
        scores = quest_scores(q, key_min, key_max)
    else:
        raise ValueError(f"unknown scorer {scorer!r}; expected 'centroid' or 'quest'")
    b, hkv = scores.shape[:2]
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32)[..., None], (b, hkv))
    budget = jnp.asarray(budget_blocks, jnp.int32)
    budget = jnp.broadcast_to(budget[:, None] if budget.ndim == 1 else budget, (b, hkv))
    return select_from_scores(scores, lengths, budget, max_selected=max_selected,
                              block_size=block_size)


def selected_keys(scores: jax.Array, positions: jax.Array, budget_blocks: jax.Array, *,
                  max_selected: int, block_size: int = 16) -> jax.Array:
    """The keys decode-time selection lets each query see, for a whole-sequence (teacher-forced)
    replay: scores [B, C, Hkv, NB] (over whole blocks), positions [B, C] of the queries,
    budget_blocks [B, C] -> [B, C, Hkv, NB * block_size] bool (causality not applied: a query at
    position p decoded with length p + 1, so its selection never picks a later block)."""
    b, c, hkv, nb = scores.shape
    lengths = jnp.broadcast_to((positions + 1)[..., None], (b, c, hkv))
    budget = jnp.broadcast_to(budget_blocks[..., None], (b, c, hkv)).astype(jnp.int32)
    idx, _ = select_from_scores(scores, lengths, budget, max_selected=max_selected,
                                block_size=block_size)
    # Padding repeats the last valid id, so scattering every entry marks exactly the selection.
    chosen = jnp.put_along_axis(jnp.zeros((b, c, hkv, nb), bool), idx, True, axis=-1,
                                inplace=False)
    return jnp.repeat(chosen, block_size, axis=-1)
