"""GRPO loss and advantages against a straightforward per-token NumPy reference."""

from __future__ import annotations

import functools
import itertools
import math
import re

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl import grpo

B, T = 6, 9


def reference_loss(
    logp,
    logp_old,
    logp_rollout,
    adv,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=3.0,
    tis_cap=2.0,
    aggregation="token-mean",
    logp_ref=None,
    kl_coef=0.0,
    token_rejection=None,
    sequence_veto=None,
    tis_renormalize=False,
):
    """Token-by-token loops; returns (loss, metrics dict)."""
    b, t = logp.shape
    valid = mask > 0
    rr = np.where(valid, np.exp(logp_old - logp_rollout), 1.0)
    rejected = np.zeros((b, t), bool)
    vetoed = np.zeros(b, bool)
    for i in range(b):
        for j in range(t):
            if (
                valid[i, j]
                and token_rejection
                and not token_rejection[0] <= rr[i, j] <= token_rejection[1]
            ):
                rejected[i, j] = True
            if valid[i, j] and sequence_veto and rr[i, j] < sequence_veto:
                vetoed[i] = True
    eff = valid & ~rejected & ~vetoed[:, None]
    w = np.minimum(rr, tis_cap) if tis_cap is not None else np.ones((b, t))
    w_raw = w.copy()
    if tis_renormalize:
        w = w / w[eff].mean()
    per_tok = np.zeros((b, t))
    hi = lo = dual = 0
    ratios = []
    for i in range(b):
        a = adv[i]
        for j in range(t):
            if not eff[i, j]:
                continue
            r = math.exp(logp[i, j] - logp_old[i, j])
            ratios.append(r)
            surrogate = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            hi += a > 0 and r > 1 + clip_high
            lo += a < 0 and r < 1 - clip_low
            if dual_clip is not None and a < 0:
                dual += surrogate > -a * dual_clip
                surrogate = min(surrogate, -a * dual_clip)
            per_tok[i, j] = w[i, j] * surrogate
            if logp_ref is not None:
                kl = logp_ref[i, j] - logp[i, j]
                per_tok[i, j] += kl_coef * (math.exp(kl) - kl - 1)
    n = eff.sum()
    if aggregation == "token-mean":
        loss = per_tok[eff].sum() / n
    else:
        seqs = [per_tok[i][eff[i]] for i in range(b) if eff[i].any()]
        red = np.mean if aggregation == "seq-mean-token-mean" else np.sum
        loss = np.mean([red(s) for s in seqs])
    ratios = np.array(ratios)
    log_r = np.log(ratios)
    metrics = {
        "clipfrac_high": hi / n,
        "clipfrac_low": lo / n,
        "dual_clipfrac": dual / n,
        "ratio_mean": ratios.mean(),
        "ratio_max": ratios.max(),
        "ratio_min": ratios.min(),
        "approx_kl": np.mean(ratios - 1 - log_r),
        "tis_weight_mean": w_raw[eff].mean(),
        "tis_capped_frac": (rr[eff] > tis_cap).mean() if tis_cap is not None else 0.0,
        "token_rejected_frac": rejected.sum() / valid.sum(),
        "seq_vetoed_frac": vetoed.sum() / valid.any(1).sum(),
    }
    return loss, metrics


def random_inputs(seed, *, spread=0.4):
    rng = np.random.default_rng(seed)
    logp_old = -rng.uniform(0.1, 3.0, (B, T))
    # Wide ratio spread so every branch (both clips, dual-clip, TIS cap) is hit.
    logp = (
        logp_old
        + rng.normal(0, spread, (B, T))
        + rng.choice([0, 1.5, -1.5], (B, T), p=[0.7, 0.15, 0.15])
    )
    logp_rollout = logp_old + rng.normal(0, spread, (B, T))
    adv = rng.normal(0, 1, B)
    adv[0] = 0.0
    lengths = rng.integers(1, T + 1, B)
    lengths[1] = T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    # Padding holds junk that must never leak into the loss or the gradient.
    logp = np.where(mask > 0, logp, -np.inf)
    return logp, logp_old, logp_rollout, adv, mask


