"""Dense decode attention over a rollout cache, as every engine runs it, and the attention mass
per block that the verify-guided drafts of exact sparse rollout read (rollout/exact.py).

On the XLA backend (CPU) the attention is one pass over the cache in place - scores, softmax
and the value sum as whole-cache einsums - while its f32 scores fit `ONE_PASS_BYTES`. The
shared XLA kernel (`pallas_kernels.dense_decode`) instead walks the cache in chunks with an
online softmax, and XLA:CPU copies every chunk out of the cache before its dot: a profile of the
dense engine at 16K put 58 of its 98 ms per step in these copies (2026-11-27,
docs/benchmarks.md). Other backends run their dense kernel. The paged engine's pools are read
through page tables, a gather either way (`paged_decode`).

Numerics: the same softmax in another summation order (one pass instead of chunks): equal to
the kernel's to f32 rounding (tests/test_dense_attention.py), the same greedy tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.reference import all_blocks_selection

__all__ = ["ONE_PASS_BYTES", "one_pass", "fits_one_pass", "decode", "paged_decode",
           "block_mass_from_lse", "paged_block_mass_from_lse"]

# One pass while the f32 score block [B, Hq', S] stays within this many bytes (a whole
# program's temporaries are one allocation on XLA:CPU; this keeps the scores well inside it).
# Measured on the verify pass: 36 -> 28 ms per layer at 16K, 4 rows, 40 folded queries
# (2026-11-27, shared CPU).
ONE_PASS_BYTES = 256 << 20


def fits_one_pass(backend: str, rows: int, queries: int, keys: int) -> bool:
    """Whether `backend` runs dense attention of rows x queries (query heads, folded) over
    `keys` cache slots in one pass (`one_pass`): the XLA backend, scores within
    ONE_PASS_BYTES. Read at trace time (a test or bench may lower ONE_PASS_BYTES)."""
    return (pallas_kernels.resolve_backend(backend) == "xla"
            and 4 * rows * queries * keys <= ONE_PASS_BYTES)


def one_pass(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
             mass_block: int = 0):
    """Dense attention of q [B, Hq', D] over the keys < lengths[b] of k/v_cache [B, Hkv, S, D]
    in one pass (query head h reads KV head h // (Hq' / Hkv)). Returns (out [B, Hq', D],
    lse [B, Hq'] f32) as `pallas_kernels.dense_decode` (an empty row: out 0, lse -inf); with
    mass_block > 0 also the attention mass of every block of mass_block keys, summed over each
    KV head's queries: mass [B, Hkv, S // mass_block] f32 (0 for an empty row)."""
    b, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bhgd,bhtd->bhgt", qg, k_cache,
                        preferred_element_type=jnp.float32) * d ** -0.5
    visible = jnp.arange(s)[None, None, None, :] < lengths[:, None, None, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    ok = lengths[:, None, None, None] > 0
    p = jnp.exp(scores - jnp.where(ok, m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    inv = 1.0 / jnp.where(ok, l, 1.0)
    out = jnp.einsum("bhgt,bhtd->bhgd", p.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32) * inv
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
    result = (jnp.where(ok, out, 0.0).reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq))
    if not mass_block:
        return result
    per_key = jnp.einsum("bhgt,bhg->bht", p, jnp.where(ok, inv, 0.0)[..., 0])
    return result + (per_key.reshape(b, hkv, s // mass_block, mass_block).sum(-1),)


def decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
           backend: str) -> tuple[jax.Array, jax.Array]:
    """Dense decode attention over the static engine's cache: q [B, Hq, D], k/v [B, Hkv, S, D],
    lengths [B] -> (out [B, Hq, D], lse [B, Hq]): `one_pass` where it fits, else the
    backend's dense kernel."""
    b, hq, _ = q.shape
    if fits_one_pass(backend, b, hq, k_cache.shape[2]):
        return one_pass(q, k_cache, v_cache, lengths)
    return pallas_kernels.dense_decode(q, k_cache, v_cache, lengths, backend=backend)


def paged_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                 lengths: jax.Array, *, backend: str) -> tuple[jax.Array, jax.Array]:
    """Dense decode attention over the paged engine's pools (one pool, [1, Hkv, N, bs, D]):
    q [S, Hq, D], page_table [S, P], lengths [S] -> (out [S, Hq, D], lse [S, Hq]), the paged
    kernel with every block of a slot selected. On the XLA backend that kernel gathers the
    pages in chunks up to the longest slot's length; a one pass would first gather all P pages
    of the table per slot whatever its length (a copy either way), so the paged path stays the
    kernel's (not measured against a one pass: docs/benchmarks.md, "A fair dense baseline")."""
    s, p = page_table.shape
    bs = k_pool.shape[3]
    idx, num = all_blocks_selection(s, k_pool.shape[1], p * bs, lengths, bs)
    return pallas_kernels.paged_block_sparse_decode(q, k_pool, v_pool, page_table, idx, num,
                                                    lengths, backend=backend)


def block_mass_from_lse(q: jax.Array, k_cache: jax.Array, lse: jax.Array, lengths: jax.Array,
                        *, block_size: int, chunk_blocks: int = 256) -> jax.Array:
    """The attention mass per block of a dense pass whose normaliser lse [B, Hq'] is known
    (the dense kernels return it): q [B, Hq', D] over k_cache [B, Hkv, S, D], keys < lengths
    -> [B, Hkv, S // block_size] f32, summed over each KV head's queries. A second read of the
    keys (not the values), chunk_blocks blocks at a time; `one_pass` gives the same numbers
    for free where it runs."""
    b, hkv, s, d = k_cache.shape
    blocks = k_cache.reshape(b, hkv, s // block_size, block_size, d)

    def keys(first, count):                                   # [B, Hkv, count, bs, D]
        return jax.lax.dynamic_slice_in_dim(blocks, first, count, axis=2)
    return _mass_in_chunks(q, keys, lse, lengths, s // block_size, block_size, chunk_blocks)


def paged_block_mass_from_lse(q: jax.Array, k_pool: jax.Array, page_table: jax.Array,
                              lse: jax.Array, lengths: jax.Array, *,
                              chunk_blocks: int = 256) -> jax.Array:
    """`block_mass_from_lse` over one page pool [1, Hkv, N, bs, D] read through page_table
    [S, P]: q [S, Hq', D], lse [S, Hq'], lengths [S] -> [S, Hkv, P] f32 per logical block."""
    n_pages, bs = k_pool.shape[2], k_pool.shape[3]

    def keys(first, count):
        pages = jax.lax.dynamic_slice_in_dim(page_table, first, count, axis=1)
        return k_pool[0][:, jnp.clip(pages, 0, n_pages - 1)].swapaxes(0, 1)
    return _mass_in_chunks(q, keys, lse, lengths, page_table.shape[1], bs, chunk_blocks)


def _mass_in_chunks(q, keys, lse, lengths, num_blocks: int, block_size: int,
                    chunk_blocks: int) -> jax.Array:
    """sum over a KV head's queries of exp(q . k / sqrt(D) - lse) per block, keys(first,
    count) -> [B, Hkv, count, bs, D] the blocks first .. first + count - 1 (a `lax.map` over
    chunks of chunk_blocks). Returns [B, Hkv, num_blocks] f32."""
    b, hq, d = q.shape
    per = min(chunk_blocks, num_blocks)
    while num_blocks % per:
        per -= 1
    hkv = keys(0, per).shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    lse_g = lse.reshape(b, hkv, hq // hkv, 1, 1)

    def chunk(c):
        sc = jnp.einsum("bhgd,bhntd->bhgnt", qg, keys(c * per, per),
                        preferred_element_type=jnp.float32) * d ** -0.5
        pos = (c * per + jnp.arange(per))[:, None] * block_size + jnp.arange(block_size)
        visible = (pos[None] < lengths[:, None, None])[:, None, None]   # [B, 1, 1, per, bs]
        w = jnp.where(visible & jnp.isfinite(lse_g), jnp.exp(sc - lse_g), 0.0)
        return w.sum(axis=(2, 4))                                        # [B, Hkv, per]
    mass = jax.lax.map(chunk, jnp.arange(num_blocks // per))             # [NC, B, Hkv, per]
    return jnp.moveaxis(mass, 0, 2).reshape(b, hkv, num_blocks)
