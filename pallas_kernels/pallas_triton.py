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

from pallas_kernels.reference import (NEG_INF, HeadFinish, SelectedPages, check_page_ids,
                                      check_paged_inputs, default_scale)

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


def finished_rows(load, weight_ref, cos_ref, sin_ref, *, eps: float):
    """Raw projected head rows, RMSNorm'd and rotated as the model does it (`HeadFinish`).

    load(cols) -> [R, D] the rows with their columns in the order of cols [D] (an index
    vector: the rows are read twice, as they are and with their halves swapped, since a Triton
    tensor cannot be sliced); weight_ref [D]; cos_ref/sin_ref [D] f32 (the row's position).
    In the rows' dtype, op for op as `qwen3.RMSNorm` then `apply_rope`: the f32 normalisation
    (one factor per row, shared by both readings), its cast, the weight, then x * cos +
    rotate_half(x) * sin."""
    d = weight_ref.shape[0]
    half = d // 2
    cols = lax.broadcasted_iota(jnp.int32, (d,), 0)
    swapped = jnp.where(cols < half, cols + half, cols - half)
    x, xs = load(cols), load(swapped)
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    normed = weight_ref[cols].astype(dtype)[None, :] * (xf * inv).astype(dtype)
    normed_swapped = (weight_ref[swapped].astype(dtype)[None, :]
                      * (xs.astype(jnp.float32) * inv).astype(dtype))
    rotated = jnp.where((cols < half)[None, :], -normed_swapped, normed_swapped)
    return (normed * cos_ref[...].astype(dtype)[None, :]
            + rotated * sin_ref[...].astype(dtype)[None, :])


def finish_specs(finish: HeadFinish, row_map) -> tuple[list, list]:
    """The operands and block specs of a kernel that finishes heads as it reads them: the
    weight [D] whole, cos/sin [B, D] one row per program (row_map: grid -> its row index)."""
    d = finish.weight.shape[0]
    table = pl.BlockSpec((None, d), lambda *grid: (row_map(*grid), 0))
    return ([finish.weight, finish.cos.astype(jnp.float32), finish.sin.astype(jnp.float32)],
            [pl.BlockSpec((d,), lambda *grid: (0,)), table, table])


