"""Decode-attention kernels vs the XLA reference and a float64 NumPy reference (CPU).

Pallas kernels run in interpret mode, always inside jax.jit, at tiny shapes: interpret mode costs
roughly grid steps x operand size.
"""

from __future__ import annotations

import logging
import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from hf_fixtures import run_on_cpu_devices
from pallas_kernels import dispatch
from pallas_kernels.reference import all_blocks_selection

BS = 16
PALLAS = ["pallas_tpu", "pallas_triton"]
ALL = ["xla"] + PALLAS
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- helpers

def make_inputs(seed: int, *, b: int, hkv: int, g: int, s: int, d: int, dtype,
                lengths: list[int]) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hkv * g, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths, jnp.int32))


def make_selection(seed: int, lengths: list[int], hkv: int, kk: int,
                   empty_rows: tuple[tuple[int, int], ...] = ()) -> tuple[jax.Array, jax.Array]:
    """Random valid selections: ascending unique ids < ceil(len/bs), padding repeats the last."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    bi = np.zeros((b, hkv, kk), np.int32)
    nb = np.zeros((b, hkv), np.int32)
    for i, length in enumerate(lengths):
        total = -(-length // BS)
        for h in range(hkv):
            n = int(rng.integers(1, min(kk, total) + 1)) if total else 0
            n = 0 if (i, h) in empty_rows else n
            ids = np.sort(rng.choice(total, n, replace=False)) if n else np.zeros(0, np.int32)
            if n:
                bi[i, h, :n] = ids
                bi[i, h, n:] = ids[-1]
            nb[i, h] = n
    return jnp.asarray(bi), jnp.asarray(nb)


def numpy_decode(q, k, v, bi, nb, lengths, scale=None):
    """float64 reference: softmax over the tokens of the first nb selected blocks (< length)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    bi, nb, lengths = np.asarray(bi), np.asarray(nb), np.asarray(lengths)
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, d))
    lse = np.full((b, hq), -np.inf)
    for i in range(b):
        for h in range(hq):
            kh = h // g
            toks = np.concatenate([np.arange(j * BS, (j + 1) * BS) for j in bi[i, kh, :nb[i, kh]]]
                                  + [np.zeros(0, np.int64)])
            toks = toks[toks < lengths[i]]
            if toks.size == 0:
                continue
            sc = k[i, kh, toks] @ q[i, h] * scale
            m = sc.max()
            p = np.exp(sc - m)
            out[i, h] = p @ v[i, kh, toks] / p.sum()
            lse[i, h] = m + np.log(p.sum())
    return out, lse


def numpy_dense(q, k, v, lengths, scale=None):
    b, hkv, s, _ = k.shape
    nblk = s // BS
    bi = np.broadcast_to(np.arange(nblk), (b, hkv, nblk))
    nb = np.broadcast_to((-(-np.asarray(lengths) // BS))[:, None], (b, hkv))
    return numpy_decode(q, k, v, bi, nb, lengths, scale)


def run_sparse(backend, q, k, v, bi, nb, lengths, **kw):
    fn = jax.jit(lambda *a: pk.block_sparse_decode(*a, backend=backend,
                                                   interpret=backend in PALLAS, **kw))
    return fn(q, k, v, bi, nb, lengths)


def run_dense(backend, q, k, v, lengths, **kw):
    fn = jax.jit(lambda *a: pk.dense_decode(*a, backend=backend,
                                            interpret=backend in PALLAS, **kw))
    return fn(q, k, v, lengths)


def tol(dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)


def assert_close(got, want, dtype):
    out, lse = (np.asarray(x, np.float64) for x in got)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want[0], **tol(dtype))
    np.testing.assert_allclose(lse, want[1], **tol(dtype))


# ----------------------------------------------------------------------------- correctness

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_xla_matches_numpy(g, dtype):
    lengths = [1, 77, 128, 50]
    q, k, v, ln = make_inputs(g, b=4, hkv=2, g=g, s=128, d=32, dtype=dtype, lengths=lengths)
    bi, nb = make_selection(g, lengths, 2, 5, empty_rows=((3, 1),))
    got = run_sparse("xla", q, k, v, bi, nb, ln)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    assert_close(got, numpy_decode(q, k, v, bi, nb, ln), dtype)


# One case per (group, dtype) pairing keeps interpret-mode time down while covering all groups.
PALLAS_CASES = [(1, jnp.float32), (2, jnp.bfloat16), (4, jnp.float32), (8, jnp.bfloat16)]


@pytest.mark.parametrize("g,dtype", PALLAS_CASES, ids=lambda x: str(getattr(x, "__name__", x)))
@pytest.mark.parametrize("backend", PALLAS)
def test_pallas_matches_numpy_and_xla(backend, g, dtype):
    lengths = [93, 128]
    q, k, v, ln = make_inputs(10 + g, b=2, hkv=2, g=g, s=128, d=32, dtype=dtype, lengths=lengths)
    bi, nb = make_selection(g, lengths, 2, 5)
    got = run_sparse(backend, q, k, v, bi, nb, ln)
    assert got[0].dtype == dtype
    assert_close(got, numpy_decode(q, k, v, bi, nb, ln), dtype)
    ref = run_sparse("xla", q, k, v, bi, nb, ln)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32),
                               **tol(dtype))


