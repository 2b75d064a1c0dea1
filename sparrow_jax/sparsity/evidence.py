"""Pooled tail evidence per length bin, with a confidence bound (host-side NumPy, pure).

The tail condition ``p_q(alpha) >= tau`` (the q-quantile of alpha in a bin is at least the
target tau) is the same statement as ``P(alpha < tau) <= q``: the rate of *exceedances* (tokens
with alpha below the target) is at most q. Unlike a quantile, exceedance counts pool: across the
rows of a batch and across steps. Tokens of one row are not independent (a row that went wrong
tends to stay wrong), so rows (or prompts: a GRPO group's rows summed) are the statistical unit:

  rate  r = sum_i k_i / sum_i n_i          (k_i exceedances among the n_i tokens of unit i)
  var   V = m/(m-1) * sum_i (k_i - r n_i)^2 / (sum_i n_i)^2     (cluster-robust ratio variance)

and the one-sided upper bound is Wilson's score bound at the effective token count
``n_eff = N / deff``, ``deff = max(1, V N / (r (1 - r)))`` (deff = 1 when r is 0 or 1).

Evidence from earlier steps counts with weight ``decay ** age``: the decayed sums below are
sufficient statistics (``Evidence``), updated in O(num_bins) per step.
"""

from __future__ import annotations

import dataclasses
from statistics import NormalDist
from typing import Any

import numpy as np

__all__ = ["Evidence", "exceedance_counts", "group_units", "upper_bound", "lower_bound"]

_FIELDS = ("units", "tokens", "hits", "hits2", "cross", "tokens2")


