"""Block-sparse decode attention as a Pallas kernel lowered to Triton (NVIDIA GPUs).

In jax 0.10.x ``pallas_call`` on GPU defaults to Mosaic GPU; passing
``jax.experimental.pallas.triton.CompilerParams`` selects the Triton lowering used here.

Design (shapes as in ``reference.py``):
  * One kernel, paged: K/V are page pools [G, Hkv, N, bs, D] and row b reads pool b // (B // G);
    the contiguous cache is the same thing viewed as B pools whose page ids are the block ids
    (``contiguous_as_pages``, a reshape): the contiguous sparse and dense entry points are views
    of this kernel (``dispatch.contiguous_view`` / ``dense_view``; dense at ``dense_tiling``'s
    tiles).
  * grid = (B, Hkv, n_split). A program owns one KV head's whole GQA group, padded to Gp >= 16
    rows so both products run on tensor cores (``tl.dot`` needs M >= 16), and walks its share of
    the selected entries P pages at a time: the P physical page ids are loaded as a vector and
    K/V are gathered as [P, bs, D] -> [P*bs, D] (no copy of the pool, just indexed loads); the
    length mask uses the entries' logical block ids.
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

try:     # jax deprecates the Pallas Triton backend from 0.11 and will remove it
    from jax.experimental.pallas import triton as pltriton
    _MISSING = ""
except ImportError as e:     # a jax without it: backend "auto" takes another GPU path
    pltriton = None
    _MISSING = f"jax {jax.__version__} has no Pallas Triton backend ({e})"

from pallas_kernels.reference import NEG_INF, check_page_ids, default_scale

# Programs needed to keep an H100 busy (132 SMs x ~2 resident CTAs): below this, split K.
_TARGET_PROGRAMS = 264


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton tensor sizes."""
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