def _kernel(*refs, p_blocks: int, block_size: int, chunk: int, scale: float, precision,
            group: int, whole: str | None, selected: bool, normalize: bool,
            finish_eps: float | None):
    """One (row, KV head, split) program. How the row finds its pages:
    selected - nb_ref [1], pid_ref (physical pages) / blk_ref (logical blocks) [K]: the row's
      first nb entries;
    whole - the row reads every block < ceil(length / bs) instead (dense decode, no index
      arrays built for it): "table" - block i in page table_ref[i] (table_ref [P], the row's
      page table), "identity" - block i in page i (a contiguous cache viewed as pages);
    both - covered_ref [1] says which (nonzero: every block): one kernel for a sparse layer
      whose rows may be covered by their budget.
    len_ref [1]; q_ref [G, D] (the KV head's query group, read as Gp >= 16 rows: row G - 1
    repeated); with finish_eps, q_ref holds the raw projected heads and qw_ref [D], cos_ref /
    sin_ref [D] follow it (`finished_rows`); k_ref/v_ref [N, bs, D] (the row's pool, this KV
    head).
    Outputs, rows >= G never stored: normalize - out_ref [G, D] (q's dtype) and lse_ref [G]
    f32, the finished attention (one split); else acc_ref [G, D], m_ref/l_ref [G] f32, this
    split's unnormalised partials (`merge_partials`)."""
    refs = list(refs)
    len_ref = refs.pop(0)
    if selected:
        nb_ref, pid_ref, blk_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    if whole == "table":
        table_ref = refs.pop(0)
    if selected and whole:
        covered_ref = refs.pop(0)
    q_ref = refs.pop(0)
    finish_refs = [refs.pop(0) for _ in range(3)] if finish_eps is not None else []
    k_ref, v_ref, *out_refs = refs
    n_pages = k_ref.shape[0]
    split = pl.program_id(2)
    length = len_ref[0]
    lane = lax.broadcasted_iota(jnp.int32, (p_blocks,), 0)
    if whole:
        whole_width = table_ref.shape[0] if whole == "table" else n_pages
        n_whole = jnp.clip((length + block_size - 1) // block_size, 0, whole_width)
    if selected:
        width = pid_ref.shape[0]
        n_selected = jnp.clip(nb_ref[0], 0, width)
    if selected and whole:
        use_whole = covered_ref[0] != 0
        n_entries = jnp.where(use_whole, n_whole, n_selected)
    else:
        n_entries = n_selected if selected else n_whole

    def entries(e0):
        """Physical pages and logical blocks of entries e0 .. e0 + P - 1 [P]. A row that may
        read either list reads both (each start clamped into its list: the one the row does
        not use may be the shorter)."""
        if whole:
            if whole == "identity":
                every = e0 + lane, e0 + lane
            else:
                t0 = jnp.minimum(e0, whole_width - p_blocks) if selected else e0
                every = table_ref[pl.ds(t0, p_blocks)], e0 + lane
            if not selected:
                pages, logical = every
        if selected:
            s0 = jnp.minimum(e0, width - p_blocks) if whole else e0
            chosen = pid_ref[pl.ds(s0, p_blocks)], blk_ref[pl.ds(s0, p_blocks)]
            pages, logical = chosen
            if whole:
                pages = jnp.where(use_whole, every[0], chosen[0])
                logical = jnp.where(use_whole, every[1], chosen[1])
        # Clamped: a bad id can never read outside the pool.
        return jnp.clip(pages, 0, n_pages - 1), logical

    start = split * chunk
    stop = jnp.minimum(start + chunk, n_entries)
    n_steps = jnp.maximum(stop - start + p_blocks - 1, 0) // p_blocks
    gp = max(16, next_pow2(group))
    d = q_ref.shape[-1]
    rows = lax.broadcasted_iota(jnp.int32, (gp,), 0)
    # The group padded to Gp rows (tl.dot needs M >= 16) by reading its last row again.
    q_rows = jnp.minimum(rows, group - 1)
    if finish_refs:
        q = finished_rows(lambda cols: q_ref[q_rows[:, None], cols[None, :]], *finish_refs,
                          eps=finish_eps)
    else:
        q = q_ref[...] if gp == group else q_ref[q_rows]
    tok = p_blocks * block_size
    in_block = lax.broadcasted_iota(jnp.int32, (p_blocks, block_size), 1)
    slot = lax.broadcasted_iota(jnp.int32, (p_blocks, block_size), 0)

    def body(i, carry):
        acc, m, l = carry
        e0 = start + i * p_blocks
        pages, logical = entries(e0)                                         # [P]
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
    if normalize:      # one split: `merge_partials` of one part, here (w = exp(0) = 1)
        ok = l > 0.0
        safe = jnp.where(ok, l, 1.0)
        results = (jnp.where(ok[:, None], acc / safe[:, None], 0.0).astype(out_refs[0].dtype),
                   jnp.where(ok, m + jnp.log(safe), -jnp.inf))
    else:
        results = (acc, m, l)
    for ref, value in zip(out_refs, results):
        store_group_rows(ref, value, group)


def store_group_rows(ref, value, group: int) -> None:
    """Stores the first `group` rows of value [Gp, ...] into ref [group, ...]: all of it when
    Gp == group, else a masked store (row ids past the group are out of range and masked; a
    store of repeated ids would race in interpret mode)."""
    if value.shape[0] == group:
        ref[...] = value
        return
    rows = lax.broadcasted_iota(jnp.int32, value.shape, 0)
    index = tuple(lax.broadcasted_iota(jnp.int32, value.shape, a) for a in range(value.ndim))
    pltriton.store(ref.at[index], value, mask=rows < group)


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


def _padded_to(x: jax.Array, multiple: int) -> jax.Array:
    """x [..., W] with its last entry repeated up to a multiple of `multiple` entries (an entry
    list the kernel reads `multiple` at a time; the repeats lie past every row's count)."""
    w = x.shape[-1]
    extra = -w % multiple
    if not extra:
        return x
    return jnp.concatenate([x, jnp.repeat(x[..., -1:], extra, axis=-1)], axis=-1)


def _paged_call(q, k_pages, v_pages, lengths, *, selection: SelectedPages | None,
                whole: str | None, page_table: jax.Array | None, covered: jax.Array | None,
                q_finish: HeadFinish | None = None, q_heads: int | None = None, scale: float,
                blocks_per_step: int, num_splits: int | None, num_warps: int, num_stages: int,
                interpret: bool):
    """The kernel launch behind every entry point (inputs already validated).

    q [B, Hq, D]; k_pages/v_pages [G, Hkv, N, bs, D]; lengths [B]; what each row reads
    (`_kernel`): its selection (page ids / blocks [B, Hkv, K], counts [B, Hkv]), or every block
    (whole: "table" - through page_table [B, P], "identity" - page i = block i, the contiguous
    cache's view), or, both given, the one covered [B] bool says; q_finish: q holds raw
    projected heads, finished in the kernel (`finished_rows`); q_heads: the queries are q's
    first q_heads heads (None: all; the rest, e.g. the layer's keys and values in one
    [B, Hq + 2 Hkv, D] array, are never read)
    -> out [B, Hq, D] (q.dtype), lse [B, Hq] f32.
    """
    b, all_heads, d = q.shape
    hq = q_heads or all_heads
    pools, hkv, n_pages, block_size, _ = k_pages.shape
    rows_per_pool = b // pools
    g = hq // hkv
    widths = [selection.page_ids.shape[-1]] if selection is not None else []
    widths += [page_table.shape[-1] if whole == "table" else n_pages] if whole else []
    width = max(widths)
    p_blocks = min(next_pow2(blocks_per_step), next_pow2(width))
    steps = -(-width // p_blocks)
    n_split = num_splits or choose_splits(b, hkv, steps)
    chunk = -(-steps // n_split) * p_blocks

    def head_map(bi, hi, si):
        return bi, hi, 0

    def row_map(bi, hi, si):
        return bi, 0

    operands, in_specs = [lengths.astype(jnp.int32)], [pl.BlockSpec((1,), lambda bi, hi, si: (bi,))]
    if selection is not None:
        # Entry lists whole steps long (the kernel reads P entries at a time); clamping of ids
        # and counts happens in the kernel.
        pid = _padded_to(selection.page_ids.astype(jnp.int32), p_blocks)
        blk = _padded_to(selection.block_indices.astype(jnp.int32), p_blocks)
        entries = pl.BlockSpec((None, None, pid.shape[-1]), head_map)
        operands += [selection.num_blocks.astype(jnp.int32)[..., None], pid, blk]
        in_specs += [pl.BlockSpec((None, None, 1), head_map), entries, entries]
    if whole == "table":
        table = _padded_to(page_table.astype(jnp.int32), p_blocks)
        operands.append(table)
        in_specs.append(pl.BlockSpec((None, table.shape[-1]), row_map))
    if selection is not None and whole:
        operands.append(covered.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((1,), lambda bi, hi, si: (bi,)))

    # The program of row b sees its pool's whole [N, bs, D] slab for its KV head and gathers
    # pages by id from it (indexed loads, no copy of the pool).
    def pool_map(bi, hi, si):
        if pools == 1:
            return 0, hi, 0, 0, 0
        return (bi if rows_per_pool == 1 else lax.div(bi, rows_per_pool)), hi, 0, 0, 0

    pool_spec = pl.BlockSpec((None, None, n_pages, block_size, d), pool_map)
    if all_heads % g:
        raise ValueError(f"q's {all_heads} heads are no whole number of {g}-head groups")
    operands.append(q.reshape(b, all_heads // g, g, d))      # group i: KV head i's queries
    in_specs.append(pl.BlockSpec((None, None, g, d), lambda bi, hi, si: (bi, hi, 0, 0)))
    if q_finish is not None:
        finish_ops, finish_in = finish_specs(q_finish, lambda bi, hi, si: bi)
        operands += finish_ops
        in_specs += finish_in
    operands += [k_pages, v_pages]
    in_specs += [pool_spec, pool_spec]
    # One split: the kernel finishes the softmax itself (no merge after it).
    normalize = n_split == 1
    if normalize:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
                     jax.ShapeDtypeStruct((b, hkv, g), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, g, d), lambda bi, hi, si: (bi, hi, 0, 0)),
                     pl.BlockSpec((None, None, g), lambda bi, hi, si: (bi, hi, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((n_split, b, hkv, g, d), jnp.float32),
                     jax.ShapeDtypeStruct((n_split, b, hkv, g), jnp.float32),
                     jax.ShapeDtypeStruct((n_split, b, hkv, g), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, g, d),
                                  lambda bi, hi, si: (si, bi, hi, 0, 0)),
                     pl.BlockSpec((None, None, None, g), lambda bi, hi, si: (si, bi, hi, 0)),
                     pl.BlockSpec((None, None, None, g), lambda bi, hi, si: (si, bi, hi, 0))]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, p_blocks=p_blocks, block_size=block_size, chunk=chunk,
                               scale=scale, precision=precision, group=g, whole=whole,
                               selected=selection is not None, normalize=normalize,
                               finish_eps=None if q_finish is None else q_finish.eps)
    results = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_split),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparrow_block_sparse_decode_triton",
    )(*operands)
    if normalize:
        out, lse = results
    else:
        out, lse = merge_partials(*results)
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
    return _paged_call(q, k_pages, v_pages, lengths,
                       selection=SelectedPages(page_ids, block_indices, num_blocks), whole=None,
                       page_table=None, covered=None, scale=default_scale(d, scale),
                       blocks_per_step=blocks_per_step or default_blocks_per_step(
                           k_pages.dtype, bs), num_splits=num_splits, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret)


def _stand_in_selection(q: jax.Array, k_pages: jax.Array) -> SelectedPages:
    """Shapes only: a one-entry selection per (row, KV head), so that the shared checks
    validate every other input of a call that has no selection."""
    b, hkv = q.shape[0] if q.ndim == 3 else 1, k_pages.shape[1] if k_pages.ndim == 5 else 1
    one = jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)
    return SelectedPages(one, one, jax.ShapeDtypeStruct((b, hkv), jnp.int32))


