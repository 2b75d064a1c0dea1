"""Backend choice for the decode kernels: one public entry point, several implementations.

"auto" maps the platform to its best backend (cpu -> xla, tpu -> pallas_tpu, gpu -> pallas_triton)
and logs that choice once. On GPU it checks that this jax still lowers Pallas to Triton (jax 0.11
deprecates that backend: it still lowers, and the log says so); where a jax removed it, "auto"
takes jax_triton when jax-triton imports, else XLA, and logs why. An explicitly requested backend
that cannot run here raises ``BackendUnavailableError`` naming backend and platform: never a
silent fallback, because a silently slower (or differently rounded) path would corrupt
benchmarks and mismatch statistics.

Every backend has one kernel, the paged one (`paged_block_sparse_decode_<backend>`, which takes
composed physical page ids). The three entry points are views of it, each written once here for
every backend: `page_table_view` (a page table -> physical page ids), `contiguous_view` (a
contiguous cache as one page pool per row, page id = block id) and `dense_view` (every page of
the contiguous view selected, at the backend's dense tile size). XLA's dense decode is its own
chunked pass over S (`reference.dense_decode_xla`), not a view.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import jax_triton as _jt
from pallas_kernels import reference as _ref
from pallas_kernels import pallas_tpu as _tpu
from pallas_kernels import pallas_triton as _triton
from pallas_kernels.reference import (SelectedPages, all_blocks_selection, check_decode_inputs,
                                      check_paged_inputs, contiguous_as_pages, physical_pages)

log = logging.getLogger(__name__)

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_triton", "jax_triton")
_AUTO = {"cpu": "xla", "tpu": "pallas_tpu", "gpu": "pallas_triton"}
# The (platform, backend) choices of "auto" logged so far: each is logged once per process.
LOGGED_AUTO_CHOICES: set[tuple[str, str]] = set()


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run on this platform / installation."""


def current_platform() -> str:
    """'cpu', 'gpu' or 'tpu' (jax.default_backend(); CUDA and ROCm both report 'gpu')."""
    return jax.default_backend()


