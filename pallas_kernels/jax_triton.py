"""Block-sparse decode written directly in Triton and called through ``jax_triton.triton_call``.

Same algorithm as ``pallas_kernels.triton`` (grid (B, Hkv, n_split), GQA group padded to >= 16
rows, P gathered blocks per iteration, online softmax in f32, split-K partials merged in XLA),
but independent of the Pallas Triton lowering, which JAX deprecates from 0.11 on. GPU only;
``jax_triton`` and ``triton`` are optional imports (the ``gpu`` extra), so this module always
imports and raises a clear error only when the backend is actually used without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import (NEG_INF, all_blocks_selection, check_decode_inputs,
                                      default_scale)
from pallas_kernels.triton import (_check_triton_shapes, _next_pow2, choose_splits,
                                   default_blocks_per_step, merge_partials)

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
    def _sparse_decode_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, nb_ptr, len_ptr,       # inputs
        acc_ptr, m_ptr, l_ptr,                               # outputs (f32 split partials)
        B: tl.constexpr, HKV: tl.constexpr, S: tl.constexpr, K_PAD: tl.constexpr,
        CHUNK: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
        P: tl.constexpr, SCALE: tl.constexpr, IS_F32: tl.constexpr, NEG: tl.constexpr,
    ):
        """q [B, HKV, GP, D]; k/v [B, HKV, S, D]; idx [B, HKV, K_PAD]; nb [B, HKV]; len [B].
        acc [n_split, B, HKV, GP, D]; m/l [n_split, B, HKV, GP]."""
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
        # 64-bit base: B*Hkv*S*D exceeds 2^31 elements at long context and large batch.
        kv_base = row.to(tl.int64) * S * D
        m = tl.full([GP], NEG, tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for e0 in range(start, stop, P):
            # Block id of every token slot (P distinct loads, broadcast over the block by cache).
            ids = tl.load(idx_ptr + row * K_PAD + e0 + slot)
            pos = ids * BS + within
            ok = (pos < length) & (e0 + slot < stop)
            ptrs = kv_base + pos.to(tl.int64)[:, None] * D + offs_d[None, :]
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



def kernel_constexprs(b: int, hq: int, hkv: int, s: int, d: int, kk: int, dtype, *,
                      block_size: int, scale: float, blocks_per_step: int | None,
                      num_splits: int | None) -> dict:
    """The kernel's compile-time parameters (plus N_SPLIT, the split-K factor) for a problem of
    K selected entries; shared with the compile check, which builds the cubin directly."""
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(dtype, block_size)
    p_blocks = min(_next_pow2(blocks_per_step), _next_pow2(kk))
    steps = -(-kk // p_blocks)
    n_split = num_splits or choose_splits(b, hkv, steps)
    chunk = -(-steps // n_split) * p_blocks
    return dict(B=b, HKV=hkv, S=s, K_PAD=chunk * n_split, CHUNK=chunk, BS=block_size, D=d,
                GP=max(16, _next_pow2(hq // hkv)), P=p_blocks, SCALE=float(scale),
                IS_F32=bool(jnp.dtype(dtype) == jnp.float32), NEG=NEG_INF, N_SPLIT=n_split)


def _require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(
            "backend 'jax_triton' needs the optional packages jax-triton and triton "
            f"(pip install 'sparrow-jax[gpu]'); import failed: {why}")


def block_sparse_decode_jax_triton(
    q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
    num_blocks: jax.Array, lengths: jax.Array, *, block_size: int = 16,
    scale: float | None = None, blocks_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
    compute_capability: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode via jax_triton. q [B, Hq, D], k/v [B, Hkv, S, D],
    block_indices [B, Hkv, K], num_blocks [B, Hkv], lengths [B] -> out [B, Hq, D], lse [B, Hq].

    compute_capability: e.g. 90 to compile for H100 without a GPU attached (CI compile check).
    """
    b, hq, hkv, s, d, g = check_decode_inputs(
        q, k, v, lengths, block_size=block_size, block_indices=block_indices,
        num_blocks=num_blocks)
    _check_triton_shapes(d, block_size)
    _require()
    kk = block_indices.shape[-1]
    meta = kernel_constexprs(b, hq, hkv, s, d, kk, q.dtype, block_size=block_size,
                             scale=default_scale(d, scale), blocks_per_step=blocks_per_step,
                             num_splits=num_splits)
    n_split = meta.pop("N_SPLIT")
    k_pad, gp = meta["K_PAD"], meta["GP"]
    idx = jnp.clip(block_indices.astype(jnp.int32), 0, s // block_size - 1)
    if k_pad != kk:
        idx = jnp.concatenate([idx, jnp.repeat(idx[..., -1:], k_pad - kk, axis=-1)], axis=-1)
    nbv = jnp.clip(num_blocks.astype(jnp.int32), 0, kk)
    qg = q.reshape(b, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    f32 = jnp.float32
    acc, m, l = jt.triton_call(
        qg, k, v, idx, nbv, lengths.astype(jnp.int32),
        kernel=_sparse_decode_kernel,
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


def dense_decode_jax_triton(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, compute_capability: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode through the same Triton kernel with every 64-token tile selected."""
    b, _, hkv, s, _, _ = check_decode_inputs(q, k, v, lengths, block_size=1)
    tile = 64 if s % 64 == 0 else 16
    if s % tile:
        raise ValueError(f"jax_triton dense decode needs S to be a multiple of 16, got S={s}")
    idx, nb = all_blocks_selection(b, hkv, s, lengths, tile)
    return block_sparse_decode_jax_triton(q, k, v, idx, nb, lengths, block_size=tile,
                                          scale=scale,
                                          blocks_per_step=default_blocks_per_step(k.dtype, tile),
                                          compute_capability=compute_capability)
