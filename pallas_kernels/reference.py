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

Paged form (the rollout engine's cache): K/V live in page pools [G, Hkv, N, bs, D] (a page = one
selection block); row b reads pool b // (B // G) through its page table [B, P] (logical block ->
physical page). The contiguous form above is the paged one with G = B and page i = block i
(``contiguous_as_pages``; ``dispatch.contiguous_view`` runs any backend's paged kernel on it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Finite "minus infinity" used inside kernels: exp(NEG_INF - x) underflows to exactly 0 in f32,
# while NEG_INF - NEG_INF stays 0 (a true -inf would give NaN in the online-softmax rescale).
NEG_INF = -1e30


def check_decode_inputs(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, block_size: int,
    block_indices: jax.Array | None = None, num_blocks: jax.Array | None = None,
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


# XLA:CPU allocates all temporaries of an execution as one buffer; past glibc's mmap threshold
# (32 MiB max) that buffer is mmap'ed fresh on every call and page-faulting it in costs more than
# the attention itself (a 4K-token budget at batch 1 ran 5x slower than 2K). Working in chunks of
# about this many gathered K+V bytes keeps temporaries small and the gathered data cache-hot.
CHUNK_BYTES = 4 << 20

Carry = tuple[jax.Array, jax.Array, jax.Array]


def _attend_chunk(carry: Carry | None, qg: jax.Array, keys: jax.Array, vals: jax.Array,
                  mask: jax.Array, scale: float, *, keys_lhs: bool) -> Carry:
    """Folds one chunk of tokens into the online-softmax state: running max m and normaliser l
    (the scores' reductions, G values per KV head), accumulator [B, Hkv, G, D] f32.

    carry None starts the state from this chunk. qg [B, Hkv, G, D], keys/vals [B, Hkv, T, D],
    mask [B, Hkv, T] (True = attend).
    keys_lhs: scores laid out [B, Hkv, T, G] with the keys as the dot's left operand, instead of
    [B, Hkv, G, T] = q . k^T. Measured on XLA:CPU at batch 16: on freshly gathered blocks the
    q . k^T dot packs a transposed copy of the keys and runs ~2x slower (sparse decode step
    23 -> 21 ms at 8K); on slices of the cache [G, T] does better (dense step at 16K: 122 ms
    vs 130-150 ms with keys_lhs).
    """
    # f32 accumulation regardless of the cache dtype (bf16 logits lose ~3 digits).
    if keys_lhs:
        s = jnp.einsum("bhtd,bhgd->bhtg", keys, qg, preferred_element_type=jnp.float32)
        t_axis, visible, pv_spec = 2, mask[..., None], "bhtg,bhtd->bhgd"
    else:
        s = jnp.einsum("bhgd,bhtd->bhgt", qg, keys, preferred_element_type=jnp.float32)
        t_axis, visible, pv_spec = 3, mask[:, :, None, :], "bhgt,bhtd->bhgd"
    # Masked scores are the finite NEG_INF, so no inf - inf guards are needed: while a row has
    # seen only masked tokens, m = NEG_INF and p = 1 accumulates garbage, which
    # alpha = exp(NEG_INF - m) = 0 wipes at its first real token, or `_finish` discards.
    s = jnp.where(visible, s * scale, NEG_INF)
    m_new = jnp.max(s, axis=t_axis, keepdims=True)
    if carry is not None:
        m_new = jnp.maximum(carry[0], m_new)
    p = jnp.exp(s - m_new)
    # p cast to the value dtype mirrors the kernels (bf16 MXU/tensor-core inputs).
    pv = jnp.einsum(pv_spec, p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    l_new = jnp.sum(p, axis=t_axis, keepdims=True)
    if carry is None:
        return m_new, l_new, pv
    m_prev, l_prev, acc = carry
    alpha = jnp.exp(m_prev - m_new)
    return m_new, alpha * l_prev + l_new, alpha.reshape(acc.shape[:3] + (1,)) * acc + pv


def _scan_chunks(chunk, n_chunks: int, upto: jax.Array | None = None) -> Carry:
    """Runs chunk(carry, c) for c = 0..n_chunks-1; the first chunk starts the state. With
    `upto` (a traced int), only the chunks c < min(upto, n_chunks) (at least the first): the
    caller knows the later ones change nothing (a while loop, not a scan)."""
    carry, _ = chunk(None, jnp.int32(0))
    if n_chunks > 1 and upto is None:
        carry, _ = lax.scan(chunk, carry, jnp.arange(1, n_chunks, dtype=jnp.int32))
    elif n_chunks > 1:
        need = jnp.minimum(upto, n_chunks)
        carry = lax.while_loop(lambda st: st[0] < need,
                               lambda st: (st[0] + 1, chunk(st[1], st[0])[0]),
                               (jnp.int32(1), carry))[1]
    return carry


def _finish(carry: Carry) -> tuple[jax.Array, jax.Array]:
    """out [B, Hkv, G, D] f32 and lse [B, Hkv, G]; rows that saw no token give 0 / -inf."""
    acc = carry[2]
    m, l = (x.reshape(acc.shape[:3]) for x in carry[:2])
    ok = m > 0.5 * NEG_INF                      # saw a real token (then l >= 1)
    safe_l = jnp.where(ok, l, 1.0)
    out = jnp.where(ok[..., None], acc / safe_l[..., None], 0.0)
    lse = jnp.where(ok, m + jnp.log(safe_l), -jnp.inf)
    return out, lse


def _chunk_count(total: int, bytes_per_unit: int) -> tuple[int, int]:
    """(units per chunk, number of chunks) so a chunk holds about CHUNK_BYTES."""
    per = max(1, min(total, CHUNK_BYTES // max(1, bytes_per_unit)))
    return per, -(-total // per)


def check_paged_inputs(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array,
) -> tuple[int, int, int, int, int, int, int, int]:
    """Validates paged decode inputs; returns (B, Hq, Hkv, G_pools, N_pages, bs, D, rows_per_pool).

    k_pages/v_pages [G, Hkv, N, bs, D]: G page pools (one per data shard; the contiguous view
    has G = B); row b reads pool b // (B // G). page_table [B, P] int32 physical page ids (within
    the row's pool) of the row's logical blocks 0..P-1.
    """
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [G, Hkv, N, bs, D], got "
                         f"{k_pages.shape} and {v_pages.shape}")
    pools, hkv, n_pages, bs, d = k_pages.shape
    # The per-row checks are those of the contiguous form (k viewed as [B, Hkv, *, D]).
    b = q.shape[0] if q.ndim == 3 else -1
    view = jax.ShapeDtypeStruct((b, hkv, bs, d), k_pages.dtype)
    check_decode_inputs(q, view, view, lengths, block_size=bs, block_indices=block_indices,
                        num_blocks=num_blocks)
    if pools == 0 or b % pools:
        raise ValueError(f"batch B={b} must be a multiple of the number of page pools G={pools}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.shape[1] == 0:
        raise ValueError(f"page_table must be [B, P]=[{b}, P >= 1], got {page_table.shape}")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be integer, got {page_table.dtype}")
    return b, q.shape[1], hkv, pools, n_pages, bs, d, b // pools


def check_page_ids(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array,
) -> tuple[int, int, int, int, int, int, int, int]:
    """``check_paged_inputs`` for the kernels' own form, which takes the composed physical page
    ids [B, Hkv, K] (``physical_pages``) instead of the page table; same return value."""
    b = q.shape[0] if q.ndim == 3 else 1
    # Stand-in table: everything but the page ids is validated exactly as the public entry does.
    dims = check_paged_inputs(q, k_pages, v_pages, jax.ShapeDtypeStruct((b, 1), jnp.int32),
                              block_indices, num_blocks, lengths)
    if page_ids.shape != block_indices.shape:
        raise ValueError(f"page_ids must be [B, Hkv, K] like block_indices "
                         f"{block_indices.shape}, got {page_ids.shape}")
    if not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be integer, got {page_ids.dtype}")
    return dims


class SelectedPages(NamedTuple):
    """A selection in the kernels' own form (what they read per entry): per (row, KV head) the
    physical page and the logical block of each entry, valid entries first, and their count."""
    page_ids: jax.Array          # [B, Hkv, K] int32 pages in the row's pool
    block_indices: jax.Array     # [B, Hkv, K] int32 logical blocks (the length mask)
    num_blocks: jax.Array        # [B, Hkv] int32 valid entries


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight", "cos", "sin"],
                   meta_fields=["eps"])
@dataclasses.dataclass(frozen=True)
class HeadFinish:
    """What makes a projected query or key head the one attention uses, for a kernel that
    applies it as it reads the head (the Pallas Triton decode kernels): the model's per-head
    RMSNorm, then RoPE at each row's position (`sparrow_jax.model.qwen3.RMSNorm`, `apply_rope`,
    in the head's dtype)."""
    weight: jax.Array        # [D] the RMSNorm weight
    cos: jax.Array           # [B, D] f32 RoPE table at each row's position
    sin: jax.Array           # [B, D] f32
    eps: float               # the RMSNorm epsilon (static)


def physical_pages(page_table: jax.Array, block_indices: jax.Array) -> jax.Array:
    """Physical page id of every selected logical block: page_table [B, P], block_indices
    [B, Hkv, K] -> [B, Hkv, K] int32 (logical ids clamped to the table, page ids to >= 0)."""
    p = page_table.shape[1]
    logical = jnp.clip(block_indices.astype(jnp.int32), 0, p - 1)
    pages = jnp.take_along_axis(page_table.astype(jnp.int32)[:, None, :], logical, axis=2)
    return jnp.maximum(pages, 0)


def paged_block_sparse_decode_xla(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array, *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gather-based block-sparse decode over a page pool (inputs validated by the caller).

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D]; page_ids [B, Hkv, K] physical pages to
    read; block_indices [B, Hkv, K] their logical block ids (only for the length mask);
    num_blocks [B, Hkv]; lengths [B]. Cost follows K (the selection width), not the pool size.

    One gather per KV head (shared by its G query heads): the pool is viewed as flat rows of
    pages [G*Hkv*N, bs*D] and indexed with flat page ids, which XLA:CPU turns into a tight memcpy
    loop (per-query-head or multi-dim gathers are pathologically slow there). Large selections
    are processed in chunks of entries (a scan with online softmax), see CHUNK_BYTES.
    """
    b, hq, d = q.shape
    pools, hkv, n_pages, block_size, _ = k_pages.shape
    scale = default_scale(d, scale)
    kk = page_ids.shape[-1]
    per, n_chunks = _chunk_count(kk, 2 * b * hkv * block_size * d * k_pages.dtype.itemsize)
    pid = jnp.clip(page_ids.astype(jnp.int32), 0, n_pages - 1)
    bi = block_indices.astype(jnp.int32)
    if per * n_chunks != kk:     # pad with the last entry; padding is >= num_blocks, so masked
        extra = per * n_chunks - kk
        pid = jnp.concatenate([pid, jnp.repeat(pid[..., -1:], extra, axis=-1)], -1)
        bi = jnp.concatenate([bi, jnp.repeat(bi[..., -1:], extra, axis=-1)], -1)
    pool = jnp.arange(b, dtype=jnp.int32) // (b // pools)
    row = pool[:, None] * hkv + jnp.arange(hkv, dtype=jnp.int32)[None, :]   # [B, Hkv]
    # Rows of whole pages, [G*Hkv*N, bs*D]: XLA:CPU gathers these 2-D rows ~1.6x faster than
    # [.., bs, D] slices of a 3-D view (1.55 vs 2.43 ms for 17 MB at batch 16).
    k_rows = k_pages.reshape(pools * hkv * n_pages, block_size * d)
    v_rows = v_pages.reshape(pools * hkv * n_pages, block_size * d)
    qg = q.reshape(b, hkv, hq // hkv, d)
    lens = lengths.astype(jnp.int32)[:, None, None]
    offs = jnp.arange(block_size, dtype=jnp.int32)

    def chunk(carry: Carry | None, c: jax.Array) -> tuple[Carry, None]:
        ids = lax.dynamic_slice_in_dim(pid, c * per, per, axis=2)        # [B, Hkv, per]
        logical = lax.dynamic_slice_in_dim(bi, c * per, per, axis=2)
        # Materialise the row ids first: fused into the gather, XLA:CPU recomputes this index
        # arithmetic for every copied element.
        flat = lax.optimization_barrier((row[:, :, None] * n_pages + ids).reshape(-1))
        kg = k_rows.at[flat].get(mode="promise_in_bounds").reshape(b, hkv, per * block_size, d)
        vg = v_rows.at[flat].get(mode="promise_in_bounds").reshape(b, hkv, per * block_size, d)
        # Entries >= num_blocks (padding) are masked, as are tokens at or beyond the length
        # (the partially filled last block).
        entry = (c * per + jnp.arange(per, dtype=jnp.int32)) < num_blocks[..., None]
        pos = logical[..., None] * block_size + offs
        mask = (entry[..., None] & (pos < lens[..., None])).reshape(b, hkv, per * block_size)
        return _attend_chunk(carry, qg, kg, vg, mask, scale, keys_lhs=True), None

    # Only the chunks up to the largest num_blocks: valid entries come first, so the chunks past
    # it are padding for every row, whose online-softmax update is an exact no-op. Dense decode
    # through this path (every block of the page table selected) then reads the pages of the
    # longest row, not the whole table: a wide page-table bucket costs no gathers (as in the
    # kernels, which loop to each row's num_blocks).
    upto = (jnp.max(num_blocks).astype(jnp.int32) + per - 1) // per
    out, lse = _finish(_scan_chunks(chunk, n_chunks, upto))
    return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def contiguous_as_pages(k: jax.Array, block_size: int) -> jax.Array:
    """The contiguous cache [B, Hkv, S, D] as B page pools [B, Hkv, S // bs, bs, D] whose page
    ids equal the logical block ids (a reshape: no copy)."""
    b, hkv, s, d = k.shape
    return k.reshape(b, hkv, s // block_size, block_size, d)


def dense_decode_xla(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode over all tokens < length (the baseline). Shapes as in the module docstring.

    Long caches are processed in chunks along S (online softmax) so the f32 score temporaries
    stay small, exactly as the sparse path does; the chunk size divides S. (Also measured at
    batch 16: one pass over the whole cache with keys_lhs scores, 10% faster at 8K but 10-20%
    slower at 16K than these chunks.)
    """
    b, hq, hkv, s, d, g = check_decode_inputs(q, k, v, lengths, block_size=1)
    scale = default_scale(d, scale)
    # Temporaries per token: the K/V chunk slices (if XLA materialises them) and f32 logits and
    # probabilities for the G query heads.
    want, _ = _chunk_count(s, b * hkv * (2 * d * k.dtype.itemsize + 8 * g))
    per = s if want >= s else max(t for t in range(1, want + 1) if s % t == 0)
    n_chunks = s // per
    qg = q.reshape(b, hkv, g, d)
    lens = lengths.astype(jnp.int32)[:, None, None]

    def chunk(carry: Carry | None, c: jax.Array) -> tuple[Carry, None]:
        kc = lax.dynamic_slice_in_dim(k, c * per, per, axis=2)
        vc = lax.dynamic_slice_in_dim(v, c * per, per, axis=2)
        pos = c * per + jnp.arange(per, dtype=jnp.int32)
        mask = jnp.broadcast_to(pos[None, None, :] < lens, (b, hkv, per))
        return _attend_chunk(carry, qg, kc, vc, mask, scale, keys_lhs=False), None

    out, lse = _finish(_scan_chunks(chunk, n_chunks))
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
