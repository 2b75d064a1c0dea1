"""Token sampling (sparrow_jax.rollout.sampling): the distribution sampled from, the recorded
log-probabilities, and the Gumbel-max implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rollout.sampling import first_argmax, sample, sampling_logprobs, topk_logprobs


def _logits(seed: int, b: int = 8, v: int = 300) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (b, v)) * 3.0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0),
                                                     (1.3, 0, 0.9), (0.9, 50, 0.8)])
def test_sample_is_gumbel_max_of_the_truncated_distribution(temperature, top_k, top_p):
    """Same key -> exactly the token jax.random.categorical draws from the recorded log-probs,
    and the recorded log-prob is that of the drawn token."""
    logits = _logits(0)
    for seed in range(5):
        key = jax.random.key(seed)
        tokens, lp = sample(key, logits, temperature=temperature, top_k=top_k, top_p=top_p)
        logp = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        want = jax.random.categorical(key, logp, axis=-1)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
        assert tokens.dtype == jnp.int32
        np.testing.assert_allclose(np.asarray(lp),
                                   np.asarray(logp)[np.arange(len(tokens)), np.asarray(tokens)])
        assert np.isfinite(np.asarray(lp)).all()       # never a truncated token


def test_truncation_rules():
    logits = _logits(1)
    logp = np.asarray(sampling_logprobs(logits, temperature=1.0, top_k=10))
    assert ((logp > -np.inf).sum(-1) == 10).all()
    kth = np.sort(np.asarray(logits), -1)[:, -10]
    assert (np.asarray(logits)[logp > -np.inf] >= np.repeat(kth, 10)).all()
    np.testing.assert_allclose(np.exp(logp).sum(-1), 1.0, rtol=1e-5)

    probs = np.asarray(jax.nn.softmax(logits, -1))
    logp = np.asarray(sampling_logprobs(logits, temperature=1.0, top_p=0.8))
    for row_p, row_lp in zip(probs, logp):
        kept = row_lp > -np.inf
        # The smallest set of most likely tokens with mass >= top_p: dropping its least likely
        # member falls below top_p.
        assert row_p[kept].sum() >= 0.8 - 1e-6
        assert row_p[kept].sum() - row_p[kept].min() < 0.8
        assert row_p[kept].min() >= row_p[~kept].max(initial=0.0)


def test_empirical_frequencies_match_probabilities():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    draws = 20000
    keys = jax.random.split(jax.random.key(3), draws)
    tokens = jax.vmap(lambda k: sample(k, logits, temperature=1.0)[0][0])(keys)
    freq = np.bincount(np.asarray(tokens), minlength=4) / draws
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_greedy_and_first_argmax():
    logits = _logits(2)
    tokens, lp = sample(jax.random.key(0), logits, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jnp.argmax(logits, -1)))
    # Greedy records the untruncated temperature-1 log-prob.
    np.testing.assert_allclose(
        np.asarray(lp), np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(8),
                                                                      np.asarray(tokens)],
        rtol=1e-6)
    x = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [-jnp.inf, -jnp.inf, 2.0, -jnp.inf],
                     [jnp.nan, jnp.nan, jnp.nan, jnp.nan]])
    np.testing.assert_array_equal(np.asarray(first_argmax(x)), [1, 2, 3])   # ties: first


def test_topk_logprobs_are_untruncated():
    logits = _logits(4)
    values, ids = topk_logprobs(logits, 5, temperature=0.5)
    full = np.asarray(jax.nn.log_softmax(logits / 0.5, -1))
    order = np.argsort(-full, -1)[:, :5]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_allclose(np.asarray(values), np.take_along_axis(full, order, -1),
                               rtol=1e-5)