def _whole_rows_call(q, k_pages, v_pages, lengths, *, whole: str, page_table, selection,
                     covered, q_finish, q_heads, scale, blocks_per_step, num_splits, num_warps,
                     num_stages, interpret):
    """Validates and launches a call whose rows (or covered rows) read every block: whole
    "table" (through page_table) or "identity"; see `paged_table_decode_triton`."""
    if (selection is None) != (covered is None):
        raise ValueError("selection and covered go together (rows read one or the other)")
    queries = q if q_heads is None else jax.ShapeDtypeStruct(q.shape[:1] + (q_heads,)
                                                             + q.shape[2:], q.dtype)
    sel = selection or _stand_in_selection(q, k_pages)
    table = page_table if whole == "table" else jax.ShapeDtypeStruct((q.shape[0], 1), jnp.int32)
    *_, bs, d, _ = check_paged_inputs(queries, k_pages, v_pages, table, sel.block_indices,
                                      sel.num_blocks, lengths)
    check_page_ids(queries, k_pages, v_pages, *sel, lengths)
    if covered is not None and covered.shape != lengths.shape:
        raise ValueError(f"covered must be [B]={lengths.shape}, got {covered.shape}")
    check_triton_shapes(d, bs)
    return _paged_call(q, k_pages, v_pages, lengths, selection=selection, whole=whole,
                       page_table=page_table, covered=covered, q_finish=q_finish,
                       q_heads=q_heads, scale=default_scale(d, scale),
                       blocks_per_step=blocks_per_step or default_blocks_per_step(
                           k_pages.dtype, bs), num_splits=num_splits, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret)