def _kernel(nb_ref, len_ref, pid_ref, blk_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
            p_blocks: int, block_size: int, chunk: int, scale: float, precision):
    """nb_ref/len_ref [1]; pid_ref (physical pages) and blk_ref (logical blocks) [K_pad];
    q_ref [Gp, D]; k_ref/v_ref [N, bs, D] (the row's pool, this KV head);
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
        pages = pid_ref[pl.ds(e0, p_blocks)]                                 # [P]
        logical = blk_ref[pl.ds(e0, p_blocks)]
        kb = k_ref[pages].reshape(tok, d)                                    # gathered [P*bs, D]
        vb = v_ref[pages].reshape(tok, d)
        s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale     # [Gp, P*bs]
        # The mask follows the logical token position, wherever the page sits in the pool.
        pos = logical[:, None] * block_size + in_block
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


def _paged_call(q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths, *,
                scale: float, blocks_per_step: int, num_splits: int | None, num_warps: int,
                num_stages: int, interpret: bool):
    """The kernel launch behind every entry point (inputs already validated).

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D]; page_ids/block_indices [B, Hkv, K];
    num_blocks [B, Hkv]; lengths [B] -> out [B, Hq, D], lse [B, Hq] f32.
    """
    b, hq, d = q.shape
    pools, hkv, n_pages, block_size, _ = k_pages.shape
    rows_per_pool = b // pools
    g = hq // hkv
    kk = page_ids.shape[-1]
    p_blocks = min(next_pow2(blocks_per_step), next_pow2(kk))
    steps = -(-kk // p_blocks)
    n_split = num_splits or choose_splits(b, hkv, steps)
    chunk = -(-steps // n_split) * p_blocks
    k_pad = chunk * n_split
    # Clamped page ids: a bad id can never read outside the pool. Padding repeats the last entry
    # (masked: it is >= num_blocks).
    pid = jnp.clip(page_ids.astype(jnp.int32), 0, n_pages - 1)
    blk = block_indices.astype(jnp.int32)
    if k_pad != kk:
        pid = jnp.concatenate([pid, jnp.repeat(pid[..., -1:], k_pad - kk, axis=-1)], axis=-1)
        blk = jnp.concatenate([blk, jnp.repeat(blk[..., -1:], k_pad - kk, axis=-1)], axis=-1)
    nbv = jnp.clip(num_blocks.astype(jnp.int32), 0, kk)[..., None]           # [B, Hkv, 1]
    gp = max(16, next_pow2(g))
    qg = q.reshape(b, hkv, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))

    # The program of row b sees its pool's whole [N, bs, D] slab for its KV head and gathers
    # pages by id from it (indexed loads, no copy of the pool).
    def pool_map(bi, hi, si):
        if pools == 1:
            return 0, hi, 0, 0, 0
        return (bi if rows_per_pool == 1 else lax.div(bi, rows_per_pool)), hi, 0, 0, 0

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, p_blocks=p_blocks, block_size=block_size, chunk=chunk,
                               scale=scale, precision=precision)
    row_spec = pl.BlockSpec((None, None, k_pad), lambda bi, hi, si: (bi, hi, 0))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_split),
        in_specs=[
            pl.BlockSpec((None, None, 1), lambda bi, hi, si: (bi, hi, 0)),
            pl.BlockSpec((1,), lambda bi, hi, si: (bi,)),
            row_spec,
            row_spec,
            pl.BlockSpec((None, None, gp, d), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, n_pages, block_size, d), pool_map),
            pl.BlockSpec((None, None, n_pages, block_size, d), pool_map),
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
    )(nbv, lengths.astype(jnp.int32), pid, blk, qg, k_pages, v_pages)
    out, lse = merge_partials(acc[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g])
    return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def status() -> tuple[str, str]:
    """Whether this jax lowers Pallas to Triton: ("ok", ""), ("deprecated", why) - it still
    lowers, with a warning at every lowering (jax >= 0.11) - or ("unavailable", why): removed,
    or its deprecation made an error (`jax._src.deprecations.accelerate`)."""
    if pltriton is None:
        return "unavailable", _MISSING
    try:
        from jax._src import deprecations
        registered = "jax-pallas-triton" in deprecations._registered_deprecations
        accelerated = registered and deprecations.is_accelerated("jax-pallas-triton")
    except Exception:        # private API moved: judge by the import alone
        return "ok", ""
    if accelerated:
        return "unavailable", (f"jax {jax.__version__} turned the Pallas Triton backend's "
                               "deprecation into an error")
    if registered:
        return "deprecated", f"jax {jax.__version__} deprecates the Pallas Triton backend"
    return "ok", ""


def check_triton_shapes(d: int, block_size: int) -> None:
    """Triton tensors must have power-of-two sizes; these are the loaded tile dimensions."""
    if not _is_pow2(d):
        raise ValueError(f"pallas_triton needs a power-of-two head_dim, got D={d}")
    if not _is_pow2(block_size):
        raise ValueError(f"pallas_triton needs a power-of-two block_size, got {block_size}")


def paged_block_sparse_decode_triton(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_ids: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, blocks_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse decode over page pools via Pallas->Triton.

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D] (row b reads pool b // (B // G));
    page_ids [B, Hkv, K] physical pages to read (``reference.physical_pages``); block_indices
    [B, Hkv, K] their logical block ids (length mask only); num_blocks [B, Hkv]; lengths [B]
    -> out [B, Hq, D] (q.dtype), lse [B, Hq] f32.

    blocks_per_step: pages gathered per loop iteration (power of two; default 128 tokens' worth
      for 16-bit caches, 64 for f32).
    num_splits: split-K factor (None = automatic from B*Hkv).
    """
    *_, bs, d, _ = check_page_ids(q, k_pages, v_pages, page_ids, block_indices, num_blocks,
                                  lengths)
    check_triton_shapes(d, bs)
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(k_pages.dtype, bs)
    return _paged_call(q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths,
                       scale=default_scale(d, scale), blocks_per_step=blocks_per_step,
                       num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                       interpret=interpret)


def dense_tiling(s: int, dtype) -> tuple[int, int]:
    """Dense decode's tiles for the Triton kernels (``dispatch.dense_view``): 64-token pages (16
    where S is no multiple of 64; contiguous ids, so the 'gather' is a plain strided load) and
    the default pages per loop iteration. Returns (tile, tiles per step)."""
    tile = 64 if s % 64 == 0 else 16
    if s % tile:
        raise ValueError(f"Triton dense decode needs S to be a multiple of 16, got S={s}")
    return tile, default_blocks_per_step(dtype, tile)
