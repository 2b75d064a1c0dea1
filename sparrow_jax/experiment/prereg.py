"""The pre-registered analysis of a paired experiment (issue 41): equivalence, lag, predictor.

Written before the experiment runs; its settings live in the experiment's gin file
(``PreregConfig``), so what is tested cannot move after the numbers are seen. On the per-seed
paired differences ``d_s = arm@s - dense@s`` of one held-out metric (``paired.py``):

- **equivalence** of ``equivalent_arm`` and the reference by TOST (two one-sided t-tests at
  ``alpha``): equivalent when both ``mean(d) > -margin`` and ``mean(d) < margin`` are shown,
  i.e. the 1 - 2 alpha t-interval lies inside (-margin, margin);
- **lag** of ``lagging_arm``: the one-sided t-test of ``mean(d) < 0`` at ``alpha``;
- **predictor**: over every non-reference run, Spearman's rank correlation of its difference
  with (a) its per-bin tail failures (``schedule/bins_below_target`` summed over its steps
  after the controller's first ``from_step`` - 1) and (b) its mean alpha over the same steps;
  the tail is the better predictor when ``|rho_tail| > |rho_mean|``. With a handful of runs this
  is a weak statement and the report says so with the runs' count. **Invalid by construction
  when a run has no controller record**: a fixed-table arm (``TrainConfig.adapt_schedule =
  False``) logs no ``schedule/bins_below_target``, so its "tail failures" would be 0 however
  its tail fails (issue 41's M, shown failing in 5 bins by calibration, scored 0). The analysis
  then reports the comparison as invalid and names no winner;
- **power** (``planned_sd``, registered after the first run for the pooled runs to come): the
  exact power of the paired TOST with n seeds (``tost_power``), the seeds it needs for
  ``power`` at the registered s.d. and at the s.d. of the differences pooled so far
  (``seeds_needed``), and how many more seeds that is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import gin
import numpy as np

from sparrow_jax.experiment.paired import last_value, split_arm

__all__ = ["PreregConfig", "tost", "tost_power", "seeds_needed", "power_summary", "lag_test",
           "spearman", "run_features", "analyse", "prereg_markdown", "PREDICTOR_INVALID"]

# What the report says instead of a predictor winner when some run has no controller record.
PREDICTOR_INVALID = "invalid: fixed-table arms log no tail failures"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PreregConfig:
    """What the experiment tests, fixed before it runs.

    Attributes:
      metric: the held-out metric compared at the last evaluation.
      reference, equivalent_arm, lagging_arm: arm names (``<arm>@<seed>`` runs).
      margin: TOST equivalence margin, in the metric's units.
      alpha: level of each one-sided test.
      seeds: the seeds the analysis uses (never used to tune anything); runs of other seeds
        are ignored, and a missing one is reported.
      from_step: first step counted by the predictor's per-run features.
      planned_sd: the s.d. over seeds of the paired differences ``d_s`` that the power
        analysis plans for (the spread measured so far); None: no power analysis.
      power: the power the registered number of seeds is sized for (at a true difference of 0).
    """
    metric: str = "eval_dense/ref_p_exact"
    reference: str = "dense"
    equivalent_arm: str = "controller"
    lagging_arm: str = "M"
    margin: float = 0.02
    alpha: float = 0.05
    seeds: tuple[str, ...] = ()
    from_step: int = 1
    planned_sd: float | None = None
    power: float = 0.8

    def __post_init__(self):
        if not self.margin > 0 or not 0 < self.alpha < 0.5:
            raise ValueError(f"margin must be > 0 and alpha in (0, 0.5): {self}")
        if self.planned_sd is not None and not self.planned_sd > 0:
            raise ValueError(f"planned_sd must be > 0 (or None), got {self.planned_sd}")
        if not 0 < self.power < 1:
            raise ValueError(f"power must be in (0, 1), got {self.power}")
        object.__setattr__(self, "seeds", tuple(str(s) for s in self.seeds))

    def planned_seeds(self) -> int | None:
        """Seeds the registered TOST needs for ``power`` at ``planned_sd`` (None: no plan)."""
        if self.planned_sd is None:
            return None
        return seeds_needed(self.planned_sd, self.margin, self.alpha, self.power)


def _stats():
    """scipy.stats, imported at the first statistical test: every `sparrow` command imports
    this module (gin registers ExperimentConfig for `sparrow experiment --parallel`), and
    scipy.stats costs ~0.7 CPU-s in each process that compares no arms (`sparrow train`)."""
    from scipy import stats
    return stats


def _t_summary(d: np.ndarray) -> tuple[float, float, int]:
    n = d.size
    if n < 2:
        raise ValueError(f"a paired t-test needs >= 2 seeds, got {n}")
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(n)), n - 1


def tost(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> dict[str, float | bool]:
    """Two one-sided t-tests of |mean(diffs)| < margin.

    Returns mean, se, df, ``p_low`` (H0: mean <= -margin), ``p_high`` (H0: mean >= margin),
    ``p`` = max of the two, the ``1 - 2 alpha`` interval ``ci_low``/``ci_high`` and
    ``equivalent`` (p < alpha)."""
    d = np.asarray(diffs, np.float64)
    mean, se, df = _t_summary(d)
    if se == 0:
        p_low = p_high = 0.0 if abs(mean) < margin else 1.0
    else:
        p_low = float(_stats().t.sf((mean + margin) / se, df))
        p_high = float(_stats().t.cdf((mean - margin) / se, df))
    half = float(_stats().t.ppf(1 - alpha, df)) * se
    p = max(p_low, p_high)
    return {"mean": mean, "se": se, "df": df, "p_low": p_low, "p_high": p_high, "p": p,
            "ci_low": mean - half, "ci_high": mean + half, "equivalent": bool(p < alpha)}


def tost_power(n: int, sd: float, margin: float, alpha: float = 0.05,
               true_diff: float = 0.0) -> float:
    """Exact power of the paired TOST (``tost``) with n seeds: the probability that it shows
    equivalence when the per-seed differences are i.i.d. N(true_diff, sd^2).

    With mean m ~ N(delta, sd^2 / n), sample s.d. s ~ sd sqrt(chi2_{n-1} / (n - 1)) independent of
    m, and t = t_{1 - alpha, n - 1}, TOST shows equivalence iff
    -margin + t s / sqrt(n) < m < margin - t s / sqrt(n), so

        power = E_s[ max(0, Phi((margin - t s/sqrt(n) - delta) sqrt(n) / sd)
                          - Phi((-margin + t s/sqrt(n) - delta) sqrt(n) / sd)) ],

    integrated over the chi-square law of s (zero once t s / sqrt(n) >= margin)."""
    if n < 2:
        raise ValueError(f"a paired t-test needs >= 2 seeds, got {n}")
    from scipy import integrate
    t = float(_stats().t.ppf(1 - alpha, n - 1))
    root, k = math.sqrt(n), n - 1
    u_max = k * (margin * root / (t * sd)) ** 2     # beyond: the interval is wider than the margin
    log_norm = -0.5 * k * math.log(2.0) - math.lgamma(0.5 * k)

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def given_u(u: float) -> float:            # math, not scipy.stats: quad calls it ~10^3 times
        if u <= 0.0:
            return 0.0
        half = t * sd * math.sqrt(u / k) / root
        hi = (margin - half - true_diff) * root / sd
        lo = (-margin + half - true_diff) * root / sd
        density = math.exp(log_norm + (0.5 * k - 1.0) * math.log(u) - 0.5 * u)   # chi2_k pdf
        return max(0.0, phi(hi) - phi(lo)) * density

    return float(integrate.quad(given_u, 0.0, u_max, limit=200)[0])


def seeds_needed(sd: float, margin: float, alpha: float = 0.05, power: float = 0.8, *,
                 true_diff: float = 0.0, max_seeds: int = 10_000) -> int:
    """The smallest number of paired seeds whose TOST has at least ``power`` (``tost_power``)."""
    lo, hi = 2, 2
    while tost_power(hi, sd, margin, alpha, true_diff) < power:
        if hi >= max_seeds:
            raise ValueError(f"more than {max_seeds} seeds needed (sd {sd}, margin {margin})")
        lo, hi = hi, min(2 * hi, max_seeds)
    while lo < hi:                  # power grows with n: bisect for the first n that reaches it
        mid = (lo + hi) // 2
        if tost_power(mid, sd, margin, alpha, true_diff) >= power:
            hi = mid
        else:
            lo = mid + 1
    return hi


def power_summary(diffs: Sequence[float], cfg: PreregConfig) -> dict[str, Any] | None:
    """Where the pooled seeds stand against the registered power analysis (None: no plan)."""
    if cfg.planned_sd is None:
        return None
    d = np.asarray(diffs, np.float64)
    n = int(d.size)
    need = cfg.planned_seeds()
    out: dict[str, Any] = {"planned_sd": cfg.planned_sd, "power": cfg.power, "needed": need,
                           "seeds": n, "more_needed": max(0, need - n),
                           "power_now": tost_power(n, cfg.planned_sd, cfg.margin, cfg.alpha)
                           if n >= 2 else 0.0, "observed_sd": math.nan,
                           "needed_at_observed_sd": None}
    if n >= 2 and d.std(ddof=1) > 0:
        out["observed_sd"] = float(d.std(ddof=1))
        out["needed_at_observed_sd"] = seeds_needed(out["observed_sd"], cfg.margin, cfg.alpha,
                                                    cfg.power)
    return out


def lag_test(diffs: Sequence[float], alpha: float = 0.05) -> dict[str, float | bool]:
    """One-sided t-test of mean(diffs) < 0: mean, se, df, p, ``lags`` (p < alpha)."""
    d = np.asarray(diffs, np.float64)
    mean, se, df = _t_summary(d)
    p = float(_stats().t.cdf(mean / se, df)) if se > 0 else (0.0 if mean < 0 else 1.0)
    return {"mean": mean, "se": se, "df": df, "p": p, "lags": bool(p < alpha)}


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties; NaN when either is constant)."""
    rx = _stats().rankdata(np.asarray(x, np.float64))
    ry = _stats().rankdata(np.asarray(y, np.float64))
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def run_features(rows: Sequence[Mapping[str, Any]], from_step: int) -> dict[str, float]:
    """Per run: ``tail_failures`` (bins below target summed over steps >= from_step; NaN for a
    run without a controller record - dense or a fixed table - which never judged its tail:
    not 0, which would read as "no failure") and ``mean_alpha``."""
    late = [r for r in rows if r.get("step", 0) >= from_step]
    logged = [float(r["schedule/bins_below_target"]) for r in late
              if r.get("schedule/bins_below_target") is not None]
    fails = float(sum(logged)) if logged else math.nan
    alphas = [float(r["alpha/alpha_mean"]) for r in late if r.get("alpha/alpha_mean") is not None]
    kv = [float(r["kv/read_model"]) for r in late if r.get("kv/read_model") is not None]
    roll = [float(r["time/rollout"]) for r in late if r.get("time/rollout") is not None]
    return {"tail_failures": fails, "mean_alpha": float(np.mean(alphas)) if alphas else math.nan,
            "kv_read": float(np.mean(kv)) if kv else math.nan,
            "rollout_s": float(np.sum(roll)) if roll else math.nan}