@pytest.mark.parametrize("backend", ALL)
def test_all_blocks_equals_dense(backend):
    """K = all blocks must reproduce dense attention (f32 relative error <= 1e-5)."""
    lengths = [128, 45]
    q, k, v, ln = make_inputs(3, b=2, hkv=2, g=2, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi, nb = all_blocks_selection(2, 2, 128, ln, BS)
    sparse = run_sparse(backend, q, k, v, bi, nb, ln)
    dense = run_dense("xla", q, k, v, ln)
    want = numpy_dense(q, k, v, ln)
    for got in (sparse, dense):
        out = np.asarray(got[0], np.float64)
        rel = np.linalg.norm(out - want[0]) / np.linalg.norm(want[0])
        assert rel <= 1e-5, rel
        np.testing.assert_allclose(np.asarray(got[1]), want[1], rtol=1e-5)


@pytest.mark.parametrize("backend", PALLAS)
def test_pallas_dense_decode(backend):
    lengths = [200, 17]
    q, k, v, ln = make_inputs(4, b=2, hkv=1, g=4, s=256, d=32, dtype=jnp.float32,
                              lengths=lengths)
    assert_close(run_dense(backend, q, k, v, ln), numpy_dense(q, k, v, ln), jnp.float32)


@pytest.mark.parametrize("backend", ALL)
def test_empty_rows_give_zeros_and_neg_inf(backend):
    lengths = [0, 60]
    q, k, v, ln = make_inputs(5, b=2, hkv=2, g=2, s=64, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi, nb = make_selection(5, lengths, 2, 3, empty_rows=((1, 0),))
    out, lse = (np.asarray(x) for x in run_sparse(backend, q, k, v, bi, nb, ln))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[0], 0.0)            # length == 0
    np.testing.assert_array_equal(lse[0], -np.inf)
    np.testing.assert_array_equal(out[1, :2], 0.0)        # num_blocks == 0 for KV head 0
    np.testing.assert_array_equal(lse[1, :2], -np.inf)
    assert np.isfinite(lse[1, 2:]).all()
    dout, dlse = (np.asarray(x) for x in run_dense(backend, q, k, v, ln))
    np.testing.assert_array_equal(dout[0], 0.0)
    np.testing.assert_array_equal(dlse[0], -np.inf)


@pytest.mark.parametrize("backend", ALL)
def test_padding_and_custom_scale(backend):
    """Extra padding (repeats of the last id) changes nothing; scale is honoured."""
    lengths = [128, 70]
    q, k, v, ln = make_inputs(6, b=2, hkv=1, g=2, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi = jnp.array([[[0, 3, 5, 5]], [[1, 4, 4, 4]]], jnp.int32)
    nb = jnp.array([[3], [2]], jnp.int32)
    longer = jnp.concatenate([bi, jnp.repeat(bi[..., -1:], 5, axis=-1)], axis=-1)
    a = run_sparse(backend, q, k, v, bi, nb, ln, scale=0.3)
    c = run_sparse(backend, q, k, v, longer, nb, ln, scale=0.3)
    want = numpy_decode(q, k, v, bi, nb, ln, scale=0.3)
    assert_close(a, want, jnp.float32)
    assert_close(c, want, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_chunked_paths(monkeypatch, dtype):
    """Large problems run as a scan over chunks (online softmax); force tiny chunks here, with a
    chunk count that does not divide K (padding) and chunks holding no valid entry."""
    from pallas_kernels import reference
    monkeypatch.setattr(reference, "CHUNK_BYTES", 3 * 2 * 2 * 2 * BS * 32 * 4)
    lengths = [128, 0, 77]
    q, k, v, ln = make_inputs(9, b=3, hkv=2, g=2, s=128, d=32, dtype=dtype, lengths=lengths)
    bi, nb = make_selection(9, lengths, 2, 7, empty_rows=((2, 1),))
    assert_close(run_sparse("xla", q, k, v, bi, nb, ln), numpy_decode(q, k, v, bi, nb, ln), dtype)
    assert_close(run_dense("xla", q, k, v, ln), numpy_dense(q, k, v, ln), dtype)


def test_xla_leading_masked_chunks(monkeypatch):
    """The online softmax keeps masked scores finite (NEG_INF): a chunk that holds only masked
    tokens before any real one (here blocks past the length, one block per chunk) must leave no
    trace in the result, and a row with no real token gives 0 / -inf."""
    from pallas_kernels import reference
    monkeypatch.setattr(reference, "CHUNK_BYTES", 2 * 2 * 1 * BS * 32 * 4)   # 1 block per chunk
    lengths = [40, 40]
    q, k, v, ln = make_inputs(10, b=2, hkv=1, g=2, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi = jnp.array([[[6, 7, 0, 2]], [[5, 6, 7, 7]]], jnp.int32)    # row 1: nothing < length
    nb = jnp.array([[4], [3]], jnp.int32)
    got = run_sparse("xla", q, k, v, bi, nb, ln)
    assert_close(got, numpy_decode(q, k, v, bi, nb, ln), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got[0][1]), 0.0)


def test_xla_paged_reads_no_chunk_past_the_longest_row(monkeypatch):
    """Dense decode over a wide page table (every block selected, the rows far shorter): the
    XLA path stops at the chunk that holds the largest num_blocks. The entries past it point at
    a page of NaN - read, even masked, they would turn the result into NaN (0 * NaN) - and the
    result matches float64 NumPy, under jit and with the longest row in any position."""
    from pallas_kernels import reference
    monkeypatch.setattr(reference, "CHUNK_BYTES", 2 * 2 * 2 * BS * 32 * 4)   # 1 block per chunk
    lengths = [40, 17]                                   # 3 and 2 blocks of a 16-block table
    q, k, v, ln = make_inputs(11, b=2, hkv=2, g=2, s=256, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi, nb = reference.all_blocks_selection(2, 2, 256, ln, BS)
    n = 2 * 16 + 1                                       # pages: each row's blocks, then NaN
    kp = jnp.concatenate([k.reshape(2, 2, 16, BS, 32).swapaxes(0, 1).reshape(1, 2, 32, BS, 32),
                          jnp.full((1, 2, 1, BS, 32), jnp.nan)], axis=2)
    vp = jnp.concatenate([v.reshape(2, 2, 16, BS, 32).swapaxes(0, 1).reshape(1, 2, 32, BS, 32),
                          jnp.full((1, 2, 1, BS, 32), jnp.nan)], axis=2)
    want = numpy_decode(q, k, v, bi, nb, ln)
    for order in ([0, 1], [1, 0]):
        o = jnp.asarray(order)
        ids = jnp.where(bi < 3, jnp.arange(2)[:, None, None] * 16 + bi, n - 1)[o]
        got = jax.jit(reference.paged_block_sparse_decode_xla)(q[o], kp, vp, ids, bi[o], nb[o],
                                                               ln[o])
        assert_close(got, tuple(w[np.asarray(order)] for w in want), jnp.float32)


def test_triton_split_k_merge():
    """Forced split-K (including splits with no valid entry) matches the single-split result."""
    lengths = [128, 33]
    q, k, v, ln = make_inputs(7, b=2, hkv=1, g=2, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi, nb = all_blocks_selection(2, 1, 128, ln, BS)
    from pallas_kernels.pallas_triton import paged_block_sparse_decode_triton
    fn = jax.jit(lambda *a: dispatch.contiguous_view(paged_block_sparse_decode_triton, *a,
                                                     blocks_per_step=2, num_splits=3,
                                                     interpret=True))
    assert_close(fn(q, k, v, bi, nb, ln), numpy_decode(q, k, v, bi, nb, ln), jnp.float32)


def test_tpu_multi_step_online_softmax(monkeypatch):
    """Several grid steps per row (P=2 blocks per step), rows that finish early (steps skipped
    via pl.when, DMA index clamped), a K that is not a multiple of P, and the batch split over
    several pallas_calls (SMEM table budget) with the batch offset in the K/V index_map."""
    from pallas_kernels import pallas_tpu
    # Two int32 tables (page ids, logical ids) x Hkv=2 x K_pad=8, for 2 rows per call.
    monkeypatch.setattr(pallas_tpu, "SMEM_TABLE_BYTES", 2 * 4 * 2 * 8 * 2)
    lengths = [128, 40, 99]
    q, k, v, ln = make_inputs(8, b=3, hkv=2, g=4, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi, nb = make_selection(8, lengths, 2, 7)
    fn = jax.jit(lambda *a: dispatch.contiguous_view(pallas_tpu.paged_block_sparse_decode_tpu, *a,
                                                     blocks_per_step=2, interpret=True))
    assert_close(fn(q, k, v, bi, nb, ln), numpy_decode(q, k, v, bi, nb, ln), jnp.float32)


# ----------------------------------------------------------------------------- errors / dispatch

def _small():
    q, k, v, ln = make_inputs(0, b=2, hkv=2, g=2, s=64, d=32, dtype=jnp.float32,
                              lengths=[64, 64])
    bi, nb = all_blocks_selection(2, 2, 64, ln, BS)
    return q, k, v, bi, nb, ln


@pytest.mark.parametrize("mutate,match", [
    (lambda a: (a[0][:, :3], *a[1:]), "multiple of Hkv"),
    (lambda a: (a[0][:1], *a[1:]), "batch mismatch"),
    (lambda a: (a[0], a[1][:, :, :40], a[2][:, :, :40], *a[3:]), "multiple of block_size"),
    (lambda a: (a[0], a[1], a[2][..., :16], *a[3:]), "shapes differ"),
    (lambda a: (a[0][..., :16], *a[1:]), "head_dim mismatch"),
    (lambda a: (*a[:3], a[3][:, :1], *a[4:]), "block_indices"),
    (lambda a: (*a[:4], a[4][:, :1], a[5]), "num_blocks"),
    (lambda a: (*a[:5], a[5][:1]), "lengths"),
])
@pytest.mark.parametrize("backend", ALL)
def test_bad_inputs_raise(backend, mutate, match):
    args = mutate(_small())
    with pytest.raises(ValueError, match=match):
        pk.block_sparse_decode(*args, backend=backend, interpret=backend in PALLAS)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        pk.block_sparse_decode(*_small(), backend="cuda")
    with pytest.raises(ValueError, match="unknown backend"):
        pk.dense_decode(*_small()[:3], _small()[5], backend="nope")


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_triton", "jax_triton"])
def test_backend_unavailable_on_cpu_raises(backend):
    assert jax.default_backend() == "cpu"
    with pytest.raises(pk.BackendUnavailableError, match=f"'{backend}'.*platform 'cpu'"):
        pk.block_sparse_decode(*_small(), backend=backend)
    q, k, v, _, _, ln = _small()
    with pytest.raises(pk.BackendUnavailableError, match="platform 'cpu'"):
        pk.dense_decode(q, k, v, ln, backend=backend)
    if backend == "jax_triton":   # no interpret mode either
        with pytest.raises(pk.BackendUnavailableError, match="interpret"):
            pk.block_sparse_decode(*_small(), backend=backend, interpret=True)


def test_auto_picks_xla_on_cpu_and_logs_once(caplog):
    dispatch.LOGGED_AUTO_CHOICES.clear()
    with caplog.at_level(logging.INFO, logger="pallas_kernels.dispatch"):
        assert pk.resolve_backend("auto") == "xla"
        assert pk.resolve_backend("auto") == "xla"
    assert sum("-> 'xla'" in r.getMessage() for r in caplog.records) == 1
    assert pk.resolve_backend("auto", platform="tpu") == "pallas_tpu"
    assert pk.resolve_backend("auto", platform="gpu") == "pallas_triton"
    out, lse = run_sparse("auto", *_small())
    ref = run_sparse("xla", *_small())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref[0]))


@pytest.mark.parametrize("state, jt, expect", [
    (("ok", ""), (True, ""), "pallas_triton"),
    (("deprecated", "jax 0.11.2 deprecates the Pallas Triton backend"), (True, ""),
     "pallas_triton"),
    (("unavailable", "jax 0.13 has no Pallas Triton backend"), (True, ""), "jax_triton"),
    (("unavailable", "jax 0.13 has no Pallas Triton backend"), (False, "ImportError: triton"),
     "xla")])
def test_auto_on_gpu_survives_the_triton_deprecation(monkeypatch, caplog, state, jt, expect):
    """backend="auto" on GPU: Pallas Triton while this jax lowers it (saying so when it is
    deprecated), else jax_triton, else XLA - each choice logged with its reason; an explicit
    pallas_triton on a jax without it is an error naming why."""
    from pallas_kernels import jax_triton, pallas_triton
    monkeypatch.setattr(pallas_triton, "status", lambda: state)
    monkeypatch.setattr(jax_triton, "available", lambda: jt)
    dispatch.LOGGED_AUTO_CHOICES.clear()
    with caplog.at_level(logging.INFO, logger="pallas_kernels.dispatch"):
        assert pk.resolve_backend("auto", platform="gpu") == expect
    [line] = [r.getMessage() for r in caplog.records if "backend 'auto'" in r.getMessage()]
    assert f"-> '{expect}'" in line and (state[1] in line)
    dispatch.LOGGED_AUTO_CHOICES.clear()
    if state[0] == "unavailable":
        with pytest.raises(pk.BackendUnavailableError, match="Pallas Triton backend"):
            pk.resolve_backend("pallas_triton", platform="gpu")
    else:
        assert pk.resolve_backend("pallas_triton", platform="gpu") == "pallas_triton"


def test_this_jax_reports_its_triton_backend():
    from pallas_kernels import pallas_triton
    state, why = pallas_triton.status()
    assert state in ("ok", "deprecated") and (state == "ok") == (why == "")
    assert state == ("deprecated" if tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11)
                     else "ok"), (jax.__version__, state)


# ----------------------------------------------------------------------------- paged KV cache

def make_pages(seed: int, k, v, lengths, pools: int, *, spare: int = 3):
    """Scatters a contiguous cache k/v [B, Hkv, S, D] into `pools` page pools
    [G, Hkv, N, bs, D] in shuffled order (N = rows per pool x S/bs + `spare`; pages nobody maps
    hold noise, so a wrong page read shows) -> (k_pages, v_pages, page_table [B, S/bs]).
    Logical blocks at or past a row's ceil(length / bs) map to -1 (unallocated), as in an engine
    whose rows have not grown that far; their pages still hold the row's data."""
    rng = np.random.default_rng(seed)
    kf, vf = np.asarray(k, np.float32), np.asarray(v, np.float32)
    b, hkv, s, d = kf.shape
    nblk, rows = s // BS, b // pools
    n = rows * nblk + spare
    kp = 3.0 * rng.standard_normal((pools, hkv, n, BS, d)).astype(np.float32)
    vp = 3.0 * rng.standard_normal((pools, hkv, n, BS, d)).astype(np.float32)
    table = np.zeros((b, nblk), np.int32)
    for g in range(pools):
        perm = rng.permutation(n)
        for r in range(rows):
            row = g * rows + r
            for i in range(nblk):
                page = perm[r * nblk + i]
                table[row, i] = page
                kp[g, :, page] = kf[row, :, i * BS:(i + 1) * BS]
                vp[g, :, page] = vf[row, :, i * BS:(i + 1) * BS]
            table[row, -(-int(lengths[row]) // BS):] = -1
    return (jnp.asarray(kp, k.dtype), jnp.asarray(vp, v.dtype), jnp.asarray(table))


def run_paged(backend, q, kp, vp, table, bi, nb, lengths, **kw):
    fn = jax.jit(lambda *a: pk.paged_block_sparse_decode(*a, backend=backend,
                                                         interpret=backend in PALLAS, **kw))
    return fn(q, kp, vp, table, bi, nb, lengths)


PAGED_LENGTHS = [77, 128, 45, 16]      # partly filled last pages (77, 45) and exact fills


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pools", [1, 2])
def test_paged_xla_matches_numpy(pools, dtype):
    """G = 1 (shared pool) and 2 (two rows per pool; G = B is the contiguous view) with shuffled
    pages, against float64 NumPy and the contiguous XLA path on the same data."""
    q, k, v, ln = make_inputs(20 + pools, b=4, hkv=2, g=2, s=128, d=32, dtype=dtype,
                              lengths=PAGED_LENGTHS)
    bi, nb = make_selection(20 + pools, PAGED_LENGTHS, 2, 5, empty_rows=((2, 1),))
    kp, vp, table = make_pages(pools, k, v, PAGED_LENGTHS, pools)
    got = run_paged("xla", q, kp, vp, table, bi, nb, ln)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    assert_close(got, numpy_decode(q, k, v, bi, nb, ln), dtype)
    contiguous = run_sparse("xla", q, k, v, bi, nb, ln)
    for a, c in zip(got, contiguous):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                   rtol=1e-6, atol=1e-6)


# (pools, GQA group, dtype): one shared pool and two pools of two rows each.
PAGED_CASES = [(1, 2, jnp.float32), (2, 4, jnp.bfloat16)]


@pytest.mark.parametrize("pools,g,dtype", PAGED_CASES,
                         ids=lambda x: str(getattr(x, "__name__", x)))
@pytest.mark.parametrize("backend", PALLAS)
def test_paged_pallas_matches_xla_and_contiguous(backend, pools, g, dtype):
    q, k, v, ln = make_inputs(30 + g, b=4, hkv=2, g=g, s=128, d=32, dtype=dtype,
                              lengths=PAGED_LENGTHS)
    bi, nb = make_selection(30 + g, PAGED_LENGTHS, 2, 5)
    kp, vp, table = make_pages(g, k, v, PAGED_LENGTHS, pools)
    got = run_paged(backend, q, kp, vp, table, bi, nb, ln)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    assert_close(got, numpy_decode(q, k, v, bi, nb, ln), dtype)
    for want in (run_paged("xla", q, kp, vp, table, bi, nb, ln),
                 run_sparse(backend, q, k, v, bi, nb, ln)):
        for a, c in zip(got, want):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                       **tol(dtype))


@pytest.mark.parametrize("backend", ALL)
def test_paged_all_blocks_equals_dense(backend):
    """Selecting every block of a row through a shuffled shared pool is dense decode."""
    lengths = [128, 45]
    q, k, v, ln = make_inputs(11, b=2, hkv=2, g=2, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    kp, vp, table = make_pages(11, k, v, lengths, 1)
    bi, nb = all_blocks_selection(2, 2, 128, ln, BS)
    got = run_paged(backend, q, kp, vp, table, bi, nb, ln)
    want = numpy_dense(q, k, v, ln)
    rel = np.linalg.norm(np.asarray(got[0], np.float64) - want[0]) / np.linalg.norm(want[0])
    assert rel <= 1e-5, rel
    np.testing.assert_allclose(np.asarray(got[1]), want[1], rtol=1e-5)
    dense = run_dense(backend, q, k, v, ln)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(dense[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(dense[1]), rtol=1e-5, atol=1e-5)


def test_paged_kernel_knobs(monkeypatch):
    """The tuning paths on two pools of two rows: TPU with 2 pages per grid step and one row per
    pallas_call (the batch offset enters the pool index), Triton with forced split-K."""
    from pallas_kernels import reference, pallas_tpu
    from pallas_kernels.pallas_triton import paged_block_sparse_decode_triton
    monkeypatch.setattr(pallas_tpu, "SMEM_TABLE_BYTES", 2 * 4 * 2 * 8)      # 1 row per call
    q, k, v, ln = make_inputs(12, b=4, hkv=2, g=2, s=128, d=32, dtype=jnp.float32,
                              lengths=PAGED_LENGTHS)
    bi, nb = make_selection(12, PAGED_LENGTHS, 2, 7)
    kp, vp, table = make_pages(12, k, v, PAGED_LENGTHS, 2)
    ids = reference.physical_pages(table, bi)
    want = numpy_decode(q, k, v, bi, nb, ln)
    fns = [lambda *a: pallas_tpu.paged_block_sparse_decode_tpu(*a, blocks_per_step=2, interpret=True),
           lambda *a: paged_block_sparse_decode_triton(*a, blocks_per_step=2, num_splits=3,
                                                       interpret=True)]
    for fn in fns:
        assert_close(jax.jit(fn)(q, kp, vp, ids, bi, nb, ln), want, jnp.float32)


# -- the Pallas Triton kernel's other reads: the page table, table or selection per row -------

def _finished(x, weight, cos, sin, eps):
    """The model's finishing of raw heads x [B, H, D]: per-head RMSNorm, then RoPE (the
    reference of `pallas_triton.finished_rows`)."""
    from flax import nnx
    from sparrow_jax.model.qwen3 import RMSNorm, apply_rope
    norm = RMSNorm(x.shape[-1], eps, "head_dim")
    norm.weight = nnx.Param(weight)
    return apply_rope(norm(x)[:, None], cos[:, None], sin[:, None])[:, 0]


def _rope_tables(lengths, d):
    from sparrow_jax.model.qwen3 import rope_cos_sin
    cos, sin = rope_cos_sin((jnp.asarray(lengths) - 1)[:, None], d, 10000.0)
    return cos[:, 0], sin[:, 0]


@pytest.mark.parametrize("g,dtype,splits", [(2, jnp.float32, None), (4, jnp.bfloat16, 3)],
                         ids=["g2-f32", "g4-bf16-split3"])
def test_triton_table_and_either_reads_match_xla(g, dtype, splits):
    """The Triton kernel reading rows' pages through their page table: every row (dense:
    `paged_dense_decode`), and covered rows only with the others on their selection (one
    kernel for a sparse layer: `paged_covered_decode`), against the XLA path (all blocks
    selected / the dense and sparse results picked per row), on a shared pool of shuffled
    pages, one split (the kernel finishes the softmax) and three (merged after it)."""
    from pallas_kernels import reference
    from pallas_kernels.pallas_triton import paged_table_decode_triton
    q, k, v, ln = make_inputs(40 + g, b=4, hkv=2, g=g, s=128, d=32, dtype=dtype,
                              lengths=PAGED_LENGTHS)
    bi, nb = make_selection(40 + g, PAGED_LENGTHS, 2, 5, empty_rows=((2, 1),))
    kp, vp, table = make_pages(40 + g, k, v, PAGED_LENGTHS, 1)
    selected = reference.SelectedPages(reference.physical_pages(table, bi), bi, nb)
    covered = jnp.asarray([True, False, False, True])
    kw = dict(num_splits=splits, blocks_per_step=2, interpret=True)
    dense = jax.jit(lambda *a: paged_table_decode_triton(*a, **kw))(q, kp, vp, table, ln)
    either = jax.jit(lambda *a: paged_table_decode_triton(*a[:5], selection=a[5], covered=a[6],
                                                          **kw))(q, kp, vp, table, ln,
                                                                 selected, covered)
    want_dense = run_paged("xla", q, kp, vp, table, *all_blocks_selection(4, 2, 128, ln, BS),
                           ln)
    want_either = pk.paged_covered_decode(q, kp, vp, table, selected, covered, ln,
                                          backend="xla")
    for got, want in ((dense, want_dense), (either, want_either)):
        for a, c in zip(got, want):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                       **tol(dtype))
    assert_close(dense, numpy_dense(q, k, v, ln), dtype)


def test_triton_finishes_raw_query_heads():
    """With a HeadFinish the kernel RMSNorms and rotates the raw query heads as it reads them
    (the model's own math), and reads the queries as the first Hq heads of one [B, Hq + 2 Hkv,
    D] array of a layer's q, k and v heads."""
    from pallas_kernels.pallas_triton import paged_table_decode_triton
    from pallas_kernels.reference import HeadFinish
    q, k, v, ln = make_inputs(51, b=4, hkv=2, g=2, s=128, d=32, dtype=jnp.bfloat16,
                              lengths=PAGED_LENGTHS)
    kp, vp, table = make_pages(51, k, v, PAGED_LENGTHS, 1)
    rng = np.random.default_rng(51)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(32), jnp.bfloat16)
    cos, sin = _rope_tables(PAGED_LENGTHS, 32)
    finish = HeadFinish(weight, cos, sin, 1e-6)
    heads = jnp.concatenate([q, k[:, :, 0], v[:, :, 0]], axis=1)          # [B, Hq + 2 Hkv, D]
    got = jax.jit(lambda *a: paged_table_decode_triton(*a, q_finish=finish, q_heads=4,
                                                       interpret=True))(heads, kp, vp, table,
                                                                        ln)
    want = pk.paged_dense_decode(_finished(q, weight, cos, sin, 1e-6), kp, vp, table, ln,
                                 backend="xla")
    for a, c in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                   **tol(jnp.bfloat16))


@pytest.mark.parametrize("finish", [False, True], ids=["finished", "raw"])
def test_triton_token_write_matches_xla(finish):
    """One kernel writes each slot's key and value row into the page pools and, where the
    token fills its page, the page's centroid - the rows `paged.write_token_rows` writes and the
    centroid the XLA decode stores; inactive slots write nothing. raw: the keys arrive raw (the
    kernel finishes them) inside one array of q, k and v heads (k and v at offsets)."""
    from pallas_kernels.pallas_triton_write import write_token_triton
    from pallas_kernels.reference import HeadFinish
    from sparrow_jax.rollout.paged import write_token_rows
    rng = np.random.default_rng(60)
    s, hq, hkv, n, d = 4, 4, 2, 6, 32
    kp = jnp.asarray(rng.standard_normal((1, hkv, n, BS, d)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((1, hkv, n, BS, d)), jnp.bfloat16)
    cp = jnp.asarray(rng.standard_normal((1, hkv, n, d)), jnp.bfloat16)
    heads = jnp.asarray(rng.standard_normal((s, hq + 2 * hkv, d)), jnp.bfloat16)
    page = jnp.asarray([3, 0, 5, 1], jnp.int32)
    offset = jnp.asarray([BS - 1, 4, BS - 1, BS - 1], jnp.int32)
    write = jnp.asarray([True, True, True, False])
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.bfloat16)
    cos, sin = _rope_tables([40, 5, 16, 32], d)
    finishing = HeadFinish(weight, cos, sin, 1e-6) if finish else None
    k_new, v_new = heads[:, hq:hq + hkv], heads[:, hq + hkv:]
    got = jax.jit(lambda *a: write_token_triton(
        *a, k_finish=finishing, k_first=hq if finish else 0, v_first=hq + hkv if finish else 0,
        interpret=True))(kp, vp, cp, heads if finish else k_new, heads if finish else v_new,
                         page, offset, write)
    keys = _finished(k_new, weight, cos, sin, 1e-6) if finish else k_new
    want_k = write_token_rows(kp, keys, page, offset, write)
    want_v = write_token_rows(vp, v_new, page, offset, write)
    filled = write & (offset == BS - 1)
    pages = want_k[0][:, page].astype(jnp.float32)                        # [Hkv, S, bs, D]
    cent = jnp.mean(pages, axis=2).astype(cp.dtype)
    want_c = cp[0].at[:, jnp.where(filled, page, n)].set(cent, mode="drop")[None]
    for a, c in zip(got, (want_k, want_v, want_c)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    dense_only = jax.jit(lambda *a: write_token_triton(*a, interpret=True))(
        kp, vp, None, k_new, v_new, page, offset, write)
    assert dense_only[2] is None
    np.testing.assert_array_equal(np.asarray(dense_only[0], np.float32),
                                  np.asarray(write_token_rows(kp, k_new, page, offset, write),
                                             np.float32))


def test_tpu_paged_loops_over_each_rows_entries_only(monkeypatch):
    """The TPU kernel's per-row loop (manual double-buffered page copies) against the XLA
    reference: ragged num_blocks (a whole row empty, one head empty, a row of every entry), GQA
    4, page ids past num_blocks that are garbage (out of range: never read), 4 rows per program
    (the copy of the next row's first pages overlaps the current row's last step) with batch
    padding, entries no multiple of the pages per step, two pools of 3 rows (pool index by
    division) and the batch split over 2 pallas_calls (the offset enters the pool index)."""
    from pallas_kernels import reference, pallas_tpu
    monkeypatch.setattr(pallas_tpu, "SMEM_TABLE_BYTES", 2 * 4 * 2 * 6 * 4)     # 4 rows per call
    lengths = [77, 128, 45, 0, 128, 16]
    q, k, v, ln = make_inputs(13, b=6, hkv=2, g=4, s=128, d=32, dtype=jnp.float32,
                              lengths=lengths)
    bi, nb = make_selection(13, lengths, 2, 5, empty_rows=((2, 1),))
    bi = bi.at[1].set(jnp.asarray([0, 2, 3, 5, 7]))
    nb = nb.at[1].set(5)
    kp, vp, table = make_pages(13, k, v, lengths, 2)
    past = jnp.arange(5)[None, None, :] >= nb[..., None]
    ids = jnp.where(past, jnp.asarray([10**6, -7, 3, 10**6, -1]),
                    reference.physical_pages(table, bi))
    args = (q, kp, vp, ids, bi, nb, ln)
    want = reference.paged_block_sparse_decode_xla(*args)
    got = jax.jit(lambda *a: pallas_tpu.paged_block_sparse_decode_tpu(
        *a, blocks_per_step=2, interpret=True, rows_per_program=4))(*args)
    assert np.isneginf(np.asarray(got[1][3])).all() and not np.asarray(got[0][3]).any()
    assert_close(got, numpy_decode(q, k, v, bi, nb, ln), jnp.float32)
    for a, c in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


def _small_paged():
    q, k, v, bi, nb, ln = _small()
    kp, vp, table = make_pages(0, k, v, [64, 64], 1)
    return q, kp, vp, table, bi, nb, ln


@pytest.mark.parametrize("mutate,match", [
    (lambda a: (a[0], a[1][0], a[2][0], *a[3:]), r"k_pages and v_pages must both be \[G"),
    (lambda a: (a[0], a[1], a[2][..., :16], *a[3:]), r"k_pages and v_pages must both be \[G"),
    (lambda a: (a[0], jnp.concatenate([a[1]] * 3), jnp.concatenate([a[2]] * 3), *a[3:]),
     "multiple of the number of page pools G=3"),
    (lambda a: (*a[:3], a[3][:1], *a[4:]), r"page_table must be \[B, P\]"),
    (lambda a: (*a[:3], a[3][0], *a[4:]), r"page_table must be \[B, P\]"),
    (lambda a: (*a[:3], a[3][:, :0], *a[4:]), r"page_table must be \[B, P\]"),
    (lambda a: (*a[:3], a[3].astype(jnp.float32), *a[4:]), "page_table must be integer"),
    (lambda a: (*a[:4], a[4][:, :1], *a[5:]), "block_indices"),
    (lambda a: (*a[:6], a[6][:1]), "lengths"),
])
@pytest.mark.parametrize("backend", ALL)
def test_paged_bad_inputs_raise(backend, mutate, match):
    args = mutate(_small_paged())
    with pytest.raises(ValueError, match=match):
        pk.paged_block_sparse_decode(*args, backend=backend, interpret=backend in PALLAS)


def test_paged_kernels_check_page_ids():
    """The backends' own paged entry points take composed page ids [B, Hkv, K]."""
    from pallas_kernels import jax_triton, pallas_tpu, pallas_triton
    q, kp, vp, _, bi, nb, ln = _small_paged()
    for fn in (pallas_tpu.paged_block_sparse_decode_tpu, pallas_triton.paged_block_sparse_decode_triton,
               jax_triton.paged_block_sparse_decode_jax_triton):
        with pytest.raises(ValueError, match=r"page_ids must be \[B, Hkv, K\]"):
            fn(q, kp, vp, bi[:, :, :2], bi, nb, ln)
        with pytest.raises(ValueError, match="page_ids must be integer"):
            fn(q, kp, vp, bi.astype(jnp.float32), bi, nb, ln)


# ----------------------------------------------------------------------------- shard_map

SHARD_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, AxisType
    import pallas_kernels as pk
    from pallas_kernels.reference import all_blocks_selection
    assert len(jax.devices()) == 8
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    B, HKV, G, S, D = 4, 4, 2, 64, 32
    q = jnp.asarray(rng.standard_normal((B, HKV * G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, HKV, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, HKV, S, D)), jnp.float32)
    ln = jnp.asarray([64, 50, 17, 33], jnp.int32)
    bi = jnp.asarray(np.tile(np.array([0, 2, 3, 3], np.int32), (B, HKV, 1)))
    nb = jnp.asarray(rng.integers(1, 4, (B, HKV)), jnp.int32)
    specs = (P("data", "model"), P("data", "model"), P("data", "model"),
             P("data", "model"), P("data", "model"), P("data"))
    for backend in ("xla", "pallas_tpu", "pallas_triton"):
        interp = backend != "xla"
        f = lambda *a: pk.block_sparse_decode(*a, backend=backend, interpret=interp)
        want = jax.jit(f)(q, k, v, bi, nb, ln)
        sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs,
                                        out_specs=(P("data", "model"), P("data", "model")),
                                        check_vma=False))
        got = sharded(q, k, v, bi, nb, ln)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=1e-6)
        g = lambda q, k, v, ln: pk.dense_decode(q, k, v, ln, backend=backend, interpret=interp)
        dwant = jax.jit(g)(q, k, v, ln)
        dgot = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=specs[:3] + specs[5:],
                                     out_specs=(P("data", "model"), P("data", "model")),
                                     check_vma=False))(q, k, v, ln)
        np.testing.assert_allclose(np.asarray(dgot[0]), np.asarray(dwant[0]), rtol=1e-6, atol=1e-6)
        print(json.dumps({"backend": backend}))
""")


@pytest.mark.slow
def test_shard_map_matches_unsharded():
    """Batch over 'data', KV heads over 'model' on a 2x4 CPU mesh (8 forced host devices; the
    flag must be set before jax is imported, hence the subprocess)."""
    rows = run_on_cpu_devices(["-c", SHARD_SCRIPT], cwd=str(REPO), timeout=600,
                              env={"PYTHONPATH": str(REPO)})
    assert [r["backend"] for r in rows] == ["xla", "pallas_tpu", "pallas_triton"], rows