def exceedance_counts(alpha, positions, mask, *, target: float, bin_size: int,
                      num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row and bin: tokens with alpha < target, and tokens.

    Args:
      alpha: ``[B, T]`` acceptance rates.
      positions: ``[B, T]`` total cached length of each token (its bin = min(pos // bin_size,
        num_bins - 1), as ``mismatch.tail_by_bin``).
      mask: ``[B, T]`` real generated tokens.
    Returns:
      (hits ``[B, num_bins]``, tokens ``[B, num_bins]``) int64.
    """
    alpha = np.asarray(alpha, np.float64)
    mask = np.asarray(mask, bool) & np.isfinite(alpha)
    bins = np.clip(np.asarray(positions, np.int64) // bin_size, 0, num_bins - 1)
    b = alpha.shape[0]
    rows = np.broadcast_to(np.arange(b)[:, None], alpha.shape)
    tokens = np.zeros((b, num_bins), np.int64)
    hits = np.zeros((b, num_bins), np.int64)
    np.add.at(tokens, (rows[mask], bins[mask]), 1)
    below = mask & (alpha < target)
    np.add.at(hits, (rows[below], bins[below]), 1)
    return hits, tokens


def group_units(hits: np.ndarray, tokens: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``[B, nb]`` per-row counts -> ``[B // size, nb]`` per-unit counts (consecutive rows
    summed: size = the GRPO group size makes prompts the unit, 1 keeps rows)."""
    if size <= 1:
        return hits, tokens
    b, nb = hits.shape
    if b % size:
        raise ValueError(f"{b} rows are not whole groups of {size}")
    return hits.reshape(b // size, size, nb).sum(1), tokens.reshape(b // size, size, nb).sum(1)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Decayed sufficient statistics per bin (each a tuple of ``num_bins`` floats).

    units: units (rows/prompts) with at least one token in the bin; tokens: N = sum n_i;
    hits: K = sum k_i; hits2 = sum k_i^2; cross = sum k_i n_i; tokens2 = sum n_i^2.
    """

    units: tuple[float, ...]
    tokens: tuple[float, ...]
    hits: tuple[float, ...]
    hits2: tuple[float, ...]
    cross: tuple[float, ...]
    tokens2: tuple[float, ...]

    def __post_init__(self):
        n = len(self.units)
        for f in _FIELDS:
            value = tuple(float(v) for v in getattr(self, f))
            if len(value) != n:
                raise ValueError(f"Evidence.{f} has {len(value)} bins, units has {n}")
            object.__setattr__(self, f, value)

    @classmethod
    def empty(cls, num_bins: int) -> "Evidence":
        return cls(*((0.0,) * num_bins for _ in _FIELDS))

    @classmethod
    def from_counts(cls, hits, tokens) -> "Evidence":
        """From per-unit counts ``[U, nb]`` (units without tokens in a bin do not count)."""
        k = np.asarray(hits, np.float64)
        n = np.asarray(tokens, np.float64)
        return cls((n > 0).sum(0), n.sum(0), k.sum(0), (k * k).sum(0), (k * n).sum(0),
                   (n * n).sum(0))

    def arrays(self) -> dict[str, np.ndarray]:
        return {f: np.asarray(getattr(self, f)) for f in _FIELDS}

    def combine(self, new: "Evidence", decay: float, keep=None) -> "Evidence":
        """``decay * self + new``; bins where ``keep`` is False start from ``new`` alone."""
        old, add = self.arrays(), new.arrays()
        w = np.full(len(self.units), float(decay))
        if keep is not None:
            w = np.where(np.asarray(keep, bool), w, 0.0)
        return Evidence(*(w * old[f] + add[f] for f in _FIELDS))

    def select(self, take, other: "Evidence") -> "Evidence":
        """Per bin: this evidence where ``take``, else ``other``'s."""
        a, b = self.arrays(), other.arrays()
        take = np.asarray(take, bool)
        return Evidence(*(np.where(take, a[f], b[f]) for f in _FIELDS))

    def rate(self) -> np.ndarray:
        """``[nb]`` pooled exceedance rate K / N (NaN without tokens)."""
        a = self.arrays()
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(a["tokens"] > 0, a["hits"] / np.maximum(a["tokens"], 1e-12), np.nan)

    def to_dict(self) -> dict[str, Any]:
        return {f: list(getattr(self, f)) for f in _FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Evidence":
        return cls(*(tuple(data[f]) for f in _FIELDS))


def _wilson(p: np.ndarray, n: np.ndarray, z: float) -> np.ndarray:
    """Wilson score bound: upper for z > 0, lower for z < 0 (clipped to [0, 1])."""
    n = np.maximum(n, 1e-12)
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * np.sqrt(np.maximum(p * (1 - p) / n + z2 / (4 * n * n), 0.0))
    return np.clip((centre + spread) / (1 + z2 / n), 0.0, 1.0)


def _bound(ev: Evidence, confidence: float, sign: float) -> np.ndarray:
    """Wilson's one-sided bound (sign +1 upper, -1 lower) at the cluster-robust n_eff."""
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    z = NormalDist().inv_cdf(confidence)
    a = ev.arrays()
    n_tok, m = a["tokens"], a["units"]
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(n_tok > 0, a["hits"] / np.maximum(n_tok, 1e-12), 0.0)
        resid = a["hits2"] - 2 * r * a["cross"] + r * r * a["tokens2"]      # sum (k - r n)^2
        var = np.where(m > 1, m / np.maximum(m - 1, 1e-12), 1.0) * np.maximum(resid, 0.0) / (
            np.maximum(n_tok, 1e-12) ** 2)
        binom = r * (1 - r) / np.maximum(n_tok, 1e-12)
        deff = np.where(binom > 0, np.maximum(var / np.maximum(binom, 1e-300), 1.0), 1.0)
    b = _wilson(r, n_tok / deff, sign * z)
    return np.where(n_tok > 0, b, np.nan)


def lower_bound(ev: Evidence, confidence: float) -> np.ndarray:
    """``[nb]`` one-sided lower confidence bound on each bin's exceedance rate (NaN = no data):
    a bin whose lower bound exceeds q is shown failing at that confidence."""
    return _bound(ev, confidence, -1.0)


def upper_bound(ev: Evidence, confidence: float) -> np.ndarray:
    """``[nb]`` one-sided upper confidence bound on each bin's exceedance rate (NaN = no data).

    Cluster-robust (the units are independent, their tokens not), see the module docstring.
    """
    return _bound(ev, confidence, 1.0)