def _finite(x):
    return np.where(np.isfinite(x), x, 0.0)


OPTION_SETS = [
    {},
    {"dual_clip": None},
    {"tis_cap": None},
    {"clip_low": 0.1, "clip_high": 0.4, "dual_clip": 2.0, "tis_cap": 1.2},
    {"token_rejection": (0.7, 1.3)},
    {"sequence_veto": 0.6},
    {"tis_renormalize": True},
    {"token_rejection": (0.6, 1.6), "sequence_veto": 0.5, "tis_renormalize": True},
]


@pytest.mark.parametrize(
    "aggregation,options,seed",
    [
        (agg, opt, seed)
        for (agg, opt), seed in zip(
            itertools.product(grpo.AGGREGATIONS, OPTION_SETS), itertools.count()
        )
    ],
)
def test_policy_loss_matches_reference(aggregation, options, seed):
    logp, logp_old, logp_rollout, adv, mask = random_inputs(seed)
    loss, metrics = jax.jit(lambda *a: grpo.policy_loss(*a, aggregation=aggregation, **options))(
        logp, logp_old, logp_rollout, adv, mask
    )
    ref_loss, ref_metrics = reference_loss(
        _finite(logp), logp_old, logp_rollout, adv, mask, aggregation=aggregation, **options
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_every_branch_is_exercised():
    hits = {"clipfrac_high": 0, "clipfrac_low": 0, "dual_clipfrac": 0, "tis_capped_frac": 0}
    for seed in range(4):
        _, metrics = grpo.policy_loss(*random_inputs(seed))
        for k in hits:
            hits[k] += float(metrics[k]) > 0
    assert all(hits.values()), hits


def test_options_report_fractions():
    logp, logp_old, logp_rollout, adv, mask = random_inputs(3)
    logp_rollout = logp_rollout.copy()
    logp_rollout[2, 0] = logp_old[2, 0] + 12.0  # rollout ratio e^-12 < 1e-4: veto sequence 2
    _, m = grpo.policy_loss(
        logp, logp_old, logp_rollout, adv, mask, token_rejection=(0.5, 1.5), sequence_veto=1e-4
    )
    assert float(m["seq_vetoed_frac"]) == pytest.approx(1 / 6)
    assert 0 < float(m["token_rejected_frac"]) < 1
    assert float(m["effective_token_frac"]) < 1 - float(m["token_rejected_frac"]) + 1e-6


def test_kl_to_reference():
    logp, logp_old, logp_rollout, adv, mask = random_inputs(5)
    logp_ref = logp_old - 0.3
    loss, m = grpo.policy_loss(
        logp, logp_old, logp_rollout, adv, mask, logp_ref=logp_ref, kl_coef=0.1
    )
    ref, _ = reference_loss(
        _finite(logp), logp_old, logp_rollout, adv, mask, logp_ref=logp_ref, kl_coef=0.1
    )
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert float(m["kl_ref"]) > 0


def test_no_rollout_logps_means_no_correction():
    logp, logp_old, _, adv, mask = random_inputs(6)
    a, _ = grpo.policy_loss(logp, logp_old, None, adv, mask)
    b, _ = grpo.policy_loss(logp, logp_old, logp_old, adv, mask)
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_empty_mask_gives_zero_loss_and_nan_metrics():
    logp, logp_old, logp_rollout, adv, _ = random_inputs(7)
    loss, m = grpo.policy_loss(logp, logp_old, logp_rollout, adv, np.zeros((B, T)))
    assert float(loss) == 0.0 and np.isnan(m["ratio_mean"])


# --------------------------------------------------------------------------- accumulation

V, D = 11, 5


def linear_policy_logp(w, x, tokens):
    """A tiny 'policy': logits = x @ w, log-softmax gathered at the sampled tokens. [B, T]."""
    logits = jnp.einsum("btd,dv->btv", x, w)
    return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
@pytest.mark.parametrize(
    "options", [{}, {"token_rejection": (0.6, 1.6), "sequence_veto": 0.3, "tis_renormalize": True}]
)
def test_microbatch_accumulation_is_exact(aggregation, options):
    rng = np.random.default_rng(0)
    w_old = rng.normal(0, 1, (D, V)).astype(np.float32)
    w = w_old + rng.normal(0, 0.3, (D, V)).astype(np.float32)
    x = rng.normal(0, 1, (8, T, D)).astype(np.float32)
    tokens = rng.integers(0, V, (8, T))
    mask = (np.arange(T)[None] < rng.integers(1, T + 1, 8)[:, None]).astype(np.float32)
    logp_old = linear_policy_logp(w_old, x, tokens)
    logp_rollout = logp_old + rng.normal(0, 0.3, (8, T)).astype(np.float32)
    logp_rollout = logp_rollout.at[4, 0].add(3.0)  # rollout ratio e^-3: vetoes sequence 4
    adv = grpo.group_advantages(rng.integers(0, 2, 8).astype(np.float32), 4)
    kw = dict(aggregation=aggregation, **options)

    def full(w):
        return grpo.policy_loss(
            linear_policy_logp(w, x, tokens), logp_old, logp_rollout, adv, mask, **kw
        )[0]

    # The learner's view: a global denominator and TIS mean, computed before the backward pass.
    eff = grpo.effective_mask(
        logp_old,
        logp_rollout,
        mask,
        token_rejection=options.get("token_rejection"),
        sequence_veto=options.get("sequence_veto"),
    )
    denom = grpo.loss_denominator(eff, aggregation)
    w_sum, w_cnt = grpo.tis_weight_sums(
        logp_old,
        logp_rollout,
        mask,
        token_rejection=options.get("token_rejection"),
        sequence_veto=options.get("sequence_veto"),
    )
    tis_mean = w_sum / w_cnt if options.get("tis_renormalize") else None

    @jax.jit
    @functools.partial(jax.value_and_grad, has_aux=True)
    def micro(w, x, tokens, logp_old, logp_rollout, adv, mask):
        s, d, m = grpo.policy_loss_terms(
            linear_policy_logp(w, x, tokens),
            logp_old,
            logp_rollout,
            adv,
            mask,
            grpo.LossConfig(**kw),
            tis_mean=tis_mean,
        )
        return s, (d, m)

    acc_loss, acc_grad, acc_den, acc_metrics = 0.0, 0.0, 0.0, None
    for sl in [slice(0, 3), slice(3, 5), slice(5, 8)]:
        (s, (d, m)), g = micro(
            w, x[sl], tokens[sl], logp_old[sl], logp_rollout[sl], adv[sl], mask[sl]
        )
        acc_loss, acc_grad, acc_den = acc_loss + s, acc_grad + g, acc_den + d
        acc_metrics = m if acc_metrics is None else grpo.merge_metric_sums(acc_metrics, m)
    np.testing.assert_allclose(acc_den, denom)
    np.testing.assert_allclose(acc_loss / denom, full(w), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(acc_grad / denom, jax.jit(jax.grad(full))(w), rtol=1e-4, atol=1e-7)
    _, full_metrics = grpo.policy_loss(
        linear_policy_logp(w, x, tokens), logp_old, logp_rollout, adv, mask, **kw
    )
    for name, value in grpo.finalize_metrics(acc_metrics).items():
        np.testing.assert_allclose(value, full_metrics[name], rtol=1e-5, err_msg=name)
    if "sequence_veto" in options:
        assert float(full_metrics["seq_vetoed_frac"]) >= 1 / 8


def test_gradient_is_finite_with_junk_padding():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (4, T, D)).astype(np.float32)
    tokens = rng.integers(0, V, (4, T))
    mask = np.ones((4, T), np.float32)
    mask[:, -3:] = 0
    logp_old = np.where(mask > 0, -1.0, -np.inf).astype(np.float32)
    g = jax.jit(
        jax.grad(
            lambda w: grpo.policy_loss(
                linear_policy_logp(w, x, tokens), logp_old, logp_old, jnp.ones(4), mask
            )[0]
        )
    )(jnp.zeros((D, V)))
    assert np.all(np.isfinite(g)) and np.any(g != 0)


# --------------------------------------------------------------------------- advantages


def test_group_advantages():
    r = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 2.0], np.float32)
    a = np.asarray(grpo.group_advantages(r, 4))
    g = r.reshape(3, 4)
    expected = (g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)  # ddof=0
    np.testing.assert_allclose(a, expected.reshape(-1), rtol=1e-5)
    assert np.all(a[4:8] == 0)  # zero-variance group: no signal, no NaN
    dr = np.asarray(grpo.group_advantages(r, 4, normalize_std=False))
    np.testing.assert_allclose(dr, (g - g.mean(1, keepdims=True)).reshape(-1))
    assert float(grpo.zero_advantage_fraction(jnp.asarray(a), 4)) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo.group_advantages(r, 5)
    with pytest.raises(ValueError):
        grpo.group_advantages(r, 0)
    jitted = jax.jit(grpo.group_advantages, static_argnums=1)
    np.testing.assert_allclose(jitted(r, 4), a)


