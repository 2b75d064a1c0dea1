"""GRPO objective: group advantages and the clipped, importance-corrected policy loss.

Everything here is a pure function of arrays (jittable; option arguments are static Python
values: the loss's options are one `LossConfig`, hashable, a static jit argument). Shapes: B
sequences, T generated positions, per-token inputs `[B, T]`, advantages `[B]`.

Gradient accumulation. `policy_loss_terms` returns `(loss_sum, denominator, metric_sums)`
instead of a mean, so a learner can split a batch into micro-batches and still reproduce the
full-batch loss and gradient exactly:

    loss = sum_i loss_sum_i / D,   D = sum_i denominator_i  (or `loss_denominator(...)` up front)

The denominator depends only on the mask and on quantities fixed at rollout time (logp_old,
logp_rollout), never on the parameters, so `grad(sum_i loss_sum_i) / D` is the exact gradient.
Metrics are returned as `(sum, count)` pairs for the same reason; `merge_metric_sums` adds two
micro-batches (`empty_metric_sums` is its identity) and `finalize_metrics` turns the pairs into
masked means.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import gin
import jax
import jax.numpy as jnp

from sparrow_jax.runtime.choices import Choice

Array = jax.Array
MetricSums = dict[str, tuple[Array, Array]]


class Aggregation(Choice):
    """How per-token losses reduce to the batch loss (`LossConfig.aggregation`)."""
    TOKEN_MEAN = "token-mean"                    # mean over every contributing token
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # per-sequence token mean, then mean over seqs
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"    # per-sequence token sum, then mean over seqs


AGGREGATIONS = Aggregation.values()
# Log-ratios are clamped before exp (as verl does): a stale or garbage logp must not produce
# inf/NaN that poisons the whole batch; beyond +-20 the clipped objective is flat anyway.
_LOG_RATIO_CLAMP = 20.0
# The k3 estimator explodes for large log-ratio gaps; clamp as verl's "low_var_kl" does.
_K3_CLAMP = 10.0


@functools.partial(jax.jit, static_argnames=("group_size", "normalize_std", "eps"))
def group_advantages(
    rewards: Array, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Array:
    """GRPO advantages. rewards `[N]` -> `[N]` float32.

    Consecutive rows form a group (rows g*G .. g*G+G-1 are the G samples of one prompt).
    A = (r - group mean) / (group std + eps) with the *population* std (ddof=0), as in
    DeepSeekMath/verl. `normalize_std=False` is Dr.GRPO: A = r - group mean (no std division,
    which otherwise up-weights near-unanimous groups). A zero-variance group gets A = 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    n = rewards.shape[0]
    if group_size <= 0 or n % group_size:
        raise ValueError(f"number of rewards {n} is not a multiple of group_size {group_size}")
    groups = rewards.reshape(n // group_size, group_size)
    centered = groups - groups.mean(axis=1, keepdims=True)
    if normalize_std:
        centered = centered / (groups.std(axis=1, keepdims=True) + eps)
    return centered.reshape(n)


def zero_advantage_fraction(advantages: Array, group_size: int, *, atol: float = 1e-8) -> Array:
    """Fraction of groups whose advantages are all ~0 (all-correct or all-wrong groups carry
    no learning signal). advantages `[N]` -> scalar."""
    n = advantages.shape[0]
    if group_size <= 0 or n % group_size:
        raise ValueError(f"number of advantages {n} is not a multiple of group_size {group_size}")
    groups = jnp.abs(advantages.reshape(n // group_size, group_size))
    return jnp.mean(jnp.all(groups <= atol, axis=1).astype(jnp.float32))


def _rollout_log_ratio(logp_old: Array, logp_rollout: Array | None, valid: Array) -> Array:
    """log(pi_old / pi_rollout) per token `[B, T]`, 0 where invalid or when no rollout logps."""
    if logp_rollout is None:
        return jnp.zeros(logp_old.shape, jnp.float32)
    log_rr = jnp.where(valid, logp_old - logp_rollout, 0.0)
    return jnp.clip(log_rr, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _corrections(
    log_rr: Array,
    valid: Array,
    token_rejection: tuple[float, float] | None,
    sequence_veto: float | None,
) -> tuple[Array, Array, Array]:
    """Sparse-RL masks (arXiv 2601.10079). Returns (effective [B,T], rejected [B,T], vetoed [B]).

    Comparisons are done in log space so that tiny ratios (e.g. veto threshold 1e-4) are
    decided exactly rather than after exp underflow.
    """
    rejected = jnp.zeros(valid.shape, bool)
    if token_rejection is not None:
        lo, hi = token_rejection
        rejected = valid & ((log_rr < jnp.log(lo)) | (log_rr > jnp.log(hi)))
    vetoed = jnp.zeros(valid.shape[:1], bool)
    if sequence_veto is not None:
        vetoed = jnp.any(valid & (log_rr < jnp.log(sequence_veto)), axis=1)
    effective = valid & ~rejected & ~vetoed[:, None]
    return effective, rejected, vetoed


def effective_mask(
    logp_old: Array,
    logp_rollout: Array | None,
    mask: Array,
    *,
    token_rejection: tuple[float, float] | None = None,
    sequence_veto: float | None = None,
) -> Array:
    """The tokens that contribute to the loss after rejection/veto, `[B, T]` bool."""
    valid = mask > 0
    log_rr = _rollout_log_ratio(logp_old, logp_rollout, valid)
    return _corrections(log_rr, valid, token_rejection, sequence_veto)[0]


def loss_denominator(effective: Array, aggregation: str = "token-mean") -> Array:
    """Denominator of `aggregation` for an effective mask `[B, T]` -> scalar float32.

    token-mean: number of contributing tokens; seq-mean-*: number of sequences with at least
    one contributing token (fully masked/vetoed sequences drop out instead of averaging in 0).
    Sum it over micro-batches to get the global denominator.
    """
    aggregation = Aggregation.parse(aggregation, "aggregation")
    eff = effective > 0
    if aggregation == Aggregation.TOKEN_MEAN:
        return jnp.sum(eff, dtype=jnp.float32)
    return jnp.sum(jnp.any(eff, axis=1), dtype=jnp.float32)


def tis_weight_sums(
    logp_old: Array,
    logp_rollout: Array | None,
    mask: Array,
    *,
    tis_cap: float | None = 2.0,
    token_rejection: tuple[float, float] | None = None,
    sequence_veto: float | None = None,
) -> tuple[Array, Array]:
    """(sum of truncated TIS weights, number of effective tokens) for `tis_renormalize`.

    Sum both over micro-batches and pass `tis_mean = sum / count` to `policy_loss_terms` so
    every micro-batch is normalised by the same batch-wide mean.
    """
    valid = mask > 0
    log_rr = _rollout_log_ratio(logp_old, logp_rollout, valid)
    eff = _corrections(log_rr, valid, token_rejection, sequence_veto)[0]
    w = _tis_weight(log_rr, tis_cap)
    return jnp.sum(jnp.where(eff, w, 0.0)), jnp.sum(eff, dtype=jnp.float32)


def _tis_weight(log_rr: Array, tis_cap: float | None) -> Array:
    """min(exp(log_rr), tis_cap); tis_cap=None disables TIS (weight 1)."""
    if tis_cap is None:
        return jnp.ones(log_rr.shape, jnp.float32)
    return jnp.minimum(jnp.exp(log_rr), tis_cap)


def _masked_sum(x: Array, m: Array) -> Array:
    return jnp.sum(jnp.where(m, x, 0.0))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LossConfig:
    """GRPO loss options (defaults = the paper's recipe: asymmetric clip, dual-clip 3, TIS).

    clip_low, clip_high: the PPO ratio's clip range [1 - clip_low, 1 + clip_high].
    dual_clip: cap (> 1) of the loss of a negative-advantage token, x |A|; None = off.
    tis_cap: truncation of the TIS weight exp(logp_old - logp_rollout); None = no TIS.
    aggregation: an `Aggregation` (gin writes its string value).
    kl_coef: weight of the k3 KL to a reference policy (only where `logp_ref` is given).
    token_rejection: (lo, hi) bounds on exp(logp_old - logp_rollout), e.g. (0.5, 1.5), or None.
    sequence_veto: e.g. 1e-4 (drop a sequence if any token's rollout ratio is below), or None.
    tis_renormalize: divide the TIS weights by their mean over the effective tokens.
    normalize_std: GRPO advantages (True) or Dr.GRPO mean-centring only (False).
    advantage_eps: added to the group std (`group_advantages`).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    tis_cap: float | None = 2.0
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    kl_coef: float = 0.0
    token_rejection: tuple[float, float] | None = None
    sequence_veto: float | None = None
    tis_renormalize: bool = False
    normalize_std: bool = True
    advantage_eps: float = 1e-6

    def __post_init__(self) -> None:
        # gin gives the string; a member still equals (and hashes like) it.
        object.__setattr__(self, "aggregation",
                           Aggregation.parse(self.aggregation, "LossConfig.aggregation"))
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"bad clip range: low={self.clip_low}, high={self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (got {self.dual_clip})")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be positive (got {self.tis_cap})")
        if self.token_rejection is not None:
            lo, hi = self.token_rejection
            if not 0.0 < lo < hi:
                raise ValueError(f"token_rejection needs 0 < lo < hi (got {self.token_rejection})")
            # gin gives lists; a tuple keeps the dataclass hashable (static jit argument).
            object.__setattr__(self, "token_rejection", (float(lo), float(hi)))
        if self.sequence_veto is not None and self.sequence_veto <= 0.0:
            raise ValueError(f"sequence_veto must be positive (got {self.sequence_veto})")


def policy_loss_terms(
    logp: Array,
    logp_old: Array,
    logp_rollout: Array | None,
    advantages: Array,
    mask: Array,
    cfg: LossConfig,
    *,
    logp_ref: Array | None = None,
    tis_mean: Array | None = None,
) -> tuple[Array, Array, MetricSums]:
    """Un-normalised GRPO loss of one (micro-)batch: `(loss_sum, denominator, metric_sums)`.

    logp `[B, T]`: current policy (differentiated); logp_old `[B, T]`: dense policy that
    produced the behaviour logps at rollout time (the PPO anchor); logp_rollout `[B, T]`: the
    (sparse) actor's sampling logps, or None when rollout == old; advantages `[B]`;
    mask `[B, T]` (1 = generated token); cfg: the options (static). loss = loss_sum / denominator.

    Per token: ratio r = exp(logp - logp_old);
      pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))        (PPO, asymmetric clip)
      pg = min(pg, dual_clip * |A|)  where A < 0                     (dual-clip, as in verl)
      pg *= w,  w = stop_grad(min(exp(logp_old - logp_rollout), tis_cap))   (truncated IS)
      pg += kl_coef * k3(logp_ref || logp)            (only with logp_ref `[B, T]`; kl_coef 0 = off)
    Sparse-RL options: token_rejection=(lo, hi) masks tokens with rollout ratio outside [lo, hi];
    sequence_veto=eps drops a sequence if any token's rollout ratio < eps; tis_renormalize
    divides w by its mean over the effective tokens (`tis_mean` if given, else this batch's).
    """
    valid = mask > 0
    # Padding may hold -inf/NaN logps. Zero them before any arithmetic (the "double where"
    # trick): masking only the final loss would still give NaN * 0 = NaN gradients. Work in f32
    # whatever the model's dtype: exp of bf16 log-ratios is too coarse for clip decisions.
    logp = jnp.where(valid, logp, 0.0).astype(jnp.float32)
    logp_old = jnp.where(valid, logp_old, 0.0).astype(jnp.float32)
    if logp_rollout is not None:
        logp_rollout = jnp.where(valid, logp_rollout, 0.0).astype(jnp.float32)
    log_rr = _rollout_log_ratio(logp_old, logp_rollout, valid)
    eff, rejected, vetoed = _corrections(log_rr, valid, cfg.token_rejection, cfg.sequence_veto)

    adv = jnp.asarray(advantages, jnp.float32)[:, None]
    log_ratio = jnp.clip(
        logp - jax.lax.stop_gradient(logp_old), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
    )
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = jnp.maximum(loss_unclipped, loss_clipped)
    # The clipped branch is active exactly when it is the larger (gradient-free) one.
    clip_high_hit = (adv > 0) & (ratio > 1.0 + cfg.clip_high)
    clip_low_hit = (adv < 0) & (ratio < 1.0 - cfg.clip_low)
    dual_hit = jnp.zeros(pg.shape, bool)
    if cfg.dual_clip is not None:
        # For A < 0 an exploding ratio makes -A r unbounded; cap it at dual_clip * |A|.
        cap = -adv * cfg.dual_clip
        dual_hit = (adv < 0) & (pg > cap)
        pg = jnp.where(adv < 0, jnp.minimum(pg, cap), pg)

    w_trunc = jax.lax.stop_gradient(_tis_weight(log_rr, cfg.tis_cap))
    w = w_trunc
    if cfg.tis_renormalize:
        if tis_mean is None:
            tis_mean = _masked_sum(w_trunc, eff) / jnp.maximum(jnp.sum(eff), 1)
        w = w_trunc / jax.lax.stop_gradient(tis_mean)
    per_token = w * pg
    capped = jnp.zeros(valid.shape, bool) if cfg.tis_cap is None else jnp.exp(log_rr) > cfg.tis_cap

    metric_sums: MetricSums = {}
    if logp_ref is not None and cfg.kl_coef != 0.0:
        # k3 "low-variance" estimator of KL(pi || pi_ref) with samples from pi; not IS-weighted
        # (verl adds its KL loss separately from the policy-gradient term).
        kl = jnp.where(valid, logp_ref, 0.0) - logp
        k3 = jnp.clip(jnp.exp(kl) - kl - 1.0, -_K3_CLAMP, _K3_CLAMP)
        per_token = per_token + cfg.kl_coef * k3
        metric_sums["kl_ref"] = (_masked_sum(k3, eff), jnp.sum(eff, dtype=jnp.float32))

    n_eff = jnp.sum(eff, dtype=jnp.float32)
    denominator = loss_denominator(eff, cfg.aggregation)
    if cfg.aggregation == Aggregation.TOKEN_MEAN:
        loss_sum = _masked_sum(per_token, eff)
    else:
        seq_sum = jnp.sum(jnp.where(eff, per_token, 0.0), axis=1)
        if cfg.aggregation == Aggregation.SEQ_MEAN_TOKEN_MEAN:
            seq_sum = seq_sum / jnp.maximum(jnp.sum(eff, axis=1), 1)
        loss_sum = jnp.sum(seq_sum)

    ratio_sg = jax.lax.stop_gradient(ratio)
    log_r = jax.lax.stop_gradient(log_ratio)
    # k3 estimate of KL(pi_old || pi) from samples of pi_old: r - 1 - log r, r = pi / pi_old.
    approx_kl = jnp.exp(log_r) - 1.0 - log_r
    n_valid = jnp.sum(valid, dtype=jnp.float32)
    n_seqs = jnp.sum(jnp.any(valid, axis=1), dtype=jnp.float32)
    metric_sums.update(
        {
            "clipfrac_high": (_masked_sum(clip_high_hit, eff), n_eff),
            "clipfrac_low": (_masked_sum(clip_low_hit, eff), n_eff),
            "dual_clipfrac": (_masked_sum(dual_hit, eff), n_eff),
            "ratio_mean": (_masked_sum(ratio_sg, eff), n_eff),
            "ratio_max": (jnp.max(jnp.where(eff, ratio_sg, -jnp.inf)), n_eff),
            "ratio_min": (jnp.min(jnp.where(eff, ratio_sg, jnp.inf)), n_eff),
            "approx_kl": (_masked_sum(approx_kl, eff), n_eff),
            "tis_weight_mean": (_masked_sum(w_trunc, eff), n_eff),
            "tis_capped_frac": (_masked_sum(capped, eff), n_eff),
            "token_rejected_frac": (jnp.sum(rejected, dtype=jnp.float32), n_valid),
            "seq_vetoed_frac": (jnp.sum(vetoed, dtype=jnp.float32), n_seqs),
            "effective_token_frac": (n_eff, n_valid),
        }
    )
    return loss_sum, denominator, metric_sums


def merge_metric_sums(a: MetricSums, b: MetricSums) -> MetricSums:
    """Combine the metric pairs of two micro-batches (sums add, *_max/*_min reduce)."""
    out: MetricSums = {}
    for name, (va, ca) in a.items():
        vb, cb = b[name]
        if name.endswith("_max"):
            v = jnp.maximum(va, vb)
        elif name.endswith("_min"):
            v = jnp.minimum(va, vb)
        else:
            v = va + vb
        out[name] = (v, ca + cb)
    return out


def empty_metric_sums(like: MetricSums) -> MetricSums:
    """The identity of `merge_metric_sums` for metric sums shaped like `like` (-inf for *_max,
    +inf for *_min, 0 otherwise; counts 0): the initial carry of an accumulation."""
    def fill(name, v):
        value = -jnp.inf if name.endswith("_max") else jnp.inf if name.endswith("_min") else 0
        return jnp.full(v.shape, value, v.dtype)
    return {name: (fill(name, v), jnp.zeros(c.shape, c.dtype)) for name, (v, c) in like.items()}


def finalize_metrics(metric_sums: Mapping[str, tuple[Array, Array]]) -> dict[str, Array]:
    """(sum, count) pairs -> masked means (max/min pass through); NaN where count is 0."""
    out = {}
    for name, (v, c) in metric_sums.items():
        value = v if name.endswith(("_max", "_min")) else v / jnp.maximum(c, 1e-12)
        out[name] = jnp.where(c > 0, value, jnp.nan)
    return out


def policy_loss(
    logp: Array,
    logp_old: Array,
    logp_rollout: Array | None,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    tis_cap: float | None = 2.0,
    aggregation: str = "token-mean",
    logp_ref: Array | None = None,
    kl_coef: float = 0.0,
    token_rejection: tuple[float, float] | None = None,
    sequence_veto: float | None = None,
    tis_renormalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """Full-batch GRPO loss `(scalar, metrics)`; the options are `LossConfig`'s fields (checked
    as there) and `logp_ref` `[B, T]` that of `policy_loss_terms`.

    Uses this batch's own denominator and TIS mean; a batch with no effective token has loss 0.
    """
    cfg = LossConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, tis_cap=tis_cap,
                     aggregation=aggregation, kl_coef=kl_coef, token_rejection=token_rejection,
                     sequence_veto=sequence_veto, tis_renormalize=tis_renormalize)
    loss_sum, denominator, sums = policy_loss_terms(logp, logp_old, logp_rollout, advantages,
                                                    mask, cfg, logp_ref=logp_ref)
    loss = jnp.where(denominator > 0, loss_sum / jnp.maximum(denominator, 1e-12), 0.0)
    return loss, finalize_metrics(sums)
