"""Block-sparse decode attention as a Pallas/Mosaic TPU kernel, over a paged KV cache.

Design (one decode step; shapes as in ``reference.py``):
  * One kernel, paged: K/V are page pools [G, Hkv, N, bs, D] and row b reads pool b // (B // G).
    The contiguous cache [B, Hkv, S, D] is the same thing viewed as B pools of S // bs pages
    whose ids are the block ids (``contiguous_as_pages``, a reshape): the contiguous sparse and
    dense entry points are views of this kernel (``dispatch.contiguous_view`` / ``dense_view``;
    dense at ``dense_tiling``'s tiles).
  * grid = (B / R, Hkv): one program per R batch rows (8) and one KV head; each program
    handles the whole GQA group [G, D] of that KV head, so every K/V page is read from HBM
    once per KV head (not once per query head).
  * Work bounded by each row's ``num_blocks``: the program loops (``lax.while_loop``) over the
    (row, step) pairs of its rows' valid entries only, P pages per step; rows with no entries
    cost nothing. The pools stay in HBM (``memory_space=ANY``) and the kernel copies pages
    itself (``pltpu.make_async_copy``) into two VMEM buffers: while step t computes on one, the
    pages of step t+1 (the row's next P entries, or the next non-empty row's first P) are in
    flight to the other. Before, a grid axis of K_pad / P steps per row paid the per-step
    overhead for every padded step.
  * The physical page ids, logical block ids, ``num_blocks`` and ``lengths`` are
    scalar-prefetched into SMEM (``PrefetchScalarGridSpec``); the copies read the page ids, the
    length mask the logical ids. Entries of a row's last step past ``num_blocks`` re-copy its
    last valid page (finite data, masked): at most P - 1 extra pages per row.
  * Online softmax in f32 scratch (m, l lane-broadcast to 128 lanes to stay lane-dense).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import NEG_INF, check_page_ids, default_scale

_LANES = 128
# Budget for the two scalar-prefetch tables (page ids + logical ids, 256 KiB each) per
# pallas_call. SMEM is 1 MiB on v5e/v5p/v6e and also holds num_blocks, lengths and Mosaic's own
# scalars: 1 MiB of tables overflowed it by 3.6 KiB in the compile check, so half leaves a 2x
# margin (and contiguous shapes split over exactly as many calls as with one 256 KiB table).
SMEM_TABLE_BYTES = 512 * 1024
# Positions of padded entries are pushed here (> any real length) so the length mask drops them.
_FAR = 1 << 30
# Batch rows per kernel program (one KV head each): the program loops over their entries, so the
# grid has B / 8 x Hkv steps whatever the selection width.
_ROWS_PER_PROGRAM = 8


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _sparse_kernel(pid_ref, blk_ref, nb_ref, len_ref, q_ref, k_hbm, v_hbm, o_ref, lse_ref,
                   k_buf, v_buf, sems, m_sc, l_sc, acc_sc, *, rows: int, p_blocks: int,
                   block_size: int, k_pad: int, hkv: int, b0: int, rows_per_pool: int,
                   scale: float):
    """One program: `rows` batch rows of one KV head, each row only its num_blocks entries.

    SMEM: pid_ref (physical pages) and blk_ref (logical blocks) [bg*Hkv*K_pad], nb_ref
    [bg*Hkv], len_ref [bg]. q_ref [rows, Gp, D]; k_hbm/v_hbm the pools [G, Hkv, N, bs, D] in
    HBM; o_ref [rows, Gp, D], lse_ref [rows, Gp, 128]; scratch k_buf/v_buf [2, P*bs, D] (two
    buffers of P pages), sems DMA [2 (K, V), 2 (buffer)], m/l [Gp, 128], acc [Gp, D] (f32).

    One loop over (row, step) pairs of the rows that have entries: while step t computes on
    one buffer, the P pages of step t+1 (the row's next P entries, or the next non-empty row's
    first) are copied into the other.
    """
    ri, h = pl.program_id(0), pl.program_id(1)
    pb, bs = p_blocks, block_size
    pools = k_hbm.shape[0]

    def table_row(u):                  # row u of this program -> its (row, head) table index
        return (ri * rows + u) * hkv + h

    def steps(u):
        return lax.div(nb_ref[table_row(u)] + pb - 1, pb)      # (no floor division: >= 0)

    def next_row(u):                   # the first row >= u with entries (rows: none left)
        return lax.while_loop(
            lambda v: (v < rows) & (nb_ref[table_row(jnp.minimum(v, rows - 1))] == 0),
            lambda v: v + 1, u)

    def copies(u, j, buf):
        """The 2P page copies of row u's step j into buffer `buf`. Entries past num_blocks
        re-read the row's last entry (finite data; the length mask drops them)."""
        last = nb_ref[table_row(u)] - 1
        pool = _pool_of(ri * rows + u, b0=b0, rows_per_pool=rows_per_pool, pools=pools)
        out = []
        for p in range(pb):
            page = pid_ref[table_row(u) * k_pad + jnp.minimum(j * pb + p, last)]
            for kv, (src, dst) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                out.append(pltpu.make_async_copy(src.at[pool, h, page],
                                                 dst.at[buf, pl.ds(p * bs, bs)],
                                                 sems.at[kv, buf]))
        return out

    # Rows without entries (and batch padding) keep these: out 0, lse -inf.
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)
    first = next_row(0)

    @pl.when(first < rows)
    def _prefetch_first():
        for c in copies(first, 0, 0):
            c.start()

    def step(carry):
        u, j, buf = carry
        nb = nb_ref[table_row(u)]
        is_last = j + 1 >= steps(u)
        nu = jnp.where(is_last, next_row(u + 1), u)
        nj = jnp.where(is_last, 0, j + 1)

        @pl.when(nu < rows)
        def _prefetch_next():
            for c in copies(nu, nj, 1 - buf):
                c.start()

        for c in copies(u, j, buf):
            c.wait()

        @pl.when(j == 0)
        def _init():
            m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        q = q_ref[u]                                                          # [Gp, D]
        kb, vb = k_buf[buf], v_buf[buf]                                       # [P*bs, D]
        s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale      # [Gp, P*bs]
        # Token position of each lane: scalar offset of the entry's logical block, where-chained
        # over the P entries (no vector integer division, which Mosaic handles poorly).
        lane = lax.broadcasted_iota(jnp.int32, s.shape, 1)
        pos = lane
        base = table_row(u) * k_pad + j * pb
        for p in range(pb):
            off = jnp.where(j * pb + p < nb, blk_ref[base + p] * bs - p * bs, _FAR)
            in_entry = (lane >= p * bs) & (lane < (p + 1) * bs)
            pos = jnp.where(in_entry, lane + off, pos)
        mask = pos < len_ref[ri * rows + u]
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

        @pl.when(is_last)
        def _finalize():
            l = l_sc[...][:, :1]
            ok = l > 0.0
            safe_l = jnp.where(ok, l, 1.0)
            o_ref[u] = jnp.where(ok, acc_sc[...] / safe_l, 0.0).astype(o_ref.dtype)
            lse = jnp.where(ok, m_sc[...][:, :1] + jnp.log(safe_l), -jnp.inf)
            lse_ref[u] = jnp.broadcast_to(lse, lse_ref.shape[1:])

        return nu, nj, 1 - buf

    lax.while_loop(lambda c: c[0] < rows, step, (first, jnp.int32(0), jnp.int32(0)))


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