def paged_table_decode_triton(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    lengths: jax.Array, *, selection: SelectedPages | None = None,
    covered: jax.Array | None = None, q_finish: HeadFinish | None = None,
    q_heads: int | None = None, scale: float | None = None,
    blocks_per_step: int | None = None, num_splits: int | None = None, num_warps: int = 4,
    num_stages: int = 2, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Decode over page pools in which rows read every block of theirs through the page table
    page_table [B, P] (dense: the table is the kernel's entry list, no index arrays built), or,
    with `selection` (the kernels' own form, [B, Hkv, K]) and covered [B] bool, only the
    covered rows do and the others read their selection: one kernel for a sparse layer whose
    rows' budgets may cover their lengths, with no branch around it. q_finish: q [B, Hq, D]
    holds the raw projected heads, RMSNorm'd and rotated here (`finished_rows`). q_heads: the
    queries are q's first q_heads heads (`_paged_call`). Other arguments and the result as
    `paged_block_sparse_decode_triton`."""
    return _whole_rows_call(q, k_pages, v_pages, lengths, whole="table", page_table=page_table,
                            selection=selection, covered=covered, q_finish=q_finish,
                            q_heads=q_heads, scale=scale, blocks_per_step=blocks_per_step,
                            num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                            interpret=interpret)


def identity_decode_triton(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, *,
    selection: SelectedPages | None = None, covered: jax.Array | None = None,
    q_finish: HeadFinish | None = None, q_heads: int | None = None,
    scale: float | None = None, blocks_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`paged_table_decode_triton` over a contiguous cache viewed as one pool per row
    (``contiguous_as_pages``: k_pages/v_pages [B, Hkv, N, tile, D]), page i = block i: rows
    read every block < ceil(length / tile) in order, with no index arrays (dense decode,
    ``dispatch.dense_view``), or, with a selection (page ids = block ids) and covered [B],
    only the covered rows do (a static-cache sparse layer in one kernel)."""
    return _whole_rows_call(q, k_pages, v_pages, lengths, whole="identity", page_table=None,
                            selection=selection, covered=covered, q_finish=q_finish,
                            q_heads=q_heads, scale=scale, blocks_per_step=blocks_per_step,
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
