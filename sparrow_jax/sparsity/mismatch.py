"""Mismatch statistic between the sparse rollout policy and the dense trained policy.

Per generated token t (same prefix on both sides), the acceptance rate is

    alpha_t = sum_v min(p_sparse(v), p_dense(v)) = 1 - TV(p_sparse, p_dense),

1 meaning identical next-token distributions. Training stability is governed by the *tail*
of alpha, not its mean: tokens are binned by total cached length (prompt + generated so far)
into 2000-token bins and the 5th percentile per bin is compared against a target (0.86 in the
paper). Everything here is a pure, jittable function of arrays; static arguments are marked
in each ``jax.jit`` decorator.

Memory: ``acceptance_rate(..., chunk_size=c)`` walks the second-to-last (time) axis in chunks
of ``c`` positions with ``lax.fori_loop``, so the f32 softmax intermediates are ``[..., c, V]``
instead of ``[..., T, V]`` (at V = 152K, T = 32K one f32 copy is ~20 GB per sequence).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sparrow_jax.runtime.choices import Choice

Array = jax.Array


class AlphaMode(Choice):
    """How the learner measures alpha, the sparse actor's per-token acceptance rate
    (`LearnerConfig.alpha_mode`)."""
    FULL = "full"    # exact, full-vocabulary: a teacher-forced replay of the sparse actor
    TOPK = "topk"    # the paper's lower bound from the rollout's recorded top-k (no extra forward)
    NONE = "none"    # no mismatch statistic


__all__ = [
    "AlphaMode",
    "acceptance_rate",
    "acceptance_rate_from_logprobs",
    "acceptance_rate_topk",
    "topk_logprobs",
    "token_logprobs",
    "binned_quantiles",
    "tail_by_bin",
    "mismatch_summary",
    "noise_floor",
    "merge_with_noise_floor",
]


# ----------------------------------------------------------------------------------------------
# Acceptance rate
# ----------------------------------------------------------------------------------------------


def acceptance_rate_from_logprobs(logp_sparse: Array, logp_dense: Array) -> Array:
    """alpha from normalised log-probabilities.

    Args:
      logp_sparse, logp_dense: ``[..., V]`` log-probabilities over the full vocabulary.
    Returns:
      ``[...]`` f32 in [0, 1].
    """
    lp_s = logp_sparse.astype(jnp.float32)
    lp_d = logp_dense.astype(jnp.float32)
    # min(p, q) = exp(min(log p, log q)): one exp instead of two, and -inf entries give 0.
    alpha = jnp.sum(jnp.exp(jnp.minimum(lp_s, lp_d)), axis=-1)
    # Rounding can push identical distributions a few ulps above 1; alpha is a probability.
    return jnp.clip(alpha, 0.0, 1.0)


def _alpha_from_logits(logits_sparse: Array, logits_dense: Array, temperature) -> Array:
    inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
    lp_s = jax.nn.log_softmax(logits_sparse.astype(jnp.float32) * inv_t, axis=-1)
    lp_d = jax.nn.log_softmax(logits_dense.astype(jnp.float32) * inv_t, axis=-1)
    return acceptance_rate_from_logprobs(lp_s, lp_d)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def acceptance_rate(
    logits_sparse: Array,
    logits_dense: Array,
    *,
    temperature: float | Array = 1.0,
    chunk_size: int | None = None,
) -> Array:
    """alpha = sum_v min(softmax(ls / T), softmax(ld / T)) over the last (vocabulary) axis.

    Args:
      logits_sparse, logits_dense: ``[..., V]`` (any float dtype; math is f32).
      temperature: sampling temperature (> 0) applied to both sides.
      chunk_size: if given and the inputs have >= 2 dims, process the second-to-last axis
        (time, ``T``) in chunks of this many positions so only ``[..., chunk, V]`` f32
        intermediates are live. The result is identical to the unchunked one.
    Returns:
      ``[...]`` (= leading axes) f32 alpha in [0, 1].
    """
    if logits_sparse.shape != logits_dense.shape:
        raise ValueError(
            f"logits shapes differ: sparse {logits_sparse.shape} vs dense {logits_dense.shape}"
        )
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    ndim = logits_sparse.ndim
    if chunk_size is None or ndim < 2 or logits_sparse.shape[-2] <= chunk_size:
        return _alpha_from_logits(logits_sparse, logits_dense, temperature)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    t_len = logits_sparse.shape[-2]
    num_chunks = -(-t_len // chunk_size)
    out = jnp.zeros(logits_sparse.shape[:-1], jnp.float32)

    def body(i, out):
        # The last chunk is shifted back to stay in bounds (no padding copy of the logits);
        # the overlap is recomputed and written with identical values.
        start = jnp.minimum(i * chunk_size, t_len - chunk_size)
        ls = lax.dynamic_slice_in_dim(logits_sparse, start, chunk_size, axis=ndim - 2)
        ld = lax.dynamic_slice_in_dim(logits_dense, start, chunk_size, axis=ndim - 2)
        alpha = _alpha_from_logits(ls, ld, temperature)
        return lax.dynamic_update_slice_in_dim(out, alpha, start, axis=ndim - 2)

    return lax.fori_loop(0, num_chunks, body, out)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_logprobs(logits: Array, k: int, *, temperature: float | Array = 1.0) -> tuple[Array, Array]:
    """Top-k full-vocabulary log-probabilities, as an inference engine would return them.

    Args:
      logits: ``[..., V]``.
    Returns:
      (logprobs ``[..., k]`` f32, normalised over the full vocabulary; ids ``[..., k]`` int32).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    values, ids = lax.top_k(logp, k)
    return values, ids.astype(jnp.int32)


