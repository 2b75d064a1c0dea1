"""sparrow_jax.sparsity.mismatch against NumPy float64 references."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from sparrow_jax.sparsity import mismatch


def np_softmax(x, t=1.0):
    z = x.astype(np.float64) / t
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def np_alpha(a, b, t=1.0):
    return np.minimum(np_softmax(a, t), np_softmax(b, t)).sum(-1)


def np_tail(alpha, positions, mask, bin_size, q, num_bins):
    bins = np.minimum(np.maximum(positions // bin_size, 0), num_bins - 1)
    tail, counts = np.full(num_bins, np.nan), np.zeros(num_bins, np.int64)
    for j in range(num_bins):
        sel = alpha[(bins == j) & mask]
        counts[j] = sel.size
        if sel.size:
            tail[j] = np.quantile(sel.astype(np.float64), q, method="linear")
    return tail, counts


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_alpha_matches_numpy(rng):
    a = rng.normal(size=(4, 9, 64)) * 3
    b = a + rng.normal(size=a.shape)
    for t in (1.0, 0.6, 1.7):
        got = np.asarray(mismatch.acceptance_rate(jnp.asarray(a), jnp.asarray(b), temperature=t))
        assert got.shape == (4, 9)
        np.testing.assert_allclose(got, np_alpha(a, b, t), atol=2e-6)


def test_alpha_identical_disjoint_symmetric(rng):
    a = rng.normal(size=(3, 50)).astype(np.float32)
    np.testing.assert_allclose(mismatch.acceptance_rate(a, a), 1.0, atol=1e-6)
    # Disjoint support: -inf logits outside each half of the vocabulary.
    s = np.where(np.arange(50) < 25, a, -np.inf).astype(np.float32)
    d = np.where(np.arange(50) >= 25, a, -np.inf).astype(np.float32)
    np.testing.assert_allclose(mismatch.acceptance_rate(s, d), 0.0, atol=1e-7)
    b = rng.normal(size=(3, 50)).astype(np.float32)
    np.testing.assert_allclose(
        mismatch.acceptance_rate(a, b), mismatch.acceptance_rate(b, a), atol=1e-7
    )


def test_alpha_bf16_and_logprob_form(rng):
    a = rng.normal(size=(2, 5, 40)).astype(np.float32)
    b = (a + 0.2 * rng.normal(size=a.shape)).astype(np.float32)
    ref = np.asarray(mismatch.acceptance_rate(a, b))
    lp = mismatch.acceptance_rate_from_logprobs(
        jax.nn.log_softmax(a, -1), jax.nn.log_softmax(b, -1)
    )
    np.testing.assert_allclose(lp, ref, atol=1e-6)
    bf = mismatch.acceptance_rate(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16))
    assert bf.dtype == jnp.float32
    np.testing.assert_allclose(bf, ref, atol=3e-2)


@pytest.mark.parametrize("chunk", [1, 4, 7, 13, 64])
def test_chunked_equals_unchunked(rng, chunk):
    a = rng.normal(size=(2, 13, 33)).astype(np.float32)
    b = (a + rng.normal(size=a.shape)).astype(np.float32)
    full = mismatch.acceptance_rate(a, b, temperature=0.8)
    got = mismatch.acceptance_rate(a, b, temperature=0.8, chunk_size=chunk)
    np.testing.assert_allclose(got, full, atol=1e-6)


def test_chunked_under_outer_jit(rng):
    a = rng.normal(size=(13, 33)).astype(np.float32)
    b = (a + rng.normal(size=a.shape)).astype(np.float32)
    f = jax.jit(lambda x, y: mismatch.acceptance_rate(x, y, chunk_size=5))
    np.testing.assert_allclose(f(a, b), np_alpha(a, b), atol=2e-6)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch.acceptance_rate(jnp.zeros((2, 3)), jnp.zeros((2, 4)))


def test_topk_is_lower_bound(rng):
    a = rng.normal(size=(6, 20, 80)) * 2
    b = a + rng.normal(size=a.shape)
    full = np.asarray(mismatch.acceptance_rate(a, b))
    for k in (1, 5, 20, 80):
        lps, ids = mismatch.topk_logprobs(jnp.asarray(a), k)
        lpd, idd = mismatch.topk_logprobs(jnp.asarray(b), k)
        est = np.asarray(mismatch.acceptance_rate_topk(lps, ids, lpd, idd))
        assert est.shape == full.shape
        assert (est <= full + 1e-6).all()
        if k == 80:  # top-k over the whole vocabulary is exact
            np.testing.assert_allclose(est, full, atol=1e-5)
    # Reference on one row: sum over the intersection of min(p_s, p_d).
    ps, pd = np_softmax(a[0, 0]), np_softmax(b[0, 0])
    top_s, top_d = set(np.argsort(-ps)[:5]), set(np.argsort(-pd)[:5])
    ref = sum(min(ps[v], pd[v]) for v in top_s & top_d)
    lps, ids = mismatch.topk_logprobs(jnp.asarray(a[0, 0]), 5)
    lpd, idd = mismatch.topk_logprobs(jnp.asarray(b[0, 0]), 5)
    np.testing.assert_allclose(mismatch.acceptance_rate_topk(lps, ids, lpd, idd), ref, atol=1e-6)


def test_topk_padding_ids_never_match():
    lp = jnp.log(jnp.array([[0.5, 0.3, 0.0]]))
    ids = jnp.array([[3, 7, -1]])
    assert float(mismatch.acceptance_rate_topk(lp, ids, lp, ids)[0]) == pytest.approx(0.8, abs=1e-6)


@pytest.mark.parametrize("q", [0.05, 0.0, 0.5, 1.0])
def test_tail_by_bin_matches_numpy_quantile(rng, q):
    n = 3000
    alpha = rng.beta(8, 1, size=n).astype(np.float32)
    # Leave bins 3 and 4 empty, put many tokens past the last bin edge (open-ended bin).
    pos = rng.integers(0, 60000, size=n)
    pos = np.where((pos >= 6000) & (pos < 10000), pos + 4000, pos)
    mask = rng.uniform(size=n) < 0.7
    tail, counts = mismatch.tail_by_bin(
        jnp.asarray(alpha), jnp.asarray(pos), jnp.asarray(mask), quantile=q
    )
    ref_tail, ref_counts = np_tail(alpha, pos, mask, 2000, q, 20)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)
    assert ref_counts[3] == ref_counts[4] == 0 and ref_counts[19] > 500
    np.testing.assert_allclose(np.asarray(tail), ref_tail, rtol=0, atol=1e-6)
    assert np.isnan(np.asarray(tail)[[3, 4]]).all()


def test_tail_by_bin_shapes_small_bins_and_no_mask(rng):
    alpha = rng.uniform(size=(4, 25)).astype(np.float32)
    pos = np.broadcast_to(100 + np.arange(25) * 7, (4, 25))
    tail, counts = mismatch.tail_by_bin(alpha, pos, None, bin_size=40, num_bins=5)
    ref_tail, ref_counts = np_tail(alpha.ravel(), pos.ravel(), np.ones(100, bool), 40, 0.05, 5)
    np.testing.assert_array_equal(counts, ref_counts)
    np.testing.assert_allclose(tail, ref_tail, atol=1e-6)
    # Bins with exactly one token: the quantile is that token.
    one = mismatch.tail_by_bin(jnp.array([0.3, 0.9]), jnp.array([5, 4500]), None)[0]
    assert float(one[0]) == pytest.approx(0.3) and float(one[2]) == pytest.approx(0.9)
    assert np.isnan(np.asarray(one)[1])


def test_tail_all_masked():
    tail, counts = mismatch.tail_by_bin(jnp.ones(8), jnp.arange(8), jnp.zeros(8, bool))
    assert np.isnan(np.asarray(tail)).all() and int(counts.sum()) == 0


def test_mismatch_summary(rng):
    n = 2000
    alpha = rng.beta(10, 1, size=(4, n // 4)).astype(np.float32)
    pos = rng.integers(0, 45000, size=alpha.shape)
    mask = rng.uniform(size=alpha.shape) < 0.8
    lp_s = np.log(rng.uniform(0.01, 1, size=alpha.shape)).astype(np.float32)
    lp_d = (lp_s + 0.1 * rng.normal(size=alpha.shape)).astype(np.float32)
    s = mismatch.mismatch_summary(alpha, pos, mask, logp_sparse=lp_s, logp_dense=lp_d)
    sel = alpha[mask].astype(np.float64)
    r = (lp_d - lp_s)[mask].astype(np.float64)
    assert float(s["num_tokens"]) == sel.size
    np.testing.assert_allclose(s["alpha_mean"], sel.mean(), rtol=1e-5)
    np.testing.assert_allclose(s["alpha_p1"], np.quantile(sel, 0.01), atol=1e-6)
    np.testing.assert_allclose(s["alpha_p5"], np.quantile(sel, 0.05), atol=1e-6)
    np.testing.assert_allclose(s["alpha_min"], sel.min(), atol=1e-7)
    for t in (0.5, 0.8, 0.9, 0.99):
        np.testing.assert_allclose(s[f"frac_below_{t:g}"], (sel < t).mean(), atol=1e-6)
    np.testing.assert_allclose(s["log_ratio_mean"], r.mean(), atol=1e-5)
    np.testing.assert_allclose(s["log_ratio_abs_mean"], np.abs(r).mean(), atol=1e-5)
    np.testing.assert_allclose(s["log_ratio_max"], r.max(), atol=1e-6)
    ref_tail, ref_counts = np_tail(alpha.ravel(), pos.ravel(), mask.ravel(), 2000, 0.05, 20)
    np.testing.assert_allclose(s["tail"], ref_tail, atol=1e-6)
    np.testing.assert_array_equal(s["counts"], ref_counts)
    np.testing.assert_allclose(s["tail_min"], np.nanmin(ref_tail), atol=1e-6)
    # Jittable as a whole, and logprobs are optional.
    s2 = jax.jit(lambda a, p, m: mismatch.mismatch_summary(a, p, m, thresholds=(0.9,)))(
        alpha, pos, mask)
    assert "log_ratio_mean" not in s2 and "frac_below_0.9" in s2


def test_noise_floor_identical_and_perturbed(rng):
    logits = rng.normal(size=(2, 30, 40)).astype(np.float32)
    pos = np.broadcast_to(np.arange(30) * 150, (2, 30))
    mask = np.ones((2, 30), bool)
    tokens = rng.integers(0, 40, size=(2, 30))
    same = mismatch.noise_floor(logits, logits, pos, mask, tokens=tokens, chunk_size=8)
    np.testing.assert_allclose(same["alpha_p5"], 1.0, atol=1e-6)
    np.testing.assert_allclose(same["log_ratio_abs_mean"], 0.0, atol=1e-7)
    # A bf16 round trip of the logits: what alpha reads from dtype noise alone.
    noisy = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    floor = mismatch.noise_floor(logits, noisy, pos, mask, num_bins=3)
    assert 0.97 < float(floor["alpha_p5"]) < 1.0
    np.testing.assert_allclose(floor["alpha_mean"], np_alpha(logits, noisy).mean(), atol=1e-5)
    merged = mismatch.merge_with_noise_floor({"alpha_p5": 0.9}, floor)
    assert merged["alpha_p5"] == 0.9 and "noise_floor/alpha_p5" in merged
