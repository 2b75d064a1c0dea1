"""Block selection for sparse decode as one Pallas kernel lowered to Triton (NVIDIA GPUs).

Why a kernel: on an H200 the XLA form of the selection (``sparrow_jax.sparsity.selection``:
a radix select in 8 passes + a bit-packed compaction) compiles to ~27 small kernels per sparse
layer; at Qwen3-1.7B decode shapes they cost ~3x the sparse attention they choose blocks for, and
their launches left the GPU idle half of every decode step (docs/devices/2026-11-27-nvidia-h200-
profile.md). Here the whole rule, from block scores to the ascending id list, is one launch.

The rule (the contract of ``selection.select_from_scores``, whose XLA form and the former
``lax.top_k`` + sort form ``select_from_scores_reference`` are this kernel's references in the
tests): per row, with total = the row's blocks and budget in [3, K],
  * total <= budget: every block 0..total-1 (dense);
  * else block 0, blocks total-2 and total-1, and the (budget - 3) best-scoring blocks among
    1..total-3, ties to the lowest index, scores ranked in IEEE total order;
ids ascending, padded after `num` entries with total - 1 (0 for an empty row).

Design: grid = (rows,), one program per (row, KV head); the row's scores are one power-of-two
vector in registers.
  * The (budget-3)-th largest order key is built bit by bit from the top (32 passes, each a
    compare and a block-wide count: no sort, no histogram memory).
  * The blocks above it, then the lowest-index ties (an inclusive cumsum of the tie mask) make
    the kept mask; a cumsum of the mask gives each kept block its output slot.
  * Compaction without a scatter: slot j's id is the sum of the block ids whose slot is j, over
    chunks of C slots x NB blocks, C chosen so a chunk stays ~8K elements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import pallas_triton as _triton
from pallas_kernels.reference import HeadFinish, SelectedPages

NUM_RESERVED = 3                      # sink + the two most recent blocks (selection.NUM_RESERVED)
_SIGN = np.int32(-2**31)
_CHUNK_ELEMENTS = 8192                # slots x blocks compared at once in the compaction


def _wrap32(x: int) -> int:
    """An unsigned 32-bit pattern as the int32 with the same bits."""
    return ((x + 2**31) % 2**32) - 2**31


def _kept_blocks(key, blk, total, budget, *, nb: int, radix_bits: int):
    """The selection rule on one row's order keys key [NB] (int32, signed order = IEEE total
    order of the scores): (keep [NB] bool, num). Module docstring: the rule."""
    cand = (blk >= 1) & (blk <= total - NUM_RESERVED)
    k_top = budget - NUM_RESERVED

    # The k-th largest candidate key, its unsigned form (key ^ sign) built from the top digit:
    # per pass, the counts at or above prefix | d for every digit d (one [2^r, NB] compare and
    # reduction: fewer passes, each wider), and the largest d whose count still reaches k.
    kth = jnp.int32(0)
    digits = 1 << radix_bits
    for shift in range(32 - radix_bits, -1, -radix_bits):
        if radix_bits == 1:
            probe = kth | np.int32(_wrap32(1 << shift))
            count = jnp.sum(jnp.where(cand & (key >= (probe ^ _SIGN)), 1, 0))
            kth = jnp.where(count >= k_top, probe, kth)
            continue
        d = lax.broadcasted_iota(jnp.int32, (digits, nb), 0)
        probe = kth | (d << shift)                                   # [2^r, NB] (wraps: bits)
        hits = jnp.where(cand[None, :] & (key[None, :] >= (probe ^ _SIGN)), 1, 0)
        counts = jnp.sum(hits, axis=1)                               # [2^r], monotone in d
        digit = jnp.sum(jnp.where(counts >= k_top, 1, 0)) - 1        # d = 0 always counts
        kth = kth | (jnp.maximum(digit, 0) << shift)
    kth = kth ^ _SIGN
    above = cand & (key > kth)
    tied = cand & (key == kth)
    room = k_top - jnp.sum(jnp.where(above, 1, 0))
    tie_rank = jnp.cumsum(jnp.where(tied, 1, 0))                       # inclusive, 1-based
    top = above | (tied & (tie_rank <= room))
    reserved = (blk == 0) | (blk >= total - 2)
    dense = total <= budget
    live = blk < total
    keep = jnp.where(dense, live, top | (reserved & live))
    return keep, jnp.where(dense, total, budget)


def _order_key(s):
    """f32 scores -> int32 keys whose signed order is IEEE total order (negatives' low bits
    flipped)."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)