@jax.jit
def acceptance_rate_topk(
    topk_logprobs_sparse: Array,
    topk_ids_sparse: Array,
    topk_logprobs_dense: Array,
    topk_ids_dense: Array,
) -> Array:
    """The paper's top-k estimator: sum over tokens in BOTH top-k sets of min(p_s, p_d).

    It drops every term outside the intersection, so it is a lower bound on the full alpha.
    The log-probabilities must be normalised over the full vocabulary (not renormalised
    within the top-k). Ids within one top-k set must be distinct; negative ids mark padding
    and never match.

    Args:
      topk_logprobs_sparse, topk_ids_sparse: ``[..., k]``.
      topk_logprobs_dense, topk_ids_dense: ``[..., k2]`` (k2 may differ from k).
    Returns:
      ``[...]`` f32 lower bound on alpha.
    """
    ids_s = topk_ids_sparse[..., :, None]
    ids_d = topk_ids_dense[..., None, :]
    match = (ids_s == ids_d) & (ids_s >= 0)  # [..., k, k2]
    lp_min = jnp.minimum(
        topk_logprobs_sparse.astype(jnp.float32)[..., :, None],
        topk_logprobs_dense.astype(jnp.float32)[..., None, :],
    )
    alpha = jnp.sum(jnp.where(match, jnp.exp(lp_min), 0.0), axis=(-2, -1))
    return jnp.clip(alpha, 0.0, 1.0)


@jax.jit
def token_logprobs(logits: Array, tokens: Array, *, temperature: float | Array = 1.0) -> Array:
    """log softmax(logits / T)[token]: ``logits [..., V]``, ``tokens [...]`` -> ``[...]`` f32."""
    scaled = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


# ----------------------------------------------------------------------------------------------
# Tail statistic per position bin
# ----------------------------------------------------------------------------------------------


def _lerp(a: Array, b: Array, t: Array) -> Array:
    # Same two-sided formula as numpy's quantile lerp, so results match numpy bit-for-bit
    # in float64 and to rounding in float32.
    diff = b - a
    return jnp.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)


