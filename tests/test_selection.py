"""Block selection (docs/method.md) vs NumPy brute force."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.dryrun.hlo import large_sorts, sort_and_topk_ops
from sparrow_jax.sparsity import block_scores
from sparrow_jax.sparsity import selection as sel

BS = 16


def brute_force(scores: np.ndarray, length: int, budget: int, max_selected: int):
    """The rule, written the obvious way for one row."""
    total = -(-length // BS)
    if total <= budget:
        ids = list(range(total))
    else:
        mid = list(range(1, total - 2))
        # Highest score first, lowest index first among ties.
        mid.sort(key=lambda j: (-scores[j], j))
        ids = sorted([0, total - 2, total - 1] + mid[:budget - 3])
    n = len(ids)
    pad = ids[-1] if ids else 0
    return np.array(ids + [pad] * (max_selected - n), np.int32), n


def check_rows(scores, lengths, budgets, got_idx, got_n, max_selected):
    flat_s = np.asarray(scores).reshape(-1, scores.shape[-1])
    for r, (s, length, budget) in enumerate(zip(flat_s, np.ravel(lengths), np.ravel(budgets))):
        want, n = brute_force(s, int(length), min(int(budget), max_selected), max_selected)
        np.testing.assert_array_equal(np.asarray(got_idx).reshape(-1, max_selected)[r], want,
                                      err_msg=f"row {r}: length={length} budget={budget}")
        assert int(np.ravel(got_n)[r]) == n


@pytest.mark.parametrize("tied", [False, True])
def test_select_matches_brute_force(tied):
    rng = np.random.default_rng(1 if tied else 0)
    nb, rows, max_sel = 40, 64, 12
    # Integer scores make many ties: the lowest index must win deterministically.
    scores = (rng.integers(0, 4, (rows, nb)) if tied else rng.standard_normal((rows, nb)))
    scores = scores.astype(np.float32)
    lengths = rng.integers(0, nb * BS + 1, rows).astype(np.int32)
    budgets = rng.integers(3, max_sel + 4, rows).astype(np.int32)   # some above max_selected
    f = jax.jit(lambda s, l, b: sel.select_from_scores(s, l, b, max_selected=max_sel))
    idx, n = f(scores, lengths, budgets)
    assert idx.shape == (rows, max_sel) and idx.dtype == jnp.int32 and n.dtype == jnp.int32
    check_rows(scores, lengths, budgets, idx, n, max_sel)


def test_keeps_sink_and_local_and_padding_rule():
    scores = np.zeros((1, 20), np.float32)
    scores[0, 7] = 5.0
    idx, n = sel.select_from_scores(jnp.asarray(scores), jnp.array([300]), jnp.array([4]),
                                    max_selected=8)
    # 300 tokens -> 19 blocks: sink 0, best middle 7, local 17 and 18 (18 is partial).
    assert int(n[0]) == 4
    np.testing.assert_array_equal(np.asarray(idx[0]), [0, 7, 17, 18, 18, 18, 18, 18])


def test_budget_covering_all_blocks_is_dense():
    scores = jnp.asarray(np.random.default_rng(2).standard_normal((3, 10)), jnp.float32)
    lengths = jnp.array([160, 17, 1])
    idx, n = sel.select_from_scores(scores, lengths, jnp.array([10, 2 + 1, 3]), max_selected=10)
    np.testing.assert_array_equal(np.asarray(n), [10, 2, 1])
    np.testing.assert_array_equal(np.asarray(idx[0]), np.arange(10))
    np.testing.assert_array_equal(np.asarray(idx[1]), [0, 1] + [1] * 8)
    np.testing.assert_array_equal(np.asarray(idx[2]), [0] * 10)


def test_empty_row_and_per_row_budgets():
    scores = jnp.asarray(np.random.default_rng(3).standard_normal((3, 16)), jnp.float32)
    idx, n = sel.select_from_scores(scores, jnp.array([0, 256, 256]), jnp.array([5, 3, 6]),
                                    max_selected=6)
    np.testing.assert_array_equal(np.asarray(n), [0, 3, 6])
    np.testing.assert_array_equal(np.asarray(idx[0]), [0] * 6)
    np.testing.assert_array_equal(np.asarray(idx[1]), [0, 14, 15, 15, 15, 15])
    check_rows(scores, [0, 256, 256], [5, 3, 6], idx, n, 6)


def test_leading_time_dim():
    """Teacher-forced use: scores [B, T, Hkv, NB], lengths/budgets [B, T, Hkv]."""
    rng = np.random.default_rng(4)
    b, t, hkv, nb, max_sel = 2, 5, 3, 24, 7
    scores = rng.standard_normal((b, t, hkv, nb)).astype(np.float32)
    lengths = np.broadcast_to((np.arange(t) * 70 + 50)[None, :, None], (b, t, hkv))
    budgets = rng.integers(3, max_sel + 1, (b, t, hkv))
    f = jax.jit(lambda s, l, bb: sel.select_from_scores(s, l, bb, max_selected=max_sel))
    idx, n = f(scores, lengths, budgets)
    assert idx.shape == (b, t, hkv, max_sel) and n.shape == (b, t, hkv)
    check_rows(scores, lengths, budgets, idx, n, max_sel)


def test_invalid_budgets_raise():
    s = jnp.zeros((1, 8))
    with pytest.raises(ValueError, match="budget_blocks must be >= 3"):
        sel.select_from_scores(s, jnp.array([128]), jnp.array([2]), max_selected=4)
    with pytest.raises(ValueError, match="max_selected must be >= 3"):
        sel.select_from_scores(s, jnp.array([128]), jnp.array([3]), max_selected=2)


def test_block_centroids_mean_in_f32():
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((2, 3, 64, 8)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        kj = jnp.asarray(keys, dtype)
        c = jax.jit(block_scores.block_centroids)(kj)
        assert c.shape == (2, 3, 4, 8) and c.dtype == dtype
        want = np.asarray(kj, np.float64).reshape(2, 3, 4, 16, 8).mean(axis=3)
        np.testing.assert_allclose(np.asarray(c, np.float64), want,
                                   atol=1e-6 if dtype == jnp.float32 else 1e-2)
    kmin, kmax = block_scores.block_minmax(jnp.asarray(keys))
    np.testing.assert_array_equal(np.asarray(kmin), keys.reshape(2, 3, 4, 16, 8).min(axis=3))
    np.testing.assert_array_equal(np.asarray(kmax), keys.reshape(2, 3, 4, 16, 8).max(axis=3))


def test_update_centroid_tracks_full_recompute():
    """Decode loop: write one key per step; per-step update == recompute for every full block."""
    rng = np.random.default_rng(6)
    b, hkv, s, d = 2, 2, 64, 8
    keys = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    cache = jnp.zeros_like(keys)
    cents = jnp.zeros((b, hkv, s // BS, d), jnp.float32)
    start = np.array([0, 5])                                # ragged rows
    upd = jax.jit(block_scores.update_centroid)
    for step in range(s - 5):
        pos = start + step
        cache = cache.at[np.arange(b), :, pos].set(keys[np.arange(b), :, pos])
        cents = upd(cents, cache, jnp.asarray(pos + 1, jnp.int32))
        for r in range(b):
            full = (pos[r] + 1) // BS
            want = np.asarray(cache[r]).reshape(hkv, -1, BS, d).mean(axis=2)[:, :full]
            np.testing.assert_allclose(np.asarray(cents[r, :, :full]), want, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(cents[r, :, full:]), 0.0)


def test_centroid_scores_group_mean_and_time_axis():
    rng = np.random.default_rng(7)
    b, t, hq, hkv, nb, d = 2, 3, 8, 2, 5, 4
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    c = rng.standard_normal((b, hkv, nb, d)).astype(np.float32)
    qm = q.reshape(b, t, hkv, hq // hkv, d).mean(axis=3)
    want = np.einsum("bthd,bhnd->bthn", qm, c)
    got = jax.jit(block_scores.centroid_scores)(jnp.asarray(q), jnp.asarray(c)[:, None])
    assert got.shape == (b, t, hkv, nb) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got1 = block_scores.centroid_scores(jnp.asarray(q[:, 0]), jnp.asarray(c))      # decode shape
    np.testing.assert_allclose(np.asarray(got1), want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_select_blocks_end_to_end(scorer):
    rng = np.random.default_rng(8)
    b, hq, hkv, s, d = 2, 4, 2, 256, 8
    keys = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    cents = block_scores.block_centroids(keys)
    kmin, kmax = block_scores.block_minmax(keys)
    lengths, budgets = jnp.array([256, 200]), jnp.array([6, 5])
    f = jax.jit(lambda *a: sel.select_blocks(*a, max_selected=6, scorer=scorer,
                                             key_min=kmin, key_max=kmax))
    idx, n = f(q, cents, lengths, budgets)
    assert idx.shape == (b, hkv, 6) and n.shape == (b, hkv)
    qm = np.asarray(q).reshape(b, hkv, 2, d).mean(axis=2)
    if scorer == "centroid":
        scores = np.einsum("bhd,bhnd->bhn", qm, np.asarray(cents))
    else:
        scores = np.maximum(qm[:, :, None] * np.asarray(kmin),
                            qm[:, :, None] * np.asarray(kmax)).sum(-1)
    check_rows(scores, np.repeat(np.asarray(lengths)[:, None], hkv, 1),
               np.repeat(np.asarray(budgets)[:, None], hkv, 1), idx, n, 6)
    with pytest.raises(ValueError, match="unknown scorer"):
        sel.select_blocks(q, cents, lengths, budgets, max_selected=6, scorer="oracle")


# -- sort-free selection == the former top_k + sort (issue 30) --------------------------------
def _old_selected_keys(scores, positions, budget_blocks, *, max_selected):
    """selected_keys as it was: the reference's ids scattered into a mask."""
    b, c, hkv, nb = scores.shape
    lengths = jnp.broadcast_to((positions + 1)[..., None], (b, c, hkv))
    budget = jnp.broadcast_to(budget_blocks[..., None], (b, c, hkv)).astype(jnp.int32)
    idx, _ = sel.select_from_scores_reference(scores, lengths, budget,
                                              max_selected=max_selected)
    chosen = jnp.put_along_axis(jnp.zeros((b, c, hkv, nb), bool), idx, True, axis=-1,
                                inplace=False)
    return jnp.repeat(chosen, BS, axis=-1)


