"""Block selection (SPEC.md section 1) vs NumPy brute force."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
        c = jax.jit(sel.block_centroids)(kj)
        assert c.shape == (2, 3, 4, 8) and c.dtype == dtype
        want = np.asarray(kj, np.float64).reshape(2, 3, 4, 16, 8).mean(axis=3)
        np.testing.assert_allclose(np.asarray(c, np.float64), want,
                                   atol=1e-6 if dtype == jnp.float32 else 1e-2)
    kmin, kmax = sel.block_minmax(jnp.asarray(keys))
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
    upd = jax.jit(sel.update_centroid)
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
    got = jax.jit(sel.centroid_scores)(jnp.asarray(q), jnp.asarray(c)[:, None])
    assert got.shape == (b, t, hkv, nb) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got1 = sel.centroid_scores(jnp.asarray(q[:, 0]), jnp.asarray(c))      # decode shape
    np.testing.assert_allclose(np.asarray(got1), want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_select_blocks_end_to_end(scorer):
    rng = np.random.default_rng(8)
    b, hq, hkv, s, d = 2, 4, 2, 256, 8
    keys = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    cents = sel.block_centroids(keys)
    kmin, kmax = sel.block_minmax(keys)
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
