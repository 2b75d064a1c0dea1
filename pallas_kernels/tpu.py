"""Block-sparse decode attention as a Pallas/Mosaic TPU kernel, over a paged KV cache.

Design (one decode step; shapes as in ``reference.py``):
  * One kernel, paged: K/V are page pools [G, Hkv, N, bs, D] and row b reads pool b // (B // G).
    The contiguous cache [B, Hkv, S, D] is the same thing viewed as B pools of S // bs pages
    whose ids are the block ids (``contiguous_as_pages``, a reshape), so the contiguous sparse
    and dense entry points are thin views of the paged kernel.
  * grid = (B, Hkv, K_pad // P): one program per (sequence, KV head, step over selected entries);
    each program handles the whole GQA group [G, D] of that KV head, so every K/V page is read
    from HBM once per KV head (not once per query head).
  * The physical page ids, logical block ids, ``num_blocks`` and ``lengths`` are
    scalar-prefetched into SMEM (``PrefetchScalarGridSpec``). The K/V BlockSpec index_maps read
    the page ids, so the Pallas pipeline DMAs only the selected [bs, D] pages of the pool into
    VMEM (double-buffered), never the whole cache; the length mask uses the logical ids.
  * One 16-token page per grid step would be dominated by the ~0.35 us per-step overhead, so a
    step covers P pages: K and V are passed P times each, operand p fetching entry j*P + p.
  * Entries past ``num_blocks`` are clamped to the last valid entry in the index_map: the
    pipeline skips a DMA whose block index did not change, so padding costs (almost) no traffic,
    and steps entirely past ``num_blocks`` skip their compute via ``pl.when``.
  * Online softmax in f32 scratch (m, l lane-broadcast to 128 lanes to stay lane-dense).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import (NEG_INF, all_blocks_selection, check_decode_inputs,
                                      check_page_ids, contiguous_as_pages, default_scale)

_LANES = 128
# Budget for the two scalar-prefetch tables (page ids + logical ids, 256 KiB each) per
# pallas_call. SMEM is 1 MiB on v5e/v5p/v6e and also holds num_blocks, lengths and Mosaic's own
# scalars: 1 MiB of tables overflowed it by 3.6 KiB in the compile check, so half leaves a 2x
# margin (and contiguous shapes split over exactly as many calls as with one 256 KiB table).
_SMEM_TABLE_BYTES = 512 * 1024
# Positions of padded entries are pushed here (> any real length) so the length mask drops them.
_FAR = 1 << 30


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _sparse_kernel(pid_ref, blk_ref, nb_ref, len_ref, q_ref, *refs, p_blocks: int,
                   block_size: int, k_pad: int, hkv: int, scale: float):
    """One grid step. pid_ref (physical pages, used only by the index_maps) and blk_ref
    (logical blocks) [bg*Hkv*K_pad], nb_ref [bg*Hkv], len_ref [bg] live in SMEM.

    q_ref [Gp, D]; refs = P key pages [bs, D], P value pages [bs, D], out [Gp, D],
    lse [Gp, 128], then scratch m [Gp, 128], l [Gp, 128], acc [Gp, D] (all f32).
    """
    del pid_ref
    k_refs = refs[:p_blocks]
    v_refs = refs[p_blocks:2 * p_blocks]
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[2 * p_blocks:]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = b * hkv + h
    nb = nb_ref[row]
    length = len_ref[b]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * p_blocks < nb)
    def _compute():
        q = q_ref[...]
        # P pages of [bs, D] stacked along sublanes: bs is a multiple of the sublane tile.
        kb = jnp.concatenate([r[...] for r in k_refs], axis=0) if p_blocks > 1 else k_refs[0][...]
        vb = jnp.concatenate([r[...] for r in v_refs], axis=0) if p_blocks > 1 else v_refs[0][...]
        s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale      # [Gp, P*bs]
        # Token position of each lane: scalar offset of the slot's logical block, where-chained
        # over the P slots (no vector integer division, which Mosaic handles poorly).
        lane = lax.broadcasted_iota(jnp.int32, s.shape, 1)
        pos = lane
        base = row * k_pad + j * p_blocks
        for p in range(p_blocks):
            valid = j * p_blocks + p < nb
            off = jnp.where(valid, blk_ref[base + p] * block_size - p * block_size, _FAR)
            in_slot = (lane >= p * block_size) & (lane < (p + 1) * block_size)
            pos = jnp.where(in_slot, lane + off, pos)
        mask = pos < length
        s = jnp.where(mask, s, NEG_INF)
        m_prev = m_sc[...][:, :1]
        l_prev = l_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        # where() (not just the NEG_INF logits) keeps masked lanes at exactly 0 even while
        # m_new is still NEG_INF (nothing valid seen yet): exp(NEG_INF - NEG_INF) would be 1.
        pr = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_new = alpha * l_prev + jnp.sum(pr, axis=1, keepdims=True)
        pv = lax.dot_general(pr.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)             # [Gp, D]
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finalize():
        l = l_sc[...][:, :1]
        m = m_sc[...][:, :1]
        ok = l > 0.0
        safe_l = jnp.where(ok, l, 1.0)
        o_ref[...] = jnp.where(ok, acc_sc[...] / safe_l, 0.0).astype(o_ref.dtype)
        lse = jnp.where(ok, m + jnp.log(safe_l), -jnp.inf)
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _sublane_multiple(dtype) -> int:
    # Native second-minor tile: 8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit.
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _pool_of(bi, *, b0: int, rows_per_pool: int, pools: int):
    """Pool read by global batch row b0 + bi. The two common layouts (one shared pool; one pool
    per row, i.e. the contiguous view) need no scalar division."""
    if pools == 1:
        return 0
    if rows_per_pool == 1:
        return bi + b0
    return lax.div(bi + b0, rows_per_pool)


def _group_call(kernel, qg, k_pages, v_pages, pid, blk, nbv, lengths, *, b0: int,
                rows_per_pool: int, hkv: int, gp: int, d: int, block_size: int, p_blocks: int,
                k_pad: int, interpret: bool):
    """One pallas_call over batch rows b0 .. b0+bg. qg [bg, Hkv, Gp, D]; pid/blk
    [bg*Hkv*K_pad], nbv [bg*Hkv], lengths [bg]; k_pages/v_pages the full pools
    [G, Hkv, N, bs, D] (never sliced: that would copy them)."""
    bg = qg.shape[0]
    pools = k_pages.shape[0]

    def kv_map(p):
        def index_map(bi, hi, j, pid_ref, blk_ref, nb_ref, len_ref):
            r = bi * hkv + hi
            last = jnp.maximum(nb_ref[r] - 1, 0)
            e = jnp.minimum(j * p_blocks + p, last)
            pool = _pool_of(bi, b0=b0, rows_per_pool=rows_per_pool, pools=pools)
            return pool, hi, pid_ref[r * k_pad + e], 0, 0
        return pl.BlockSpec((None, None, None, block_size, d), index_map)

    q_spec = pl.BlockSpec((None, None, gp, d), lambda bi, hi, j, *_: (bi, hi, 0, 0))
    kv_specs = [kv_map(p) for p in range(p_blocks)]
    out_specs = [pl.BlockSpec((None, None, gp, d), lambda bi, hi, j, *_: (bi, hi, 0, 0)),
                 pl.BlockSpec((None, None, gp, _LANES), lambda bi, hi, j, *_: (bi, hi, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(bg, hkv, k_pad // p_blocks),
        in_specs=[q_spec] + kv_specs + kv_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((gp, _LANES), jnp.float32),
                        pltpu.VMEM((gp, _LANES), jnp.float32),
                        pltpu.VMEM((gp, d), jnp.float32)],
    )
    # Bytes read: q + the selected K/V pages (upper bound: every entry) + outputs.
    kv_bytes = 2 * bg * hkv * k_pad * block_size * d * k_pages.dtype.itemsize
    cost = pl.CostEstimate(flops=4 * bg * hkv * gp * k_pad * block_size * d,
                           transcendentals=bg * hkv * gp * k_pad * block_size,
                           bytes_accessed=kv_bytes + 2 * qg.size * qg.dtype.itemsize)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((bg, hkv, gp, d), qg.dtype),
                   jax.ShapeDtypeStruct((bg, hkv, gp, _LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="sparrow_block_sparse_decode",
    )(pid, blk, nbv, lengths, qg, *([k_pages] * p_blocks), *([v_pages] * p_blocks))


def _paged_call(q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths, *,
                scale: float, blocks_per_step: int, interpret: bool):
    """The kernel launch(es) behind every entry point (inputs already validated).

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D]; page_ids/block_indices [B, Hkv, K];
    num_blocks [B, Hkv]; lengths [B] -> out [B, Hq, D], lse [B, Hq] f32.
    """
    b, hq, d = q.shape
    pools, hkv, n_pages, block_size, _ = k_pages.shape
    g = hq // hkv
    kk = page_ids.shape[-1]
    p_blocks = max(1, min(blocks_per_step, kk))
    k_pad = _round_up(kk, p_blocks)
    # Clamp page ids so a bad id can never DMA out of bounds; pad K to a multiple of P by
    # repeating the last entry (padding is >= num_blocks, hence masked and mostly not
    # re-fetched).
    pid = jnp.clip(page_ids.astype(jnp.int32), 0, n_pages - 1)
    blk = block_indices.astype(jnp.int32)
    if k_pad != kk:
        pid = jnp.concatenate([pid, jnp.repeat(pid[..., -1:], k_pad - kk, axis=-1)], axis=-1)
        blk = jnp.concatenate([blk, jnp.repeat(blk[..., -1:], k_pad - kk, axis=-1)], axis=-1)
    nbv = jnp.clip(num_blocks.astype(jnp.int32), 0, kk)
    gp = _round_up(g, _sublane_multiple(q.dtype))
    qg = q.reshape(b, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))

    kernel = functools.partial(_sparse_kernel, p_blocks=p_blocks, block_size=block_size,
                               k_pad=k_pad, hkv=hkv, scale=scale)
    # The scalar-prefetch tables live in SMEM (1 MiB on v5e/v6e); large batch x budget would
    # overflow it, so rows are split over several calls. The pools are passed whole and the
    # batch offset goes into their index_maps: slicing them would copy the cache.
    rows = max(1, _SMEM_TABLE_BYTES // (2 * 4 * hkv * k_pad))
    pid = pid.reshape(b, hkv * k_pad)
    blk = blk.reshape(b, hkv * k_pad)
    outs, lses = [], []
    for b0 in range(0, b, rows):
        bg = min(rows, b - b0)
        o, l = _group_call(kernel, qg[b0:b0 + bg], k_pages, v_pages,
                           pid[b0:b0 + bg].reshape(-1), blk[b0:b0 + bg].reshape(-1),
                           nbv[b0:b0 + bg].reshape(-1), lengths[b0:b0 + bg].astype(jnp.int32),
                           b0=b0, rows_per_pool=b // pools, hkv=hkv, gp=gp, d=d,
                           block_size=block_size, p_blocks=p_blocks, k_pad=k_pad,
                           interpret=interpret)
        outs.append(o)
        lses.append(l)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    lse = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=0)
    return out[:, :, :g, :].reshape(b, hq, d), lse[:, :, :g, 0].reshape(b, hq)


def _check_tpu_block(dtype, block_size: int) -> None:
    if block_size % _sublane_multiple(dtype):
        raise ValueError(f"pallas_tpu needs block_size to be a multiple of "
                         f"{_sublane_multiple(dtype)} for {jnp.dtype(dtype).name}, "
                         f"got {block_size}")


def paged_block_sparse_decode_tpu(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, blocks_per_step: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode over page pools on TPU.

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D] (row b reads pool b // (B // G));
    page_ids [B, Hkv, K] physical pages to read (``reference.physical_pages``); block_indices
    [B, Hkv, K] their logical block ids (length mask only); num_blocks [B, Hkv]; lengths [B]
    -> out [B, Hq, D] (q.dtype), lse [B, Hq] f32.

    blocks_per_step: pages processed per grid step (default: 256 tokens' worth).
    """
    *_, bs, d, _ = check_page_ids(q, k_pages, v_pages, page_ids, block_indices, num_blocks,
                                  lengths)
    _check_tpu_block(k_pages.dtype, bs)
    if blocks_per_step is None:
        blocks_per_step = max(1, 256 // bs)
    return _paged_call(q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths,
                       scale=default_scale(d, scale), blocks_per_step=blocks_per_step,
                       interpret=interpret)


def block_sparse_decode_tpu(
    q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
    num_blocks: jax.Array, lengths: jax.Array, *, block_size: int = 16,
    scale: float | None = None, blocks_per_step: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode on TPU. q [B, Hq, D], k/v [B, Hkv, S, D], block_indices [B, Hkv, K],
    num_blocks [B, Hkv], lengths [B] -> out [B, Hq, D], lse [B, Hq] f32.

    The paged kernel on the cache viewed as one pool per row (page id = block id, no copy).
    blocks_per_step: selected blocks processed per grid step (default: 256 tokens' worth).
    """
    _, _, _, s, _, _ = check_decode_inputs(q, k, v, lengths, block_size=block_size,
                                           block_indices=block_indices, num_blocks=num_blocks)
    _check_tpu_block(k.dtype, block_size)
    ids = jnp.clip(block_indices.astype(jnp.int32), 0, s // block_size - 1)
    return paged_block_sparse_decode_tpu(
        q, contiguous_as_pages(k, block_size), contiguous_as_pages(v, block_size), ids, ids,
        num_blocks, lengths, scale=scale, blocks_per_step=blocks_per_step, interpret=interpret)


def dense_block_size(s: int, target: int = 512, minimum: int = 16) -> int:
    """Largest power-of-two tile <= target that divides S (dense decode reads big contiguous
    tiles instead of 16-token blocks: fewer DMAs and grid steps)."""
    t = target
    while t >= minimum:
        if s % t == 0:
            return t
        t //= 2
    raise ValueError(f"pallas dense decode needs S to be a multiple of {minimum}, got S={s}")


def dense_decode_tpu(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode on TPU: the paged kernel on the contiguous view with every tile selected,
    at 512-token tiles (pages). Tiles at or past ceil(length / tile) are neither fetched nor
    computed."""
    b, _, hkv, s, _, _ = check_decode_inputs(q, k, v, lengths, block_size=1)
    tile = dense_block_size(s)
    idx, nb = all_blocks_selection(b, hkv, s, lengths, tile)
    return paged_block_sparse_decode_tpu(
        q, contiguous_as_pages(k, tile), contiguous_as_pages(v, tile), idx, idx, nb, lengths,
        scale=scale, blocks_per_step=max(1, 1024 // tile), interpret=interpret)
