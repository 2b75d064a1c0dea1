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
  is a weak statement and the report says so with the runs' count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import gin
import numpy as np

from sparrow_jax.experiment.paired import last_value, split_arm

__all__ = ["PreregConfig", "tost", "lag_test", "spearman", "run_features", "analyse",
           "prereg_markdown"]


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
    """
    metric: str = "eval_dense/ref_p_exact"
    reference: str = "dense"
    equivalent_arm: str = "controller"
    lagging_arm: str = "M"
    margin: float = 0.02
    alpha: float = 0.05
    seeds: tuple[str, ...] = ()
    from_step: int = 1

    def __post_init__(self):
        if not self.margin > 0 or not 0 < self.alpha < 0.5:
            raise ValueError(f"margin must be > 0 and alpha in (0, 0.5): {self}")
        object.__setattr__(self, "seeds", tuple(str(s) for s in self.seeds))


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
    """Per run: ``tail_failures`` (bins below target summed over steps >= from_step; 0 for a
    run without a controller record, whose rollouts were dense or fixed) and ``mean_alpha``."""
    late = [r for r in rows if r.get("step", 0) >= from_step]
    fails = sum(float(r["schedule/bins_below_target"]) for r in late
                if r.get("schedule/bins_below_target") is not None)
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
    out["lag"] = lag_test(lag, cfg.alpha) if len(lag) >= 2 else None
    xs = [(feats[a][s]["tail_failures"], feats[a][s]["mean_alpha"], d[s])
          for a, d in diffs.items() for s in d]
    if len(xs) >= 3:
        t, m, y = (list(c) for c in zip(*xs))
        out["predictor"] = {"runs": len(xs), "rho_tail": spearman([-v for v in t], y),
                            "rho_mean": spearman(m, y)}
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
    g = res["lag"]
    lines.append(
        f"- `{c['lagging_arm']}` lags `{c['reference']}` (one-sided t, alpha {c['alpha']:g}): "
        + ("not computed (< 2 paired seeds)" if g is None else
           f"mean difference {g['mean']:+.4f} +- {g['se']:.4f}, p = {g['p']:.3f} -> "
           f"**{'lags' if g['lags'] else 'not shown to lag'}**"))
    p = res["predictor"]
    lines.append("- predictor of the difference: " + ("not computed (< 3 runs)" if p is None else
                 f"Spearman rho, minus tail failures {p['rho_tail']:+.2f} vs mean alpha "
                 f"{p['rho_mean']:+.2f} over {p['runs']} runs -> "
                 f"**{'the tail' if p['tail_better'] else 'not the tail'}** predicts better "
                 f"(weak with {p['runs']} runs)"))
    lines += ["", "| arm | whole-model KV read | rollout seconds (summed) | mean alpha | "
              "tail failures |", "|---|---|---|---|---|"]
    for arm, a in res["arms"].items():
        lines.append(f"| {arm} | {a.get('kv_read', math.nan):.3f} | "
                     f"{a.get('rollout_s', math.nan):.1f} | {a.get('mean_alpha', math.nan):.4f} | "
                     f"{a.get('tail_failures', math.nan):.1f} |")
    return "\n".join(lines) + "\n"