def analyse(results: Mapping[str, Sequence[Mapping[str, Any]]], cfg: PreregConfig
            ) -> dict[str, Any]:
    """results: ``arm@seed`` -> metrics.jsonl rows. Returns the pre-registered tests."""
    values: dict[str, dict[str, float]] = {}
    feats: dict[str, dict[str, dict[str, float]]] = {}
    for name, rows in results.items():
        arm, seed = split_arm(name)
        if seed is None or (cfg.seeds and seed not in cfg.seeds):
            continue
        values.setdefault(arm, {})[seed] = last_value(rows, cfg.metric)
        feats.setdefault(arm, {})[seed] = run_features(rows, cfg.from_step)
    ref = values.get(cfg.reference, {})
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "missing": [], "arms": {}}
    for arm in values:
        for s in cfg.seeds:
            if s not in values[arm]:
                out["missing"].append(f"{arm}@{s}")
    diffs = {arm: {s: v - ref[s] for s, v in by.items() if s in ref and np.isfinite(v)
                   and np.isfinite(ref[s])} for arm, by in values.items() if arm != cfg.reference}
    for arm, d in diffs.items():
        out["arms"][arm] = {"diffs": d, **{k: float(np.mean([feats[arm][s][k] for s in d]))
                                          if d else math.nan
                                          for k in ("kv_read", "rollout_s", "mean_alpha",
                                                    "tail_failures")}}
    out["arms"][cfg.reference] = {k: float(np.mean([f[k] for f in feats.get(cfg.reference,
                                                                            {}).values()]))
                                  if feats.get(cfg.reference) else math.nan
                                  for k in ("kv_read", "rollout_s")}
    eq = list(diffs.get(cfg.equivalent_arm, {}).values())
    lag = list(diffs.get(cfg.lagging_arm, {}).values())
    out["tost"] = tost(eq, cfg.margin, cfg.alpha) if len(eq) >= 2 else None
    out["power"] = power_summary(eq, cfg)
    out["lag"] = lag_test(lag, cfg.alpha) if len(lag) >= 2 else None
    xs = [(f"{a}@{s}", feats[a][s]["tail_failures"], feats[a][s]["mean_alpha"], d[s])
          for a, d in diffs.items() for s in d]
    if len(xs) >= 3:
        names, t, m, y = (list(c) for c in zip(*xs))
        unlogged = [n for n, v in zip(names, t) if not np.isfinite(v)]
        out["predictor"] = {"runs": len(xs), "unlogged": unlogged}
        if unlogged:           # a fixed table's 0 failures are by construction: no comparison
            out["predictor"].update(invalid=PREDICTOR_INVALID, tail_better=None)
        else:
            out["predictor"].update(rho_tail=spearman([-v for v in t], y),
                                    rho_mean=spearman(m, y))
            out["predictor"]["tail_better"] = bool(
                abs(np.nan_to_num(out["predictor"]["rho_tail"])) >
                abs(np.nan_to_num(out["predictor"]["rho_mean"])))
    else:
        out["predictor"] = None
    return out