def test_loss_config_gin_and_validation():
    gin.clear_config()
    gin.parse_config(
        "LossConfig.aggregation = 'seq-mean-token-sum'\nLossConfig.token_rejection = [0.5, 1.5]"
    )
    cfg = grpo.LossConfig()
    gin.clear_config()
    assert cfg.aggregation == "seq-mean-token-sum" and cfg.token_rejection == (0.5, 1.5)
    assert cfg.aggregation is grpo.Aggregation.SEQ_MEAN_TOKEN_SUM
    hash(cfg)  # usable as a static jit argument
    assert hash(grpo.LossConfig(aggregation="token-mean")) == hash(grpo.LossConfig())
    allowed = "('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum')"
    with pytest.raises(ValueError, match=re.escape(
            f"LossConfig.aggregation must be one of {allowed}, got 'sum'")):
        grpo.LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match=re.escape(f"aggregation must be one of {allowed}")):
        grpo.policy_loss(*random_inputs(9), aggregation="sum")
    with pytest.raises(ValueError, match="dual_clip"):
        grpo.LossConfig(dual_clip=0.5)


@pytest.mark.parametrize("options", OPTION_SETS + [{"aggregation": "seq-mean-token-mean"}])
def test_loss_config_path_equals_policy_loss_keywords(options):
    """The learner's path (`policy_loss_terms` with a LossConfig, under jit as a static argument)
    gives bit-identical loss and metrics to the public keywords of `policy_loss`."""
    inputs = random_inputs(11)
    loss, metrics = jax.jit(lambda *a: grpo.policy_loss(*a, **options))(*inputs)
    cfg = grpo.LossConfig(**options)

    @functools.partial(jax.jit, static_argnames="cfg")
    def via_config(*a, cfg):
        loss_sum, denominator, sums = grpo.policy_loss_terms(*a, cfg)
        loss = jnp.where(denominator > 0, loss_sum / jnp.maximum(denominator, 1e-12), 0.0)
        return loss, grpo.finalize_metrics(sums)

    cfg_loss, cfg_metrics = via_config(*inputs, cfg=cfg)
    assert float(cfg_loss) == float(loss)
    assert cfg_metrics.keys() == metrics.keys()
    for name, value in metrics.items():
        np.testing.assert_array_equal(cfg_metrics[name], value, err_msg=name)
