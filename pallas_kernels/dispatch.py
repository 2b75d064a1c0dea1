"""Backend choice for the decode kernels: one public entry point, several implementations.

"auto" maps the platform to its best backend (cpu -> xla, tpu -> pallas_tpu, gpu -> pallas_triton)
and logs that choice once. On GPU it checks that this jax still lowers Pallas to Triton (jax 0.11
deprecates that backend: it still lowers, and the log says so); where a jax removed it, "auto"
takes jax_triton when jax-triton imports, else XLA, and logs why. An explicitly requested backend that cannot run here raises
``BackendUnavailableError`` naming backend and platform: never a silent fallback, because a
silently slower (or differently rounded) path would corrupt benchmarks and mismatch statistics.
"""

from __future__ import annotations

import logging

import jax

from pallas_kernels import jax_triton as _jt
from pallas_kernels import reference as _ref
from pallas_kernels import tpu as _tpu
from pallas_kernels import triton as _triton

log = logging.getLogger(__name__)

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_triton", "jax_triton")
_AUTO = {"cpu": "xla", "tpu": "pallas_tpu", "gpu": "pallas_triton"}
_logged: set[tuple[str, str]] = set()


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
        if (platform, chosen) not in _logged:
            _logged.add((platform, chosen))
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


def block_sparse_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    num_blocks: jax.Array,
    lengths: jax.Array,
    *,
    block_size: int = 16,
    scale: float | None = None,
    backend: str = "auto",
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
    name = resolve_backend(backend, interpret=interpret)
    kw = dict(block_size=block_size, scale=scale)
    if name == "xla":
        return _ref.block_sparse_decode_xla(q, k, v, block_indices, num_blocks, lengths, **kw)
    if name == "pallas_tpu":
        return _tpu.block_sparse_decode_tpu(q, k, v, block_indices, num_blocks, lengths,
                                            interpret=interpret, **kw)
    if name == "pallas_triton":
        return _triton.block_sparse_decode_triton(q, k, v, block_indices, num_blocks, lengths,
                                                  interpret=interpret, **kw)
    return _jt.block_sparse_decode_jax_triton(q, k, v, block_indices, num_blocks, lengths, **kw)


def paged_block_sparse_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    block_indices: jax.Array,
    num_blocks: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
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
    _ref.check_paged_inputs(q, k_pages, v_pages, page_table, block_indices, num_blocks, lengths)
    name = resolve_backend(backend, interpret=interpret)
    page_ids = _ref.physical_pages(page_table, block_indices)
    args = (q, k_pages, v_pages, page_ids, block_indices, num_blocks, lengths)
    if name == "xla":
        return _ref.paged_block_sparse_decode_xla(*args, scale=scale)
    if name == "pallas_tpu":
        return _tpu.paged_block_sparse_decode_tpu(*args, scale=scale, interpret=interpret)
    if name == "pallas_triton":
        return _triton.paged_block_sparse_decode_triton(*args, scale=scale, interpret=interpret)
    return _jt.paged_block_sparse_decode_jax_triton(*args, scale=scale)


def dense_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Dense decode attention over all tokens < length (the baseline); same interface and
    conventions as ``block_sparse_decode``. q [B, Hq, D], k/v [B, Hkv, S, D], lengths [B]."""
    name = resolve_backend(backend, interpret=interpret)
    if name == "xla":
        return _ref.dense_decode_xla(q, k, v, lengths, scale=scale)
    if name == "pallas_tpu":
        return _tpu.dense_decode_tpu(q, k, v, lengths, scale=scale, interpret=interpret)
    if name == "pallas_triton":
        return _triton.dense_decode_triton(q, k, v, lengths, scale=scale, interpret=interpret)
    return _jt.dense_decode_jax_triton(q, k, v, lengths, scale=scale)