def prereg_markdown(res: Mapping[str, Any]) -> str:
    """The report of ``analyse``: the tests as registered, then per-arm KV read and rollout time."""
    c = res["config"]
    lines = [f"# Pre-registered analysis: `{c['metric']}` (seeds {', '.join(c['seeds']) or 'all'})",
             ""]
    if res["missing"]:
        lines.append(f"**Missing runs:** {', '.join(res['missing'])}")
    t = res["tost"]
    lines.append(
        f"- equivalence of `{c['equivalent_arm']}` and `{c['reference']}` (TOST, margin "
        f"{c['margin']:g}, alpha {c['alpha']:g}): " + ("not computed (< 2 paired seeds)" if t is
        None else f"mean difference {t['mean']:+.4f}, {100 - 200 * c['alpha']:g}% CI "
        f"[{t['ci_low']:+.4f}, {t['ci_high']:+.4f}], p = {t['p']:.3f} -> "
        f"**{'equivalent' if t['equivalent'] else 'not shown equivalent'}**"))
    w = res.get("power")
    if w is not None:
        at_obs = ("" if w["needed_at_observed_sd"] is None else
                  f"; at the s.d. of the differences pooled so far ({w['observed_sd']:.4f}) it "
                  f"needs {w['needed_at_observed_sd']}")
        lines.append(
            f"- power (paired TOST, exact; registered s.d. {w['planned_sd']:g}, power "
            f"{w['power']:g} at a true difference of 0): **{w['needed']} seeds needed**; "
            f"{w['seeds']} pooled so far (power {w['power_now']:.2f} at the registered s.d.), "
            f"**{w['more_needed']} more needed**{at_obs}. Pooled estimate: "
            + ("none yet" if t is None else f"{t['mean']:+.4f}, {100 - 200 * c['alpha']:g}% CI "
               f"[{t['ci_low']:+.4f}, {t['ci_high']:+.4f}] over {w['seeds']} seeds"))
    g = res["lag"]
    lines.append(
        f"- `{c['lagging_arm']}` lags `{c['reference']}` (one-sided t, alpha {c['alpha']:g}): "
        + ("not computed (< 2 paired seeds)" if g is None else
           f"mean difference {g['mean']:+.4f} +- {g['se']:.4f}, p = {g['p']:.3f} -> "
           f"**{'lags' if g['lags'] else 'not shown to lag'}**"))
    p = res["predictor"]
    if p is None:
        verdict = "not computed (< 3 runs)"
    elif p.get("invalid"):
        verdict = (f"**{p['invalid']}** ({', '.join(p['unlogged'])}: no controller record, so "
                   "their tail failures are 0 by construction, not measured); no winner")
    else:
        verdict = (f"Spearman rho, minus tail failures {p['rho_tail']:+.2f} vs mean alpha "
                   f"{p['rho_mean']:+.2f} over {p['runs']} runs -> "
                   f"**{'the tail' if p['tail_better'] else 'not the tail'}** predicts better "
                   f"(weak with {p['runs']} runs)")
    lines.append("- predictor of the difference: " + verdict)
    lines += ["", "| arm | whole-model KV read | rollout seconds (summed) | mean alpha | "
              "tail failures |", "|---|---|---|---|---|"]
    for arm, a in res["arms"].items():
        fails = a.get("tail_failures", math.nan)
        lines.append(f"| {arm} | {a.get('kv_read', math.nan):.3f} | "
                     f"{a.get('rollout_s', math.nan):.1f} | {a.get('mean_alpha', math.nan):.4f} | "
                     + (f"{fails:.1f} |" if np.isfinite(fails) else "not logged |"))
    return "\n".join(lines) + "\n"
