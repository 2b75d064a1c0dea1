"""Block-sparse decode written directly in Triton and called through ``jax_triton.triton_call``.

Same algorithm as ``pallas_kernels.pallas_triton`` (one paged kernel over page pools [G, Hkv, N, bs, D],
the contiguous cache being B pools with page id = block id; grid (B, Hkv, n_split), GQA group
padded to >= 16 rows, P gathered pages per iteration, length mask by logical block id, online
softmax in f32, split-K partials merged in XLA), but independent of the Pallas Triton lowering,
which JAX deprecates from 0.11 on. GPU only;
``jax_triton`` and ``triton`` are optional imports (the ``gpu`` extra), so this module always
imports and raises a clear error only when the backend is actually used without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import NEG_INF, check_page_ids, default_scale
from pallas_kernels.pallas_triton import (check_triton_shapes, choose_splits, default_blocks_per_step,
                                   merge_partials, next_pow2)

try:  # Optional dependency: present on GPU installs and in the CI compile environment.
    import triton
    import triton.language as tl
    import jax_triton as jt
    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "backend unavailable"
    triton = tl = jt = None
    _IMPORT_ERROR = e


def available() -> tuple[bool, str]:
    """(True, "") if jax_triton + triton import, else (False, reason)."""
    if _IMPORT_ERROR is None:
        return True, ""
    return False, f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"


if triton is not None:

    @triton.jit
    def sparse_decode_kernel(
        q_ptr, k_ptr, v_ptr, pid_ptr, blk_ptr, nb_ptr, len_ptr,     # inputs
        acc_ptr, m_ptr, l_ptr,                                      # outputs (f32 split partials)
        B: tl.constexpr, HKV: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr,
        K_PAD: tl.constexpr, CHUNK: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
        GP: tl.constexpr, P: tl.constexpr, SCALE: tl.constexpr, IS_F32: tl.constexpr,
        NEG: tl.constexpr,
    ):
        """q [B, HKV, GP, D]; k/v page pools [B // ROWS, HKV, N, BS, D] (row b reads pool
        b // ROWS); pid (physical pages) / blk (logical blocks) [B, HKV, K_PAD]; nb [B, HKV];
        len [B]. acc [n_split, B, HKV, GP, D]; m/l [n_split, B, HKV, GP]."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        row = b * HKV + h
        nb = tl.load(nb_ptr + row)
        length = tl.load(len_ptr + b)
        start = sp * CHUNK
        stop = tl.minimum(start + CHUNK, nb)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + row * GP * D + offs_g[:, None] * D + offs_d[None, :])
        offs_t = tl.arange(0, P * BS)
        slot = offs_t // BS
        within = offs_t % BS
        # 64-bit base: a pool slab (or B*Hkv*S*D for the contiguous view) exceeds 2^31 elements
        # at long context and large batch.
        kv_base = ((b // ROWS) * HKV + h).to(tl.int64) * N * BS * D
        m = tl.full([GP], NEG, tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for e0 in range(start, stop, P):
            # Page / block id of every token slot (P distinct loads, broadcast by the cache).
            pages = tl.load(pid_ptr + row * K_PAD + e0 + slot)
            logical = tl.load(blk_ptr + row * K_PAD + e0 + slot)
            # The mask follows the logical position; the load, the physical page.
            ok = (logical * BS + within < length) & (e0 + slot < stop)
            tok = pages.to(tl.int64) * BS + within
            ptrs = kv_base + tok[:, None] * D + offs_d[None, :]
            kb = tl.load(k_ptr + ptrs)
            if IS_F32:
                s = tl.dot(q, tl.trans(kb), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kb))
            s = tl.where(ok[None, :], s * SCALE, NEG)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.where(ok[None, :], tl.exp(s - m_new[:, None]), 0.0)
            l = alpha * l + tl.sum(p, 1)
            vb = tl.load(v_ptr + ptrs)
            if IS_F32:
                pv = tl.dot(p, vb, input_precision="ieee")
            else:
                pv = tl.dot(p.to(vb.dtype), vb)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out_row = sp * B * HKV + row
        tl.store(acc_ptr + out_row * GP * D + offs_g[:, None] * D + offs_d[None, :], acc)
        tl.store(m_ptr + out_row * GP + offs_g, m)
        tl.store(l_ptr + out_row * GP + offs_g, l)


def kernel_constexprs(b: int, hq: int, hkv: int, n_pages: int, d: int, kk: int, dtype, *,
                      block_size: int, scale: float, blocks_per_step: int | None,
                      num_splits: int | None, pools: int | None = None) -> dict:
    """The kernel's compile-time parameters (plus N_SPLIT, the split-K factor) for a problem of
    K selected entries over pools of n_pages pages (pools=None: one pool per row, the contiguous
    view with n_pages = S // bs); shared with the compile check, which builds the cubin
    directly."""
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(dtype, block_size)
    p_blocks = min(next_pow2(blocks_per_step), next_pow2(kk))
    steps = -(-kk // p_blocks)
    n_split = num_splits or choose_splits(b, hkv, steps)
    chunk = -(-steps // n_split) * p_blocks
    return dict(B=b, HKV=hkv, N=n_pages, ROWS=b // (pools or b), K_PAD=chunk * n_split,
                CHUNK=chunk, BS=block_size, D=d, GP=max(16, next_pow2(hq // hkv)), P=p_blocks,
                SCALE=float(scale), IS_F32=bool(jnp.dtype(dtype) == jnp.float32), NEG=NEG_INF,
                N_SPLIT=n_split)


def _require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(
            "backend 'jax_triton' needs the optional packages jax-triton and triton "
            f"(pip install 'sparrow-jax[gpu]'); import failed: {why}")


def paged_block_sparse_decode_jax_triton(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, blocks_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
    compute_capability: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode over page pools via jax_triton.

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D] (row b reads pool b // (B // G));
    page_ids [B, Hkv, K] physical pages to read (``reference.physical_pages``); block_indices
    [B, Hkv, K] their logical block ids (length mask only); num_blocks [B, Hkv]; lengths [B]
    -> out [B, Hq, D] (q.dtype), lse [B, Hq] f32.

    compute_capability: e.g. 90 to compile for H100 without a GPU attached (CI compile check).
    """
    b, hq, hkv, pools, n_pages, bs, d, _ = check_page_ids(
        q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths)
    check_triton_shapes(d, bs)
    _require()
    g = hq // hkv
    kk = page_ids.shape[-1]
    meta = kernel_constexprs(b, hq, hkv, n_pages, d, kk, q.dtype, block_size=bs,
                             scale=default_scale(d, scale), blocks_per_step=blocks_per_step,
                             num_splits=num_splits, pools=pools)
    n_split = meta.pop("N_SPLIT")
    k_pad, gp = meta["K_PAD"], meta["GP"]
    # Clamped page ids: a bad id can never read outside the pool. Padding repeats the last entry
    # (masked: it is >= num_blocks).
    pid = jnp.clip(page_ids.astype(jnp.int32), 0, n_pages - 1)
    blk = block_indices.astype(jnp.int32)
    if k_pad != kk:
        pid = jnp.concatenate([pid, jnp.repeat(pid[..., -1:], k_pad - kk, axis=-1)], axis=-1)
        blk = jnp.concatenate([blk, jnp.repeat(blk[..., -1:], k_pad - kk, axis=-1)], axis=-1)
    nbv = jnp.clip(num_blocks.astype(jnp.int32), 0, kk)
    qg = q.reshape(b, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    f32 = jnp.float32
    acc, m, l = jt.triton_call(
        qg, k_pages, v_pages, pid, blk, nbv, lengths.astype(jnp.int32),
        kernel=sparse_decode_kernel,
        out_shape=[jax.ShapeDtypeStruct((n_split, b, hkv, gp, d), f32),
                   jax.ShapeDtypeStruct((n_split, b, hkv, gp), f32),
                   jax.ShapeDtypeStruct((n_split, b, hkv, gp), f32)],
        grid=(b, hkv, n_split),
        num_warps=num_warps, num_stages=num_stages,
        compute_capability=compute_capability,
        name="sparrow_block_sparse_decode_jax_triton",
        **meta,
    )
    out, lse = merge_partials(acc[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g])
    return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)
