"""The decode step's page writes as one Pallas kernel lowered to Triton (NVIDIA GPUs): the fed
token's key and value into the page pools and, where the token fills its page, the page's
centroid (mean key) into the centroid pool - in place, one launch per layer.

Why a kernel: XLA writes each pool with a scatter of its own (K, V, and the centroid in sparse
layers: 2-3 launches per layer and decode step; a GPU decode step at small batch is bound by
its launches, docs/benchmarks.md "Kernels per decode step"). XLA cannot put several scatters
into one kernel; a kernel writes all three.

The XLA form, which this kernel matches exactly (the same stored rows, the same f32 mean), is
``sparrow_jax.rollout.paged.write_token_rows`` plus the centroid update in
``rollout/paged.py``; the tests compare them in interpret mode.

Design: grid = (S slots, Hkv); a program writes its slot's [D] key and value row for one KV
head at (page, offset) of the slot's pool (pools [G, Hkv, N, bs, D], row s in pool
s // (S / G)), aliased input to output: the pools are updated where they are. A slot that
fills its page (offset bs - 1) reads the page's other bs - 1 keys back, puts its own key in
its row (in registers: no read-after-write between the program's threads) and stores the f32
mean in the pool's dtype. Slots that do not write (inactive) store nothing. Active slots never
share a page being written (the partly filled last page is private to its slot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import pallas_triton as _triton
from pallas_kernels.reference import HeadFinish


def _kernel(page_ref, offset_ref, flags_ref, k_new_ref, v_new_ref, *refs, block_size: int,
            centroids: bool, finish_eps: float | None):
    """page_ref/offset_ref/flags_ref [1] int32 (flags: 1 = write, 3 = write and the page is
    full); k_new_ref/v_new_ref [D]; with finish_eps, k_new_ref holds the raw projected key and
    kw_ref [D], cos_ref / sin_ref [D] follow (`pallas_triton.finished_rows`); then the pools'
    inputs (unread: aliased to the outputs), then the outputs k_ref/v_ref [N, bs, D] (and
    c_ref [N, D] with centroids)."""
    refs = list(refs)
    finish_refs = [refs.pop(0) for _ in range(3)] if finish_eps is not None else []
    n_in = 3 if centroids else 2
    out_refs = refs[n_in:]
    k_ref, v_ref = out_refs[0], out_refs[1]
    page, offset, flags = page_ref[0], offset_ref[0], flags_ref[0]
    n_pages = k_ref.shape[0]
    page = jnp.clip(page, 0, n_pages - 1)
    if finish_refs:
        key = _triton.finished_rows(lambda cols: k_new_ref[cols[None, :]], *finish_refs,
                                    eps=finish_eps).reshape(k_new_ref.shape)
    else:
        key = k_new_ref[...]
    key = key.astype(k_ref.dtype)

    @pl.when((flags & 1) != 0)
    def _write():
        k_ref[page, offset] = key
        v_ref[page, offset] = v_new_ref[...].astype(v_ref.dtype)

    if centroids:
        c_ref = out_refs[2]

        @pl.when((flags & 2) != 0)
        def _centroid():
            rows = k_ref[page]                                                 # [bs, D]
            mine = lax.broadcasted_iota(jnp.int32, rows.shape, 0) == offset
            keys = jnp.where(mine, key[None, :], rows).astype(jnp.float32)
            c_ref[page] = (jnp.sum(keys, axis=0) / block_size).astype(c_ref.dtype)


def write_token_triton(k_pool: jax.Array, v_pool: jax.Array, c_pool: jax.Array | None,
                       k_new: jax.Array, v_new: jax.Array, page: jax.Array, offset: jax.Array,
                       write: jax.Array, *, k_finish: HeadFinish | None = None,
                       k_first: int = 0, v_first: int = 0, interpret: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Writes one token per slot into the page pools, in place.

    k_pool/v_pool [G, Hkv, N, bs, D]; c_pool [G, Hkv, N, D] or None (no centroids: a dense
    layer); k_new/v_new [S, H, D] the fed token's key/value, KV head h at head k_first + h of
    k_new and v_first + h of v_new (both 0 for [S, Hkv, D]; one [S, Hq + 2 Hkv, D] array of a
    layer's q, k and v heads serves as both with Hq and Hq + Hkv); page [S] the page (in the slot's
    pool) and offset [S] the row in it; write [S] bool (False: the slot writes nothing). Where
    offset is bs - 1 the page is full: its centroid is set to the mean of its keys (f32, stored
    in c_pool's dtype). Returns (k_pool, v_pool, c_pool)."""
    pools, hkv, n_pages, bs, d = k_pool.shape
    s = k_new.shape[0]
    if (v_pool.shape != k_pool.shape or k_new.shape[0] != s or v_new.shape[0] != s
            or k_new.shape[2] != d or v_new.shape[2] != d or k_first + hkv > k_new.shape[1]
            or v_first + hkv > v_new.shape[1]):
        raise ValueError(f"pools {k_pool.shape} / {v_pool.shape} and new rows {k_new.shape} / "
                         f"{v_new.shape} do not match")
    if c_pool is not None and c_pool.shape != (pools, hkv, n_pages, d):
        raise ValueError(f"c_pool must be {(pools, hkv, n_pages, d)}, got {c_pool.shape}")
    if s % pools or page.shape != (s,) or offset.shape != (s,) or write.shape != (s,):
        raise ValueError(f"page, offset and write must be [S]=[{s}] (S a multiple of the "
                         f"{pools} pools), got {page.shape}, {offset.shape}, {write.shape}")
    if _triton.pltriton is None:
        raise RuntimeError(_triton.status()[1])
    _triton.check_triton_shapes(d, bs)
    rows_per_pool = s // pools
    offset = offset.astype(jnp.int32)
    flags = write.astype(jnp.int32) * (1 + 2 * (offset == bs - 1).astype(jnp.int32))

    def pool_of(si):
        return 0 if pools == 1 else lax.div(si, rows_per_pool)

    slot = pl.BlockSpec((1,), lambda si, hi: (si,))
    k_row = pl.BlockSpec((None, None, d), lambda si, hi: (si, k_first + hi, 0))
    v_row = pl.BlockSpec((None, None, d), lambda si, hi: (si, v_first + hi, 0))
    kv_spec = pl.BlockSpec((None, None, n_pages, bs, d), lambda si, hi: (pool_of(si), hi, 0, 0, 0))
    c_spec = pl.BlockSpec((None, None, n_pages, d), lambda si, hi: (pool_of(si), hi, 0, 0))
    pools_in = [k_pool, v_pool] + ([c_pool] if c_pool is not None else [])
    specs = [kv_spec, kv_spec] + ([c_spec] if c_pool is not None else [])
    finish_ops, finish_in = ([], []) if k_finish is None else _triton.finish_specs(
        k_finish, lambda si, hi: si)
    first = 5 + len(finish_ops)         # the pools follow page, offset, flags, k, v (, finish)
    out = pl.pallas_call(
        functools.partial(_kernel, block_size=bs, centroids=c_pool is not None,
                          finish_eps=None if k_finish is None else k_finish.eps),
        grid=(s, hkv),
        in_specs=[slot, slot, slot, k_row, v_row] + finish_in + specs,
        out_specs=specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools_in],
        input_output_aliases={first + i: i for i in range(len(pools_in))},
        compiler_params=_triton.pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="sparrow_write_token_triton",
    )(page.astype(jnp.int32), offset, flags, k_new, v_new, *finish_ops, *pools_in)
    return out[0], out[1], (out[2] if c_pool is not None else None)