def _group_call(qg, k_pages, v_pages, pid, blk, nbv, lengths, *, b0: int, rows: int,
                rows_per_pool: int, hkv: int, gp: int, d: int, block_size: int, p_blocks: int,
                k_pad: int, scale: float, interpret: bool):
    """One pallas_call over batch rows b0 .. b0+bg (bg a multiple of `rows`), grid (bg / rows,
    Hkv). qg [bg, Hkv, Gp, D]; pid/blk [bg*Hkv*K_pad], nbv [bg*Hkv], lengths [bg];
    k_pages/v_pages the full pools [G, Hkv, N, bs, D], left in HBM (never sliced: that would
    copy them); the kernel copies only the pages of each row's num_blocks entries."""
    bg = qg.shape[0]
    kernel = functools.partial(_sparse_kernel, rows=rows, p_blocks=p_blocks,
                               block_size=block_size, k_pad=k_pad, hkv=hkv, b0=b0,
                               rows_per_pool=rows_per_pool, scale=scale)

    def rows_spec(width):
        return pl.BlockSpec((rows, None, gp, width), lambda ri, hi, *_: (ri, hi, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(bg // rows, hkv),
        in_specs=[rows_spec(d), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[rows_spec(d), rows_spec(_LANES)],
        scratch_shapes=[pltpu.VMEM((2, p_blocks * block_size, d), k_pages.dtype),
                        pltpu.VMEM((2, p_blocks * block_size, d), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((gp, _LANES), jnp.float32),
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
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=interpret,
        name="sparrow_block_sparse_decode",
    )(pid, blk, nbv, lengths, qg, k_pages, v_pages)


def _paged_call(q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths, *,
                scale: float, blocks_per_step: int, interpret: bool,
                rows_per_program: int = _ROWS_PER_PROGRAM):
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
    # Rows whose two tables fit the SMEM budget of one call (at least one row).
    table_rows = max(1, SMEM_TABLE_BYTES // (2 * 4 * hkv * k_pad))
    rows = max(1, min(rows_per_program, b, table_rows))
    # Clamp page ids so a bad id can never DMA out of bounds; pad K to a multiple of P (padding
    # is >= num_blocks: never read) and B to a multiple of the rows per program (num_blocks 0).
    pid = jnp.clip(page_ids.astype(jnp.int32), 0, n_pages - 1)
    blk = block_indices.astype(jnp.int32)
    nbv = jnp.clip(num_blocks.astype(jnp.int32), 0, kk)
    gp = _round_up(g, _sublane_multiple(q.dtype))
    qg = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    b_pad = _round_up(b, rows)
    qg, ln = jnp.pad(qg, ((0, b_pad - b),) + ((0, 0),) * 3), jnp.pad(lengths, (0, b_pad - b))
    nbv = jnp.pad(nbv, ((0, b_pad - b), (0, 0)))
    pid, blk = (jnp.pad(x, ((0, b_pad - b), (0, 0), (0, k_pad - kk))).reshape(b_pad, -1)
                for x in (pid, blk))
    # The scalar-prefetch tables live in SMEM (1 MiB on v5e/v6e); large batch x budget would
    # overflow it, so rows are split over several calls (a multiple of the rows per program
    # each). The pools are passed whole and the batch offset goes into the kernel's pool index:
    # slicing them would copy the cache.
    per_call = table_rows // rows * rows
    outs, lses = [], []
    for b0 in range(0, b_pad, per_call):
        sl = slice(b0, min(b_pad, b0 + per_call))
        o, l = _group_call(qg[sl], k_pages, v_pages, pid[sl].reshape(-1), blk[sl].reshape(-1),
                           nbv[sl].reshape(-1), ln[sl].astype(jnp.int32), b0=b0, rows=rows,
                           rows_per_pool=max(1, b // pools), hkv=hkv, gp=gp, d=d,
                           block_size=block_size, p_blocks=p_blocks, k_pad=k_pad, scale=scale,
                           interpret=interpret)
        outs.append(o)
        lses.append(l)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    lse = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=0)
    return out[:b, :, :g, :].reshape(b, hq, d), lse[:b, :, :g, 0].reshape(b, hq)


def _check_tpu_block(dtype, block_size: int) -> None:
    if block_size % _sublane_multiple(dtype):
        raise ValueError(f"pallas_tpu needs block_size to be a multiple of "
                         f"{_sublane_multiple(dtype)} for {jnp.dtype(dtype).name}, "
                         f"got {block_size}")


def paged_block_sparse_decode_tpu(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, blocks_per_step: int | None = None, interpret: bool = False,
    rows_per_program: int = _ROWS_PER_PROGRAM,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode over page pools on TPU.

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D] (row b reads pool b // (B // G));
    page_ids [B, Hkv, K] physical pages to read (``reference.physical_pages``); block_indices
    [B, Hkv, K] their logical block ids (length mask only); num_blocks [B, Hkv]; lengths [B]
    -> out [B, Hq, D] (q.dtype), lse [B, Hq] f32.

    blocks_per_step: pages processed per grid step (default: 256 tokens' worth).
    rows_per_program: batch rows one kernel program loops over (at most the rows whose tables
    fit one call's SMEM budget, ``SMEM_TABLE_BYTES``).
    """
    *_, bs, d, _ = check_page_ids(q, k_pages, v_pages, page_ids, block_indices, num_blocks,
                                  lengths)
    _check_tpu_block(k_pages.dtype, bs)
    if blocks_per_step is None:
        blocks_per_step = max(1, 256 // bs)
    return _paged_call(q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths,
                       scale=default_scale(d, scale), blocks_per_step=blocks_per_step,
                       interpret=interpret, rows_per_program=rows_per_program)


def dense_tiling(s: int, dtype=None, target: int = 512, minimum: int = 16) -> tuple[int, int]:
    """Dense decode's tiles on TPU (``dispatch.dense_view``): the largest power-of-two tile <=
    target tokens that divides S - big contiguous pages instead of 16-token blocks, fewer DMAs
    and grid steps - and 1024 tokens per grid step. Returns (tile, tiles per step)."""
    t = target
    while t >= minimum:
        if s % t == 0:
            return t, max(1, 1024 // t)
        t //= 2
    raise ValueError(f"pallas dense decode needs S to be a multiple of {minimum}, got S={s}")