@functools.partial(jax.jit, static_argnames=("num_bins", "quantiles"))
def binned_quantiles(
    values: Array, bins: Array, valid: Array, *, num_bins: int, quantiles: tuple[float, ...]
) -> tuple[Array, Array]:
    """Per-bin quantiles with numpy's ``method="linear"``, via one sort.

    Args:
      values: ``[N]`` float (finite where valid).
      bins: ``[N]`` int in [0, num_bins).
      valid: ``[N]`` bool; invalid entries are ignored.
      num_bins: static number of bins.
      quantiles: static tuple of quantile levels in [0, 1].
    Returns:
      (``[len(quantiles), num_bins]`` quantiles (NaN for empty bins), ``[num_bins]`` int32 counts).
    """
    vals = values.reshape(-1)
    dtype = jnp.promote_types(vals.dtype, jnp.float32)
    vals = vals.astype(dtype)
    valid = valid.reshape(-1).astype(bool)
    # Invalid entries get key num_bins so they sort after every real bin.
    key = jnp.where(valid, bins.reshape(-1).astype(jnp.int32), num_bins)
    _, sorted_vals = lax.sort((key, vals), num_keys=2)
    counts = jnp.zeros((num_bins + 1,), jnp.int32).at[key].add(1)[:num_bins]
    starts = jnp.cumsum(counts) - counts  # exclusive prefix sum: first index of each bin
    q = jnp.asarray(quantiles, dtype)[:, None]  # [Q, 1]
    n = counts[None, :]
    h = q * jnp.maximum(n - 1, 0).astype(dtype)  # virtual index inside the bin
    lo = jnp.floor(h)
    frac = h - lo
    lo_i = lo.astype(jnp.int32)
    hi_i = jnp.minimum(lo_i + 1, jnp.maximum(n - 1, 0))
    last = vals.shape[0] - 1
    a = sorted_vals[jnp.clip(starts + lo_i, 0, last)]
    b = sorted_vals[jnp.clip(starts + hi_i, 0, last)]
    out = jnp.where(n > 0, _lerp(a, b, frac), jnp.nan)
    return out, counts