def _compact(keep, blk, num, fill, store, *, nb: int, slots: int, chunk: int):
    """Compaction without a scatter: slot j's id is the sum of the block ids whose output slot
    is j, over chunks of C slots x NB blocks, for the chunks that hold the first num slots;
    the chunks past them hold only fill (no compare). store(start, ids [C]) writes slots
    start .. start + C - 1."""
    slot_of = jnp.cumsum(jnp.where(keep, 1, 0)) - 1                    # output slot per block
    lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def body(c, carry):
        slot = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, nb), 0)
        hit = keep[None, :] & (slot_of[None, :] == slot)
        ids = jnp.sum(jnp.where(hit, blk[None, :], 0), axis=1)          # [chunk]
        store(c * chunk, jnp.where(c * chunk + lane < num, ids, fill))
        return carry

    def fill_body(c, carry):
        store(c * chunk, jnp.zeros((chunk,), jnp.int32) + fill)
        return carry

    used = jnp.minimum((num + chunk - 1) // chunk, slots // chunk)
    lax.fori_loop(0, used, body, 0)
    lax.fori_loop(used, slots // chunk, fill_body, 0)


def _kernel(scores_ref, total_ref, budget_ref, ids_ref, num_ref, *, nb: int, width: int,
            chunk: int, radix_bits: int):
    """scores_ref [NBp] f32; total_ref/budget_ref [1] int32; ids_ref [Kp] int32; num_ref [1]."""
    blk = lax.broadcasted_iota(jnp.int32, (nb,), 0)
    total = total_ref[0]
    keep, num = _kept_blocks(_order_key(scores_ref[...]), blk, total, budget_ref[0], nb=nb,
                             radix_bits=radix_bits)

    def store(start, ids):
        ids_ref[pl.ds(start, chunk)] = ids

    _compact(keep, blk, num, jnp.maximum(total - 1, 0), store, nb=nb, slots=width, chunk=chunk)
    num_ref[...] = jnp.full((1,), num, jnp.int32)



def _check_launch(width: int) -> None:
    """What both entry points need: a selection width that holds the reserved blocks, and
    Triton's Pallas backend."""
    if width < NUM_RESERVED:
        raise ValueError(f"width must be >= {NUM_RESERVED}, got {width}")
    if _triton.pltriton is None:
        raise RuntimeError(_triton.status()[1])


def _slot_chunk(nbp: int, kp: int) -> int:
    """Selected slots compacted per pass for a row of nbp scores (a power of two) and kp slots:
    about _CHUNK_ELEMENTS elements of the [chunk, nbp] comparison a pass holds."""
    return max(1, min(kp, _triton.next_pow2(max(1, _CHUNK_ELEMENTS // nbp))))

def select_ids_triton(scores: jax.Array, total: jax.Array, budget: jax.Array, *, width: int,
                      radix_bits: int = 1, num_warps: int | None = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """scores [R, NB] f32 block scores; total [R] int32 blocks in the row (<= NB); budget [R]
    int32 already clamped to [3, width] -> (ids [R, width] int32 ascending, padded with
    total - 1; num [R] int32). The rule: module docstring. radix_bits (1, 2 or 4): digits per
    pass of the k-th key's search (32 / radix_bits passes of 2^radix_bits counts; the ids do not
    depend on it; which is fastest on a GPU is not measured yet). num_warps: None = by row
    length."""
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits}")
    if scores.ndim != 2 or total.shape != scores.shape[:1] or budget.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [R, NB] and total/budget [R]; got {scores.shape}, "
                         f"{total.shape}, {budget.shape}")
    _check_launch(width)
    rows, nb = scores.shape
    nbp, kp = _triton.next_pow2(nb), _triton.next_pow2(width)
    chunk = _slot_chunk(nbp, kp)
    if nbp != nb:      # padding blocks are never candidates: blk >= total for every row
        scores = jnp.pad(scores, ((0, 0), (0, nbp - nb)))
    # More warps for longer rows: the row's vectors live in registers (4 warps up to 2K blocks).
    num_warps = num_warps or min(16, max(4, nbp // 512))
    kernel = functools.partial(_kernel, nb=nbp, width=kp, chunk=chunk, radix_bits=radix_bits)
    scalar = pl.BlockSpec((None, 1), lambda r: (r, 0))
    ids, num = pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, nbp), lambda r: (r, 0)), scalar, scalar],
        out_specs=[pl.BlockSpec((None, kp), lambda r: (r, 0)), scalar],
        out_shape=[jax.ShapeDtypeStruct((rows, kp), jnp.int32),
                   jax.ShapeDtypeStruct((rows, 1), jnp.int32)],
        compiler_params=_triton.pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="sparrow_block_select_triton",
    )(scores.astype(jnp.float32), total.astype(jnp.int32)[:, None],
      budget.astype(jnp.int32)[:, None])
    return ids[:, :width], num[:, 0]


# Blocks whose centroids one step of the fused kernel's scoring reads ([C, D] at once).
SCORE_CHUNK = 32


def _pages_kernel(len_ref, budget_ref, *refs, group: int, nb: int, slots: int, chunk: int,
                  block_size: int, radix_bits: int, barrier: bool, finish_eps: float | None,
                  tabled: bool):
    """One (row, KV head): scores, selection and page lookup.

    len_ref [1] tokens in the row (with the current one); budget_ref [1] its budget in blocks
    (clamped here to [3, K]); tabled: table_ref [P] its page table (else page i holds block i:
    a contiguous cache's centroids); q_ref [G, D] the KV head's query
    group (with finish_eps: raw projected heads, and qw_ref [D], cos_ref / sin_ref [D] follow
    it, `pallas_triton.finished_rows`); c_ref [N, D] the centroids of the row's pool, this KV
    head. Outputs: scores_ref
    [NBp] f32 the row's block scores (blocks < its block count; also this kernel's scratch:
    written in chunks, read back whole), pid_ref / blk_ref [K] the selected entries' pages
    and logical blocks (ascending, padded with the last block), num_ref [1]."""
    refs = list(refs)
    table_ref = refs.pop(0) if tabled else None
    q_ref = refs.pop(0)
    finish_refs = [refs.pop(0) for _ in range(3)] if finish_eps is not None else []
    c_ref, scores_ref, pid_ref, blk_ref, num_ref = refs
    n_pages = c_ref.shape[0]
    width = table_ref.shape[0] if tabled else n_pages
    k = pid_ref.shape[0]
    total = jnp.clip((len_ref[0] + block_size - 1) // block_size, 0, width)
    budget = jnp.clip(budget_ref[0], NUM_RESERVED, k)
    # The group-mean query (f32), as `block_scores.centroid_scores`.
    gq = _triton.next_pow2(group)
    rows = lax.broadcasted_iota(jnp.int32, (gq,), 0)
    q_rows = jnp.minimum(rows, group - 1)
    if finish_refs:
        q = _triton.finished_rows(lambda cols: q_ref[q_rows[:, None], cols[None, :]],
                                  *finish_refs, eps=finish_eps)
    else:
        q = q_ref[q_rows]
    q = q.astype(jnp.float32)                                                   # [Gq, D]
    qm = jnp.sum(jnp.where(rows[:, None] < group, q, 0.0), axis=0) / group      # [D]

    def page_of(blocks):
        blocks = jnp.minimum(blocks, width - 1)
        return jnp.clip(table_ref[blocks] if tabled else blocks, 0, n_pages - 1)

    def score(c, carry):        # blocks c*C .. c*C + C - 1: their centroids, by page table
        blocks = c * SCORE_CHUNK + lax.broadcasted_iota(jnp.int32, (SCORE_CHUNK,), 0)
        cents = c_ref[page_of(blocks)].astype(jnp.float32)                     # [C, D]
        scores_ref[pl.ds(c * SCORE_CHUNK, SCORE_CHUNK)] = jnp.sum(cents * qm[None, :], axis=1)
        return carry

    # Only the row's blocks: no later block is ever a candidate (their scores are not read).
    lax.fori_loop(0, (total + SCORE_CHUNK - 1) // SCORE_CHUNK, score, 0)
    if barrier:        # the chunks' stores are visible to every thread of the program
        _triton.pltriton.debug_barrier()
    blk = lax.broadcasted_iota(jnp.int32, (nb,), 0)
    keep, num = _kept_blocks(_order_key(scores_ref[...]), blk, total, budget, nb=nb,
                             radix_bits=radix_bits)

    def store(start, ids):
        slot = start + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        for ref, value in ((blk_ref, ids), (pid_ref, page_of(ids))):
            if slots == k:
                ref[pl.ds(start, chunk)] = value
            else:           # slots past K are out of range and masked
                _triton.pltriton.store(ref.at[slot], value, mask=slot < k)

    _compact(keep, blk, num, jnp.maximum(total - 1, 0), store, nb=nb, slots=slots, chunk=chunk)
    num_ref[...] = jnp.full((1,), num, jnp.int32)


def select_pages_triton(q: jax.Array, centroids: jax.Array, page_table: jax.Array | None,
                        lengths: jax.Array, budget: jax.Array, *, width: int,
                        block_size: int, q_finish: HeadFinish | None = None,
                        q_heads: int | None = None, radix_bits: int = 1, num_warps: int | None = None,
                        interpret: bool = False) -> tuple[SelectedPages, jax.Array]:
    """Block scores, selection and page lookup of one paged decode step, one kernel.

    q [B, Hq, D] the step's queries; centroids [G, Hkv, N, D] the centroid pools (row b reads
    pool b // (B // G)); page_table [B, P] (None: a contiguous cache's centroids [B, Hkv, NB,
    D], one pool per row, page i = block i); lengths [B] tokens with the current one; budget
    [B] int32 blocks (clamped here to [3, width]) -> (SelectedPages [B, Hkv, width] - the
    kernels' own form, physical page ids - and scores [B, Hkv, NBp] f32, NBp = P rounded up to
    a power of two, valid below each row's block count). The rule: the module docstring, on
    scores = (the KV head's group-mean query) . (each block's centroid, read from its page).
    q_finish: q holds raw projected heads, RMSNorm'd and rotated here as they are read.
    q_heads: the queries are q's first q_heads heads (None: all of them).
    """
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits}")
    b, all_heads, d = q.shape
    hq = q_heads or all_heads
    pools, hkv, n_pages, dc = centroids.shape
    table_ok = (pools == b if page_table is None
                else page_table.ndim == 2 and page_table.shape[0] == b)
    if dc != d or hq % hkv or all_heads % (hq // hkv) or b % pools or not table_ok:
        raise ValueError(f"q [B, Hq, D], centroids [G, Hkv, N, D] and page_table [B, P] (None: "
                         f"G = B) do not match: {q.shape}, {centroids.shape}, "
                         f"{getattr(page_table, 'shape', None)}")
    if lengths.shape != (b,) or budget.shape != (b,):
        raise ValueError(f"lengths and budget must be [B]=[{b}], got {lengths.shape}, "
                         f"{budget.shape}")
    _check_launch(width)
    _triton.check_triton_shapes(d, block_size)
    g, rows_per_pool = hq // hkv, b // pools
    blocks = n_pages if page_table is None else page_table.shape[1]
    nbp = max(_triton.next_pow2(blocks), SCORE_CHUNK)
    kp = _triton.next_pow2(width)
    chunk = _slot_chunk(nbp, kp)
    num_warps = num_warps or min(16, max(4, nbp // 512))
    kernel = functools.partial(_pages_kernel, group=g, nb=nbp, slots=kp, chunk=chunk,
                               block_size=block_size, radix_bits=radix_bits,
                               barrier=not interpret,
                               finish_eps=None if q_finish is None else q_finish.eps,
                               tabled=page_table is not None)

    def pool_map(bi, hi):
        return (0 if pools == 1 else lax.div(bi, rows_per_pool)), hi, 0, 0

    row = pl.BlockSpec((1,), lambda bi, hi: (bi,))
    head = pl.BlockSpec((None, None, width), lambda bi, hi: (bi, hi, 0))
    finish_ops, finish_in = ([], []) if q_finish is None else _triton.finish_specs(
        q_finish, lambda bi, hi: bi)
    scores, pid, blk, num = pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[row, row,
                  *([] if page_table is None else
                    [pl.BlockSpec((None, page_table.shape[1]), lambda bi, hi: (bi, 0))]),
                  pl.BlockSpec((None, None, g, d), lambda bi, hi: (bi, hi, 0, 0)),
                  *finish_in,
                  pl.BlockSpec((None, None, n_pages, d), pool_map)],
        out_specs=[pl.BlockSpec((None, None, nbp), lambda bi, hi: (bi, hi, 0)), head, head,
                   pl.BlockSpec((None, None, 1), lambda bi, hi: (bi, hi, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, nbp), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, width), jnp.int32),
                   jax.ShapeDtypeStruct((b, hkv, width), jnp.int32),
                   jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)],
        compiler_params=_triton.pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="sparrow_select_pages_triton",
    )(lengths.astype(jnp.int32), budget.astype(jnp.int32),
      *([] if page_table is None else [page_table.astype(jnp.int32)]),
      q.reshape(b, all_heads // g, g, d), *finish_ops, centroids)
    return SelectedPages(pid, blk, num[..., 0]), scores
