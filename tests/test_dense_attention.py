"""rollout/dense_attention.py: the one-pass dense decode equals the shared dense kernel (and a
plain softmax), empty rows included; the per-block attention mass (what verify-guided drafts
rank) equals the softmax's block sums by every path - one pass, from the kernel's lse over a
contiguous cache, and over a page pool; the engine's dense greedy tokens are unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from sparrow_jax.rollout import dense_attention as da

B, HQ, HKV, D, S, BS = 3, 8, 2, 16, 96, 16


def _inputs():
    r = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(r[0], (B, HQ, D))
    k = 2.0 * jax.random.normal(r[1], (B, HKV, S, D))
    v = jax.random.normal(r[2], (B, HKV, S, D))
    return q, k, v, jnp.asarray([0, 37, 96], jnp.int32)      # an empty row, a partial block


def _softmax(q, k, lengths):
    """[B, Hq, S] attention probabilities (0 past the length; empty rows all 0)."""
    s = jnp.einsum("bhgd,bhtd->bhgt", q.reshape(B, HKV, HQ // HKV, D), k) * D ** -0.5
    visible = jnp.arange(S)[None, None, None] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.where(lengths[:, None, None, None] > 0, p, 0.0).reshape(B, HQ, S)


def test_one_pass_equals_the_dense_kernel_and_softmax():
    q, k, v, lengths = _inputs()
    out, lse = da.one_pass(q, k, v, lengths)
    ref_out, ref_lse = pallas_kernels.dense_decode(q, k, v, lengths, backend="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse[1:]), np.asarray(ref_lse[1:]), rtol=1e-6)
    assert np.isneginf(np.asarray(lse[0])).all() and not np.asarray(out[0]).any()
    p = _softmax(q, k, lengths)
    want = jnp.einsum("bhgt,bhtd->bhgd", p.reshape(B, HKV, -1, S), v).reshape(B, HQ, D)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6)
    # The engines' entry: one pass on XLA while it fits, the kernel past ONE_PASS_BYTES.
    assert da.fits_one_pass("xla", B, HQ, S) and not da.fits_one_pass("xla", 1 << 20, HQ, S)
    np.testing.assert_array_equal(np.asarray(da.decode(q, k, v, lengths, backend="xla")[0]),
                                  np.asarray(out))


def test_block_mass_by_every_path_equals_the_softmax_block_sums(monkeypatch):
    q, k, v, lengths = _inputs()
    want = _softmax(q, k, lengths).reshape(B, HKV, HQ // HKV, S // BS, BS).sum(axis=(2, 4))
    _, lse, mass = da.one_pass(q, k, v, lengths, mass_block=BS)
    np.testing.assert_allclose(np.asarray(mass), np.asarray(want), atol=1e-5)
    # Each KV head's queries' probabilities sum to 1: the head's mass is its group size.
    np.testing.assert_allclose(np.asarray(mass[1:].sum(-1)), HQ // HKV, rtol=1e-5)
    from_lse = da.block_mass_from_lse(q, k, lse, lengths, block_size=BS, chunk_blocks=2)
    np.testing.assert_allclose(np.asarray(from_lse), np.asarray(want), atol=1e-5)
    # The same cache as one page pool, pages shuffled, read through page tables.
    nb = S // BS
    perm = np.random.default_rng(0).permutation(B * nb).reshape(B, nb)
    pool = jnp.zeros((HKV, B * nb, BS, D)).at[:, perm].set(
        k.reshape(B, HKV, nb, BS, D).transpose(1, 0, 2, 3, 4))[None]
    paged = da.paged_block_mass_from_lse(q, pool, jnp.asarray(perm, jnp.int32), lse, lengths,
                                         chunk_blocks=4)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(want), atol=1e-5)
    out_p, lse_p = da.paged_decode(q, pool, pool, jnp.asarray(perm, jnp.int32), lengths,
                                   backend="xla")
    np.testing.assert_allclose(np.asarray(lse_p[1:]), np.asarray(lse[1:]), rtol=1e-5)


@pytest.mark.slow
def test_dense_greedy_tokens_unchanged_by_the_one_pass(monkeypatch, tmp_path):
    """The dense engine's greedy tokens with the one-pass attention equal those through the
    chunked kernel (ONE_PASS_BYTES 0), logprobs to f32 rounding."""
    from hf_fixtures import make_sharp_tiny_model, random_prompts
    from sparrow_jax.rollout import RolloutConfig, generate
    model = make_sharp_tiny_model(tmp_path)
    toks, lens = random_prompts([40, 70, 9, 23], seed=2)
    cfg = RolloutConfig(mode="dense", max_new_tokens=32, temperature=0.0, backend="xla")
    budgets = np.full(8, 48, np.int32)
    one = generate(model, toks, lens, cfg=cfg, budgets=budgets)
    monkeypatch.setattr(da, "ONE_PASS_BYTES", 0)
    jax.clear_caches()
    kernel = generate(model, toks, lens, cfg=cfg, budgets=budgets)
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(kernel.tokens))
    np.testing.assert_allclose(np.asarray(one.logprobs), np.asarray(kernel.logprobs), atol=1e-5)