def _position_bins(positions: Array, bin_size: int, num_bins: int) -> Array:
    # Last bin is open-ended; negative positions (padding conventions) land in bin 0.
    return jnp.clip(positions.astype(jnp.int32) // bin_size, 0, num_bins - 1)


def _as_mask(mask: Array | None, like: Array) -> Array:
    return jnp.ones(like.shape, bool) if mask is None else mask.astype(bool)


@functools.partial(jax.jit, static_argnames=("bin_size", "quantile", "num_bins"))
def tail_by_bin(
    alpha: Array,
    positions: Array,
    mask: Array | None,
    *,
    bin_size: int = 2000,
    quantile: float = 0.05,
    num_bins: int = 20,
) -> tuple[Array, Array]:
    """Per-bin ``quantile`` of alpha, bins of total cached length.

    Args:
      alpha: ``[...]`` per-token acceptance rates.
      positions: ``[...]`` int, total cached length (prompt + generated so far) of each token.
      mask: ``[...]`` bool (True = a real generated token) or None for all tokens.
      bin_size: tokens per bin; bin = min(position // bin_size, num_bins - 1).
      quantile: 0.05 = the 5th percentile (numpy ``method="linear"``).
      num_bins: static number of bins; the last one is open-ended.
    Returns:
      (tail ``[num_bins]`` (NaN for an empty bin), counts ``[num_bins]`` int32).
    """
    bins = _position_bins(positions, bin_size, num_bins)
    tails, counts = binned_quantiles(
        alpha, bins, _as_mask(mask, alpha), num_bins=num_bins, quantiles=(float(quantile),)
    )
    return tails[0], counts


def _masked_mean(x: Array, mask: Array, n: Array) -> Array:
    return jnp.where(n > 0, jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(n, 1), jnp.nan)


@functools.partial(
    jax.jit, static_argnames=("thresholds", "bin_size", "quantile", "num_bins")
)
def mismatch_summary(
    alpha: Array,
    positions: Array,
    mask: Array | None,
    *,
    thresholds: tuple[float, ...] = (0.5, 0.8, 0.9, 0.99),
    logp_sparse: Array | None = None,
    logp_dense: Array | None = None,
    bin_size: int = 2000,
    quantile: float = 0.05,
    num_bins: int = 20,
) -> dict[str, Array]:
    """Scalar metrics and the per-bin tail of one batch.

    Args:
      alpha, positions, mask: ``[...]`` as in ``tail_by_bin``.
      thresholds: static tuple (hashable); the fraction of tokens with alpha < each one.
      logp_sparse, logp_dense: optional ``[...]`` log-probs of the sampled tokens under the
        rollout (sparse) and the dense policy; adds stats of ``log_ratio = dense - sparse``
        (the log of the truncated-IS weight before capping).
    Returns:
      dict of f32 scalars: ``alpha_mean``, ``alpha_p1``, ``alpha_p5``, ``alpha_min``,
      ``frac_below_<t>``, ``num_tokens``, ``tail_min`` (worst bin with data, NaN if none),
      optional ``log_ratio_{mean,abs_mean,max,min}``; arrays ``tail [num_bins]`` and
      ``counts [num_bins]`` int32.
    """
    mask = _as_mask(mask, alpha)
    a = alpha.astype(jnp.float32)
    n = jnp.sum(mask).astype(jnp.int32)
    overall, _ = binned_quantiles(
        a, jnp.zeros(a.shape, jnp.int32), mask, num_bins=1, quantiles=(0.01, 0.05)
    )
    out: dict[str, Array] = {
        "num_tokens": n.astype(jnp.float32),
        "alpha_mean": _masked_mean(a, mask, n),
        "alpha_p1": overall[0, 0],
        "alpha_p5": overall[1, 0],
        "alpha_min": jnp.where(n > 0, jnp.min(jnp.where(mask, a, jnp.inf)), jnp.nan),
    }
    for t in thresholds:
        below = jnp.sum(mask & (a < t)).astype(jnp.float32)
        out[f"frac_below_{float(t):g}"] = jnp.where(n > 0, below / jnp.maximum(n, 1), jnp.nan)
    if (logp_sparse is None) != (logp_dense is None):
        raise ValueError("pass both logp_sparse and logp_dense, or neither")
    if logp_sparse is not None:
        r = logp_dense.astype(jnp.float32) - logp_sparse.astype(jnp.float32)
        out["log_ratio_mean"] = _masked_mean(r, mask, n)
        out["log_ratio_abs_mean"] = _masked_mean(jnp.abs(r), mask, n)
        out["log_ratio_max"] = jnp.where(n > 0, jnp.max(jnp.where(mask, r, -jnp.inf)), jnp.nan)
        out["log_ratio_min"] = jnp.where(n > 0, jnp.min(jnp.where(mask, r, jnp.inf)), jnp.nan)
    tail, counts = tail_by_bin(
        a, positions, mask, bin_size=bin_size, quantile=quantile, num_bins=num_bins
    )
    out["tail"] = tail
    out["counts"] = counts
    # nanmin of an all-NaN vector is NaN in JAX (no warning): "no bin had data".
    out["tail_min"] = jnp.nanmin(tail)
    return out


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "thresholds", "bin_size", "quantile", "num_bins"),
)
def noise_floor(
    logits_a: Array,
    logits_b: Array,
    positions: Array,
    mask: Array | None,
    *,
    tokens: Array | None = None,
    temperature: float | Array = 1.0,
    chunk_size: int | None = None,
    thresholds: tuple[float, ...] = (0.5, 0.8, 0.9, 0.99),
    bin_size: int = 2000,
    quantile: float = 0.05,
    num_bins: int = 20,
) -> dict[str, Array]:
    """The same statistics between two *dense* computations of the same policy.

    Feed logits of the same tokens from two dense paths that differ only numerically (e.g.
    the rollout engine's dense decode vs the learner's teacher-forced forward, bf16 vs f32, or
    different chunking). alpha here is what the statistic reads when the policies are
    identical, so a sparse tail should be judged relative to it.

    Args:
      logits_a, logits_b: ``[B, T, V]`` (any leading shape ``[..., T, V]``).
      positions, mask: ``[B, T]``.
      tokens: optional ``[B, T]`` sampled ids; adds log-ratio stats (b minus a).
    Returns:
      the dict of ``mismatch_summary``.
    """
    alpha = acceptance_rate(logits_a, logits_b, temperature=temperature, chunk_size=chunk_size)
    lp_a = lp_b = None
    if tokens is not None:
        lp_a = token_logprobs(logits_a, tokens, temperature=temperature)
        lp_b = token_logprobs(logits_b, tokens, temperature=temperature)
    return mismatch_summary(
        alpha, positions, mask, thresholds=thresholds, logp_sparse=lp_a,
        logp_dense=lp_b, bin_size=bin_size, quantile=quantile, num_bins=num_bins,
    )


def merge_with_noise_floor(
    summary: dict[str, Array], floor: dict[str, Array], prefix: str = "noise_floor/"
) -> dict[str, Array]:
    """One metrics dict holding both: sparse-vs-dense keys as-is, floor keys prefixed."""
    merged = dict(summary)
    merged.update({prefix + k: v for k, v in floor.items()})
    return merged
