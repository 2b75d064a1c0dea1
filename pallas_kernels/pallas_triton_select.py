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

NUM_RESERVED = 3                      # sink + the two most recent blocks (selection.NUM_RESERVED)
_SIGN = np.int32(-2**31)
_CHUNK_ELEMENTS = 8192                # slots x blocks compared at once in the compaction


def _wrap32(x: int) -> int:
    """An unsigned 32-bit pattern as the int32 with the same bits."""
    return ((x + 2**31) % 2**32) - 2**31


def _kernel(scores_ref, total_ref, budget_ref, ids_ref, num_ref, *, nb: int, width: int,
            chunk: int, radix_bits: int):
    """scores_ref [NBp] f32; total_ref/budget_ref [1] int32; ids_ref [Kp] int32; num_ref [1]."""
    s = scores_ref[...]
    bits = lax.bitcast_convert_type(s, jnp.int32)
    # Signed order of this key = IEEE total order of the floats (negatives' low bits flipped).
    key = jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
    blk = lax.broadcasted_iota(jnp.int32, (nb,), 0)
    total = total_ref[0]
    budget = budget_ref[0]
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
    num = jnp.where(dense, total, budget)
    slot_of = jnp.cumsum(jnp.where(keep, 1, 0)) - 1                    # output slot per block
    fill = jnp.maximum(total - 1, 0)

    def body(c, carry):
        slots = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, nb), 0)
        hit = keep[None, :] & (slot_of[None, :] == slots)
        ids = jnp.sum(jnp.where(hit, blk[None, :], 0), axis=1)          # [chunk]
        first = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        ids_ref[pl.ds(c * chunk, chunk)] = jnp.where(first < num, ids, fill)
        return carry

    lax.fori_loop(0, width // chunk, body, 0)
    num_ref[...] = jnp.full((1,), num, jnp.int32)


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
    if width < NUM_RESERVED:
        raise ValueError(f"width must be >= {NUM_RESERVED}, got {width}")
    if _triton.pltriton is None:
        raise RuntimeError(_triton.status()[1])
    rows, nb = scores.shape
    nbp, kp = _triton.next_pow2(nb), _triton.next_pow2(width)
    chunk = max(1, min(kp, _triton.next_pow2(max(1, _CHUNK_ELEMENTS // nbp))))
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