def _same_as_reference(scores, lengths, budgets, max_sel):
    new = jax.jit(lambda s, l, b: sel.select_from_scores(s, l, b, max_selected=max_sel))
    old = jax.jit(lambda s, l, b: sel.select_from_scores_reference(s, l, b,
                                                                   max_selected=max_sel))
    (i_new, n_new), (i_old, n_old) = new(scores, lengths, budgets), old(scores, lengths, budgets)
    np.testing.assert_array_equal(np.asarray(i_new), np.asarray(i_old))
    np.testing.assert_array_equal(np.asarray(n_new), np.asarray(n_old))
    return i_new, n_new


@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "signed_zeros", "specials"])
def test_sort_free_matches_reference(kind):
    rng = np.random.default_rng(11)
    rows, nb, max_sel = 96, 70, 24
    if kind == "normal":
        scores = rng.standard_normal((rows, nb))
    elif kind == "ties":
        scores = rng.integers(-2, 3, (rows, nb))
    elif kind == "all_equal":
        scores = np.full((rows, nb), 0.5)
    elif kind == "signed_zeros":      # -0 ranks below +0 (IEEE total order, as lax.top_k)
        scores = rng.choice([0.0, -0.0, 1e-30, -1e-30], (rows, nb))
    else:                             # +inf and +NaN rank above every finite score
        scores = rng.choice([np.inf, np.nan, 1.0, -1.0, 3e38, -3e38], (rows, nb))
    scores = scores.astype(np.float32)
    # Every regime: empty rows, 1-3 blocks, budgets >= length (dense), = length, length - 1
    # (one candidate left out), budgets of 3 (reserved blocks only) and above max_selected.
    lengths = rng.integers(0, nb * BS + 1, rows)
    lengths[:8] = [0, 1, 16, 17, 33, 48, 49, nb * BS]
    budgets = rng.integers(3, max_sel + 6, rows)
    budgets[8:16] = 3
    budgets[16:24] = -(-lengths[16:24] // BS)           # exactly the row's blocks: dense
    budgets[24:32] = np.maximum(-(-lengths[24:32] // BS) - 1, 3)
    idx, n = _same_as_reference(scores, lengths.astype(np.int32), budgets.astype(np.int32),
                                max_sel)
    if kind not in ("specials", "signed_zeros"):   # brute force: Python float order (-0 == 0)
        check_rows(scores, lengths, budgets, idx, n, max_sel)


def test_sort_free_wide_rows_and_leading_dims():
    """Rows much longer than the budget (the rollout's regime) and [B, T, Hkv, NB] scores."""
    rng = np.random.default_rng(12)
    b, t, hkv, nb, max_sel = 2, 3, 4, 300, 40
    scores = rng.standard_normal((b, t, hkv, nb)).astype(np.float32)
    scores[0, 0, 0, 5:200] = 1.25                         # a long run of ties at the k-th score
    lengths = np.broadcast_to(rng.integers(nb * BS // 2, nb * BS + 1, (b, t, 1)), (b, t, hkv))
    budgets = rng.integers(3, max_sel + 1, (b, t, hkv))
    _same_as_reference(scores, lengths.astype(np.int32), budgets.astype(np.int32), max_sel)


def test_selected_keys_matches_reference_mask():
    rng = np.random.default_rng(13)
    b, c, hkv, nb, max_sel = 2, 9, 2, 32, 8
    scores = jnp.asarray(rng.integers(0, 3, (b, c, hkv, nb)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, nb * BS, (b, c)), jnp.int32)
    budgets = jnp.asarray(rng.integers(3, max_sel + 3, (b, c)), jnp.int32)
    new = jax.jit(lambda *a: sel.selected_keys(*a, max_selected=max_sel))(scores, positions,
                                                                          budgets)
    old = jax.jit(lambda *a: _old_selected_keys(*a, max_selected=max_sel))(scores, positions,
                                                                           budgets)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


@pytest.mark.parametrize("radix_bits", [1, 2, 4, 8])
def test_kth_largest_key_any_radix(radix_bits):
    rng = np.random.default_rng(14)
    rows, nb = 40, 50
    x = rng.integers(-3, 4, (rows, nb)).astype(np.float32) * rng.choice([1.0, 1e-3], (rows, 1))
    valid = rng.random((rows, nb)) < 0.7
    k = np.array([rng.integers(0, v.sum() + 1) for v in valid], np.int32)
    key = sel.order_key(jnp.asarray(x))
    got = jax.jit(functools.partial(sel.kth_largest_key, radix_bits=radix_bits))(
        key, jnp.asarray(valid), jnp.asarray(k))
    keys = np.asarray(key)
    for r in range(rows):
        vals = np.sort(keys[r][valid[r]])[::-1]
        want = vals[k[r] - 1] if k[r] >= 1 else np.uint32(0xFFFFFFFF)
        assert int(got[r]) == int(want), (r, k[r])


def test_selection_lowers_to_no_sort_or_topk():
    """XLA:CPU here; tests/test_decode_hlo.py checks the whole decode program for H100 / v5p."""
    args = (jnp.zeros((4, 8, 2048)), jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 8), jnp.int32))
    new = jax.jit(lambda s, l, b: sel.select_from_scores(s, l, b, max_selected=512))
    old = jax.jit(lambda s, l, b: sel.select_from_scores_reference(s, l, b, max_selected=512))
    assert large_sorts(sort_and_topk_ops(new.lower(*args).compile().as_text())) == []
    # The census sees what the former selection lowered to (metadata naming "sort" is ignored).
    assert large_sorts(sort_and_topk_ops(old.lower(*args).compile().as_text()))


@pytest.mark.parametrize("nb,max_sel,tied", [(40, 12, True), (37, 11, False)])
def test_triton_selection_kernel_matches_brute_force_and_the_xla_form(nb, max_sel, tied):
    """pallas_kernels.pallas_triton_select (one kernel, interpret mode here) against the brute-force
    rule and the XLA sort-free form: ties, dense rows, empty rows, budgets above the width,
    non-power-of-two block counts and widths, leading [B, Hkv] axes."""
    rng = np.random.default_rng(nb + max_sel)
    b, hkv = 3, 4
    scores = (rng.integers(0, 3, (b, hkv, nb)) if tied else rng.standard_normal((b, hkv, nb)))
    scores = scores.astype(np.float32)
    scores[0, 0, 5] = -np.inf                                   # an IEEE edge among candidates
    lengths = rng.integers(0, nb * BS + 1, (b, hkv)).astype(np.int32)
    lengths[0, 1], lengths[1, 0] = 0, nb * BS                   # empty row, full row
    budgets = rng.integers(3, max_sel + 4, (b, hkv)).astype(np.int32)
    args = (jnp.asarray(scores), jnp.asarray(lengths), jnp.asarray(budgets))
    xla_idx, xla_n = sel.select_from_scores(*args, max_selected=max_sel)
    for bits in (1, 4) if tied else (2,):          # digits per pass of the k-th key's search
        idx, n = sel.select_from_scores(*args, max_selected=max_sel, backend="pallas_triton",
                                        interpret=True, radix_bits=bits)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(xla_idx), err_msg=f"r={bits}")
        np.testing.assert_array_equal(np.asarray(n), np.asarray(xla_n))
    finite = np.isfinite(scores).reshape(-1, nb).all(axis=1)    # brute force ranks finite rows
    check_rows(scores.reshape(-1, nb)[finite], lengths.ravel()[finite], budgets.ravel()[finite],
               np.asarray(idx).reshape(-1, max_sel)[finite], np.asarray(n).ravel()[finite],
               max_sel)


def test_selection_backend_follows_the_attention_backend():
    """Selection runs where the attention kernel runs: XLA on CPU ('auto' -> 'xla'), the
    Triton kernel only where Pallas Triton can run (here: interpret mode), and a backend that
    cannot run here fails as the attention would, instead of silently taking another path."""
    from pallas_kernels.dispatch import BackendUnavailableError
    assert sel.selection_backend("auto") == "xla"
    assert sel.selection_backend("xla") == "xla"
    assert sel.selection_backend("pallas_triton", interpret=True) == "pallas_triton"
    with pytest.raises(BackendUnavailableError, match="pallas_triton"):
        sel.selection_backend("pallas_triton")


# (pools, GQA group, table width P, selection width K): one shared centroid pool and two of
# two rows each; P past a power of two (its scores padded), K no power of two (masked stores).
PAGES_CASES = [(1, 2, 12, 6), (2, 4, 9, 5)]


@pytest.mark.parametrize("pools,g,p,width", PAGES_CASES)
def test_triton_select_pages_matches_the_xla_form(pools, g, p, width):
    """The fused kernel (pallas_triton_select.select_pages_triton: each row's centroids read
    through its page table, scored, selected, looked up) against `select_pages`' XLA form (the
    centroids gathered, `select_blocks`, `physical_pages`): small-integer queries and centroids
    make every score exact in any summation order, so the ids must match exactly - ties,
    dense rows, an empty row, budgets under 3 and above the width included."""
    from pallas_kernels import pallas_triton_select
    rng = np.random.default_rng(pools * 10 + g)
    b, hkv, d, n = 4, 2, 16, 3 * p
    q = jnp.asarray(rng.integers(-3, 4, (b, hkv * g, d)), jnp.float32)
    cp = jnp.asarray(rng.integers(-3, 4, (pools, hkv, n, d)), jnp.bfloat16)
    table = jnp.asarray(np.stack([rng.permutation(n)[:p] for _ in range(b)]), jnp.int32)
    lengths = jnp.asarray([0, p * BS, 5 * BS + 3, 2 * BS], jnp.int32)
    budget = jnp.asarray([3, 4, 1, width + 5], jnp.int32)
    # Under jit a budget under 3 is clamped to 3 (eagerly the XLA form rejects it).
    want = jax.jit(lambda *a: sel.select_pages(*a, max_selected=width, block_size=BS))(
        q, cp, table, lengths, budget)
    got, scores = jax.jit(lambda *a: pallas_triton_select.select_pages_triton(
        *a, width=width, block_size=BS, interpret=True))(q, cp, table, lengths, budget)
    for a, c in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    via_api = jax.jit(lambda *a: sel.select_pages(
        *a, max_selected=width, block_size=BS, backend="pallas_triton", interpret=True))(
        q, cp, table, lengths, budget)
    for a, c in zip(via_api, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # The scores it ranked are the XLA scores (below each row's block count).
    pool = np.arange(b) // (b // pools)
    cents = np.asarray(cp, np.float32)[pool[:, None], :, np.asarray(table)].swapaxes(1, 2)
    ref = np.asarray(block_scores.centroid_scores(q, jnp.asarray(cents)))
    for r in range(b):
        blocks = -(-int(lengths[r]) // BS)
        np.testing.assert_array_equal(np.asarray(scores)[r, :, :blocks], ref[r, :, :blocks])


def test_triton_select_pages_finishes_raw_queries():
    """With a HeadFinish the kernel scores the model's finished queries (RMSNorm, RoPE) of
    raw heads, read as the first Hq heads of one array of q, k and v heads: its scores are
    the XLA scores of the finished queries (to bf16 rounding: under jit XLA may keep the bf16
    RoPE's products in f32), and its ids those the selection rule gives for its own scores."""
    from pallas_kernels import pallas_triton_select
    from pallas_kernels.reference import HeadFinish
    from sparrow_jax.model.qwen3 import RMSNorm, apply_rope, rope_cos_sin
    from flax import nnx
    rng = np.random.default_rng(7)
    b, hq, hkv, d, p, n, width = 2, 4, 2, 32, 10, 24, 5
    heads = jnp.asarray(rng.standard_normal((b, hq + 2 * hkv, d)), jnp.bfloat16)
    cp = jnp.asarray(rng.standard_normal((1, hkv, n, d)), jnp.bfloat16)
    table = jnp.asarray(np.stack([rng.permutation(n)[:p] for _ in range(b)]), jnp.int32)
    lengths = jnp.asarray([p * BS, 7 * BS + 1], jnp.int32)
    budget = jnp.asarray([4, 5], jnp.int32)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.bfloat16)
    cos, sin = rope_cos_sin((lengths - 1)[:, None], d, 10000.0)
    got, scores = jax.jit(lambda *a: pallas_triton_select.select_pages_triton(
        *a, width=width, block_size=BS, q_finish=HeadFinish(weight, cos[:, 0], sin[:, 0], 1e-6),
        q_heads=hq, interpret=True))(heads, cp, table, lengths, budget)
    norm = RMSNorm(d, 1e-6, "head_dim")
    norm.weight = nnx.Param(weight)
    q = apply_rope(norm(heads[:, None, :hq]), cos, sin)[:, 0]
    cents = jnp.asarray(cp)[0][:, table].swapaxes(0, 1)                   # [B, Hkv, P, D]
    ref = np.asarray(block_scores.centroid_scores(q, cents))
    np.testing.assert_allclose(np.asarray(scores)[:, :, :p], ref, rtol=2e-2, atol=5e-2)
    idx, num = sel.select_from_scores(scores[:, :, :p], jnp.broadcast_to(lengths[:, None],
                                                                       (b, hkv)),
                                      jnp.broadcast_to(budget[:, None], (b, hkv)),
                                      max_selected=width, block_size=BS)
    np.testing.assert_array_equal(np.asarray(got.block_indices), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(got.num_blocks), np.asarray(num))