def resolve_backend(backend: str, *, interpret: bool = False, platform: str | None = None) -> str:
    """Returns the concrete backend name, or raises if it cannot run here.

    interpret=True lets the Pallas backends run on CPU in interpret mode (tests only; slow).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    platform = platform or current_platform()
    if backend == "auto":
        chosen, why = _AUTO.get(platform, "xla"), ""
        if platform == "gpu":
            chosen, why = gpu_auto()
        if (platform, chosen) not in LOGGED_AUTO_CHOICES:
            LOGGED_AUTO_CHOICES.add((platform, chosen))
            log.info("pallas_kernels: backend 'auto' on platform %r -> %r%s", platform, chosen,
                     f" ({why})" if why else "")
        return chosen
    if backend == "xla":
        return backend
    if backend == "pallas_tpu":
        if platform == "tpu" or interpret:
            return backend
        raise BackendUnavailableError(
            f"backend 'pallas_tpu' cannot run on platform {platform!r}: it needs a TPU "
            "(or interpret=True for CPU testing)")
    if backend == "pallas_triton":
        state, why = _triton.status()
        if state == "unavailable":
            raise BackendUnavailableError(f"backend 'pallas_triton' cannot run: {why}; use "
                                          "backend 'auto' (jax_triton or XLA on GPU)")
        if platform == "gpu" or interpret:
            return backend
        raise BackendUnavailableError(
            f"backend 'pallas_triton' cannot run on platform {platform!r}: it needs an NVIDIA "
            "GPU (or interpret=True for CPU testing)")
    # jax_triton: compiled by Triton itself, so there is no interpret mode.
    if platform != "gpu":
        raise BackendUnavailableError(
            f"backend 'jax_triton' cannot run on platform {platform!r}: it needs an NVIDIA GPU "
            "(it has no interpret mode; use 'pallas_triton' with interpret=True on CPU)")
    ok, why = _jt.available()
    if not ok:
        raise BackendUnavailableError(
            f"backend 'jax_triton' cannot run on platform {platform!r}: jax-triton/triton are "
            f"not importable ({why}); pip install 'sparrow-jax[gpu]'")
    return backend


def gpu_auto() -> tuple[str, str]:
    """The GPU backend "auto" takes, and why when it is not plain pallas_triton."""
    state, why = _triton.status()
    if state == "ok":
        return "pallas_triton", ""
    if state == "deprecated":
        return "pallas_triton", why + "; it still lowers here (jax_triton or XLA once removed)"
    ok, jt_why = _jt.available()
    if ok:
        return "jax_triton", why
    return "xla", f"{why}; jax-triton does not import either ({jt_why})"


# -- the views: every entry point is one of these over a backend's paged kernel -------------------

PagedKernel = Callable[..., tuple[jax.Array, jax.Array]]


def page_table_view(kernel: PagedKernel, q, k_pages, v_pages, page_table, block_indices,
                    num_blocks, lengths, *, scale: float | None = None, **options):
    """`kernel` (a backend's paged kernel) behind a page table: validates the inputs and composes
    the physical page ids once (`reference.physical_pages`). Shapes as in
    ``paged_block_sparse_decode``; options: the kernel's own tuning knobs."""
    check_paged_inputs(q, k_pages, v_pages, page_table, block_indices, num_blocks, lengths)
    return kernel(q, k_pages, v_pages, physical_pages(page_table, block_indices), block_indices,
                  num_blocks, lengths, scale=scale, **options)


def contiguous_view(kernel: PagedKernel, q, k, v, block_indices, num_blocks, lengths, *,
                    block_size: int = 16, scale: float | None = None, **options):
    """`kernel` over a contiguous cache k/v [B, Hkv, S, D]: B page pools of S // bs pages whose
    ids are the (clamped) block ids (a reshape: no copy). Shapes as in
    ``block_sparse_decode``."""
    _, _, _, s, _, _ = check_decode_inputs(q, k, v, lengths, block_size=block_size,
                                           block_indices=block_indices, num_blocks=num_blocks)
    ids = jnp.clip(block_indices.astype(jnp.int32), 0, s // block_size - 1)
    return kernel(q, contiguous_as_pages(k, block_size), contiguous_as_pages(v, block_size), ids,
                  ids, num_blocks, lengths, scale=scale, **options)


DenseTiling = Callable[[int, object], tuple[int, int]]


def dense_view(kernel: PagedKernel, tiling: DenseTiling, q, k, v, lengths, *,
               scale: float | None = None, identity: Callable | None = None, **options):
    """Dense decode as `kernel` over the contiguous view with every tile selected: tiling(S,
    dtype) -> (tile tokens, tiles per kernel step) is the backend's (large tiles: fewer copies
    and steps than 16-token blocks). Tiles at or past ceil(length / tile) are never read (the
    kernels loop to each row's num_blocks). identity: the backend's kernel that reads tile i
    as block i by itself (the same reads, no index arrays built: `IDENTITY_KERNELS`). Shapes
    as in ``dense_decode``."""
    b, _, hkv, s, _, _ = check_decode_inputs(q, k, v, lengths, block_size=1)
    tile, per_step = tiling(s, k.dtype)
    if identity is not None:
        return identity(q, contiguous_as_pages(k, tile), contiguous_as_pages(v, tile), lengths,
                        scale=scale, blocks_per_step=per_step, **options)
    idx, nb = all_blocks_selection(b, hkv, s, lengths, tile)
    return kernel(q, contiguous_as_pages(k, tile), contiguous_as_pages(v, tile), idx, idx, nb,
                  lengths, scale=scale, blocks_per_step=per_step, **options)


def paged_kernel(name: str, *, interpret: bool = False) -> PagedKernel:
    """The paged kernel of a resolved backend (interpret mode bound for the Pallas ones)."""
    if name == "xla":
        return _ref.paged_block_sparse_decode_xla
    if name == "pallas_tpu":
        return functools.partial(_tpu.paged_block_sparse_decode_tpu, interpret=interpret)
    if name == "pallas_triton":
        return functools.partial(_triton.paged_block_sparse_decode_triton, interpret=interpret)
    return _jt.paged_block_sparse_decode_jax_triton


# Dense decode's tiles per backend (the raw Triton kernel has the Pallas Triton one's limits).
DENSE_TILING = {"pallas_tpu": _tpu.dense_tiling, "pallas_triton": _triton.dense_tiling,
                "jax_triton": _triton.dense_tiling}
# Backends whose kernel reads every block of a row in order without an index array: dense decode
# builds none for them (on GPU an index array is a kernel launch of its own, every layer).
IDENTITY_KERNELS = {"pallas_triton": _triton.identity_decode_triton}


# -- the entry points -----------------------------------------------------------------------------

def block_sparse_decode(
    q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array, num_blocks: jax.Array,
    lengths: jax.Array, *, block_size: int = 16, scale: float | None = None, backend: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Exact softmax attention of one decode token over the selected KV blocks.

    Args:
      q: [B, Hq, D] queries (query head h uses KV head h // (Hq // Hkv)).
      k, v: [B, Hkv, S, D] KV cache, S a multiple of block_size.
      block_indices: [B, Hkv, K] int32 selected block ids; valid entries first (ascending),
        padding repeats the last valid id.
      num_blocks: [B, Hkv] int32 number of valid entries per row.
      lengths: [B] int32; tokens at index >= length are masked.
      scale: softmax scale (default 1/sqrt(D)).
      backend: "auto" | "xla" | "pallas_tpu" | "pallas_triton" | "jax_triton".
      interpret: run Pallas kernels in interpret mode (CPU tests).

    Returns:
      out [B, Hq, D] (q.dtype) and lse [B, Hq] f32 (natural-log normaliser of the scaled
      logits). Rows with num_blocks == 0 or length == 0 give zeros and lse = -inf.
    """
    kernel = paged_kernel(resolve_backend(backend, interpret=interpret), interpret=interpret)
    return contiguous_view(kernel, q, k, v, block_indices, num_blocks, lengths,
                           block_size=block_size, scale=scale)


def paged_block_sparse_decode(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    block_indices: jax.Array, num_blocks: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, backend: str = "auto", interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Exact softmax attention of one decode token over selected pages of a paged KV cache.

    Args:
      q: [B, Hq, D] queries (query head h uses KV head h // (Hq // Hkv)).
      k_pages, v_pages: [G, Hkv, N, bs, D] page pools (a page holds one block of bs tokens);
        row b reads pool b // (B // G) (G = 1: one shared pool; G = data shards: each shard's
        rows own a pool).
      page_table: [B, P] int32 physical page (in the row's pool) of each logical block 0..P-1.
      block_indices: [B, Hkv, K] int32 selected logical blocks, valid first (ascending), padding
        repeats the last valid id. Dense decode = all of a row's blocks
        (``reference.all_blocks_selection``).
      num_blocks: [B, Hkv] int32 valid entries per row; lengths: [B] int32 tokens per row
        (positions >= length are masked).

    Returns out [B, Hq, D] (q.dtype) and lse [B, Hq] f32, as ``block_sparse_decode``.
    """
    kernel = paged_kernel(resolve_backend(backend, interpret=interpret), interpret=interpret)
    return page_table_view(kernel, q, k_pages, v_pages, page_table, block_indices, num_blocks,
                           lengths, scale=scale)


def dense_decode(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, scale: float | None = None,
    backend: str = "auto", interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode attention over all tokens < length (the baseline); same interface and
    conventions as ``block_sparse_decode``. q [B, Hq, D], k/v [B, Hkv, S, D], lengths [B]."""
    name = resolve_backend(backend, interpret=interpret)
    if name == "xla":
        return _ref.dense_decode_xla(q, k, v, lengths, scale=scale)
    identity = IDENTITY_KERNELS.get(name)
    return dense_view(paged_kernel(name, interpret=interpret), DENSE_TILING[name], q, k, v,
                      lengths, scale=scale, identity=identity and functools.partial(
                          identity, interpret=interpret))


def paged_dense_decode(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    lengths: jax.Array, *, scale: float | None = None, backend: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode over a paged cache: every block < ceil(length / bs) of each row, read
    through its page table [B, P]. The same attention as ``paged_block_sparse_decode`` with
    every block selected (``reference.all_blocks_selection``), which is what the XLA, TPU and
    jax-triton backends run; the Pallas Triton kernel reads the table as its entry list (no
    index arrays). Other shapes as in ``paged_block_sparse_decode``."""
    name = resolve_backend(backend, interpret=interpret)
    if name == "pallas_triton":
        return _triton.paged_table_decode_triton(q, k_pages, v_pages, page_table, lengths,
                                                 scale=scale, interpret=interpret)
    b, hkv, bs = q.shape[0], k_pages.shape[1], k_pages.shape[3]
    idx, num = all_blocks_selection(b, hkv, page_table.shape[1] * bs, lengths, bs)
    return paged_block_sparse_decode(q, k_pages, v_pages, page_table, idx, num, lengths,
                                     scale=scale, backend=name, interpret=interpret)


def paged_covered_decode(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    selection: SelectedPages, covered: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, backend: str = "auto", interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """A sparse layer's decode, one call for every row: rows with covered [B] (bool: the budget
    covers the length) attend densely through their page table [B, P], the others over their
    selection (the kernels' own form, physical page ids: `selection.select_pages`). The Pallas
    Triton kernel does both in one launch; other backends run the dense and the sparse
    attention and keep each row's (``jnp.where``). Shapes as in ``paged_block_sparse_decode``."""
    name = resolve_backend(backend, interpret=interpret)
    if name == "pallas_triton":
        return _triton.paged_table_decode_triton(q, k_pages, v_pages, page_table, lengths,
                                                 selection=selection, covered=covered,
                                                 scale=scale, interpret=interpret)
    dense = paged_dense_decode(q, k_pages, v_pages, page_table, lengths, scale=scale,
                               backend=name, interpret=interpret)
    check_paged_inputs(q, k_pages, v_pages, page_table, selection.block_indices,
                       selection.num_blocks, lengths)
    sparse = paged_kernel(name, interpret=interpret)(q, k_pages, v_pages, *selection, lengths,
                                                     scale=scale)
    return tuple(jnp.where(covered.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
                 for x, y in zip(dense, sparse))
