"""Block-sparse decode attention as a Pallas kernel lowered to Triton (NVIDIA GPUs).

In jax 0.10.x ``pallas_call`` on GPU defaults to Mosaic GPU; passing
``jax.experimental.pallas.triton.CompilerParams`` selects the Triton lowering used here.

Design (shapes as in ``reference.py``):
  * grid = (B, Hkv, n_split). A program owns one KV head's whole GQA group, padded to Gp >= 16
    rows so both products run on tensor cores (``tl.dot`` needs M >= 16), and walks its share of
    the selected entries P blocks at a time: the P block ids are loaded as a vector and K/V are
    gathered as [P, bs, D] -> [P*bs, D] (no copy of the cache, just indexed loads).
  * The loop runs only over entries < num_blocks (dynamic trip count), so padding costs nothing.
  * Split-K: when B*Hkv programs cannot fill the GPU (decode with small batch), the selected
    entries are split across n_split programs that each emit (acc, m, l) in f32; a tiny XLA
    epilogue merges them with the usual log-sum-exp rescaling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.reference import (NEG_INF, all_blocks_selection, check_decode_inputs,
                                      default_scale)

# Programs needed to keep an H100 busy (132 SMs x ~2 resident CTAs): below this, split K.
_TARGET_PROGRAMS = 264


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def choose_splits(b: int, hkv: int, steps: int, target: int = _TARGET_PROGRAMS) -> int:
    """Number of K splits: enough programs to fill the GPU, at least 2 steps per split."""
    if b * hkv >= target or steps < 4:
        return 1
    return max(1, min(-(-target // (b * hkv)), steps // 2))


def default_blocks_per_step(dtype, block_size: int) -> int:
    """Blocks gathered per iteration: 128 tokens for 16-bit caches, 64 for f32, so that the
    pipelined K and V tiles fit H100 shared memory (f32 at 128 tokens needs ~264 KiB)."""
    tokens = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
    return max(1, tokens // block_size)


def _kernel(nb_ref, len_ref, idx_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
            p_blocks: int, block_size: int, chunk: int, scale: float, precision):
    """nb_ref/len_ref [1]; idx_ref [K_pad]; q_ref [Gp, D]; k_ref/v_ref [NB, bs, D];
    outputs acc_ref [Gp, D], m_ref/l_ref [Gp] (f32, unnormalised partials of this split)."""
    split = pl.program_id(2)
    nb = nb_ref[0]
    length = len_ref[0]
    start = split * chunk
    stop = jnp.minimum(start + chunk, nb)
    n_steps = jnp.maximum(stop - start + p_blocks - 1, 0) // p_blocks
    q = q_ref[...]
    gp, d = q.shape
    tok = p_blocks * block_size
    in_block = lax.broadcasted_iota(jnp.int32, (p_blocks, block_size), 1)
    slot = lax.broadcasted_iota(jnp.int32, (p_blocks, block_size), 0)

    def body(i, carry):
        acc, m, l = carry
        e0 = start + i * p_blocks
        ids = idx_ref[pl.ds(e0, p_blocks)]                                   # [P]
        kb = k_ref[ids].reshape(tok, d)                                      # gathered [P*bs, D]
        vb = v_ref[ids].reshape(tok, d)
        s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale     # [Gp, P*bs]
        pos = ids[:, None] * block_size + in_block
        ok = (pos < length) & (e0 + slot < stop)
        ok = ok.reshape(1, tok)
        s = jnp.where(ok, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        pr = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l + jnp.sum(pr, axis=1)
        pv = lax.dot_general(pr.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), NEG_INF, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_steps, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def merge_partials(acc: jax.Array, m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merges split-K partials. acc [n, ..., D], m/l [n, ...] (f32) -> out [..., D], lse [...].
    Splits that saw no valid token carry l = 0 and drop out; all-empty rows give 0 / -inf."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max[None])
    l_tot = jnp.sum(w * l, axis=0)
    o = jnp.sum(w[..., None] * acc, axis=0)
    ok = l_tot > 0.0
    safe = jnp.where(ok, l_tot, 1.0)
    out = jnp.where(ok[..., None], o / safe[..., None], 0.0)
    lse = jnp.where(ok, m_max + jnp.log(safe), -jnp.inf)
    return out, lse


def _triton_call(q, k, v, block_indices, num_blocks, lengths, *, block_size: int, scale: float,
                 blocks_per_step: int, num_splits: int | None, num_warps: int,
                 num_stages: int, interpret: bool):
    b, hq, d = q.shape
    _, hkv, s, _ = k.shape
    g = hq // hkv
    nblk = s // block_size
    kk = block_indices.shape[-1]
    p_blocks = min(_next_pow2(blocks_per_step), _next_pow2(kk))
    steps = -(-kk // p_blocks)
    n_split = num_splits or choose_splits(b, hkv, steps)
    chunk = -(-steps // n_split) * p_blocks
    k_pad = chunk * n_split
    idx = jnp.clip(block_indices.astype(jnp.int32), 0, nblk - 1)
    if k_pad != kk:
        idx = jnp.concatenate([idx, jnp.repeat(idx[..., -1:], k_pad - kk, axis=-1)], axis=-1)
    nbv = jnp.clip(num_blocks.astype(jnp.int32), 0, kk)[..., None]           # [B, Hkv, 1]
    gp = max(16, _next_pow2(g))
    qg = q.reshape(b, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    # Free reshapes: the kernel indexes whole blocks of the cache by id.
    k5 = k.reshape(b, hkv, nblk, block_size, d)
    v5 = v.reshape(b, hkv, nblk, block_size, d)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, p_blocks=p_blocks, block_size=block_size, chunk=chunk,
                               scale=scale, precision=precision)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_split),
        in_specs=[
            pl.BlockSpec((None, None, 1), lambda bi, hi, si: (bi, hi, 0)),
            pl.BlockSpec((1,), lambda bi, hi, si: (bi,)),
            pl.BlockSpec((None, None, k_pad), lambda bi, hi, si: (bi, hi, 0)),
            pl.BlockSpec((None, None, gp, d), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, nblk, block_size, d), lambda bi, hi, si: (bi, hi, 0, 0, 0)),
            pl.BlockSpec((None, None, nblk, block_size, d), lambda bi, hi, si: (bi, hi, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda bi, hi, si: (si, bi, hi, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (si, bi, hi, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (si, bi, hi, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((n_split, b, hkv, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((n_split, b, hkv, gp), jnp.float32),
                   jax.ShapeDtypeStruct((n_split, b, hkv, gp), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparrow_block_sparse_decode_triton",
    )(nbv, lengths.astype(jnp.int32), idx, qg, k5, v5)
    out, lse = merge_partials(acc[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g])
    return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def _check_triton_shapes(d: int, block_size: int) -> None:
    # Triton tensors must have power-of-two sizes; these are the loaded tile dimensions.
    if not _is_pow2(d):
        raise ValueError(f"pallas_triton needs a power-of-two head_dim, got D={d}")
    if not _is_pow2(block_size):
        raise ValueError(f"pallas_triton needs a power-of-two block_size, got {block_size}")


def block_sparse_decode_triton(
    q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
    num_blocks: jax.Array, lengths: jax.Array, *, block_size: int = 16,
    scale: float | None = None, blocks_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode via Pallas->Triton. q [B, Hq, D], k/v [B, Hkv, S, D],
    block_indices [B, Hkv, K], num_blocks [B, Hkv], lengths [B] -> out [B, Hq, D], lse [B, Hq].

    blocks_per_step: blocks gathered per loop iteration (power of two; default 128 tokens' worth
      for 16-bit caches, 64 for f32).
    num_splits: split-K factor (None = automatic from B*Hkv).
    """
    _, _, _, _, d, _ = check_decode_inputs(q, k, v, lengths, block_size=block_size,
                                           block_indices=block_indices, num_blocks=num_blocks)
    _check_triton_shapes(d, block_size)
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(k.dtype, block_size)
    return _triton_call(q, k, v, block_indices, num_blocks, lengths, block_size=block_size,
                        scale=default_scale(d, scale), blocks_per_step=blocks_per_step,
                        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret)


def dense_decode_triton(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, num_splits: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode via the same kernel with every block selected, in 64-token tiles
    (contiguous ids, so the 'gather' is a plain strided load)."""
    b, _, hkv, s, d, _ = check_decode_inputs(q, k, v, lengths, block_size=1)
    tile = 64 if s % 64 == 0 else 16
    if s % tile:
        raise ValueError(f"pallas_triton dense decode needs S to be a multiple of 16, got S={s}")
    _check_triton_shapes(d, tile)
    idx, nb = all_blocks_selection(b, hkv, s, lengths, tile)
    return _triton_call(q, k, v, idx, nb, lengths, block_size=tile,
                        scale=default_scale(d, scale),
                        blocks_per_step=default_blocks_per_step(k.dtype, tile),
                        num_splits=num_splits, num_warps=4, num_stages=2, interpret=interpret)
