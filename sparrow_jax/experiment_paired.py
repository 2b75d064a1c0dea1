"""Paired comparison of experiment arms across seeds (host-side, pure).

Arms named ``<arm>@<seed>`` (e.g. ``dense@0``, ``controller@0``) share the seed's data order and
sampling keys (``TrainConfig.seed``), so each seed's difference ``arm - reference`` (reference =
``dense``) removes the between-seed luck that dominated the single-run demo experiment. Per arm:
the per-seed differences of a held-out metric at the last evaluation, their mean with a 95%
t-interval over seeds, and the share of the KV cache the arm's rollouts read
(``schedule/kv_fraction``: sum of min(budget, length) / sum of length; 1 for dense rollout).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

__all__ = ["split_arm", "last_value", "paired_differences", "paired_markdown",
           "write_paired_report"]

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (df > 30: 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def split_arm(name: str) -> tuple[str, str | None]:
    """``"controller@1"`` -> ("controller", "1"); a name without ``@`` has no seed."""
    arm, sep, seed = name.partition("@")
    return (arm, seed) if sep else (name, None)


def last_value(rows: Sequence[Mapping[str, float]], key: str) -> float:
    """The metric's value at the last step that logged it (NaN if none)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(vals[-1]) if vals else math.nan


def first_value(rows: Sequence[Mapping[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(vals[0]) if vals else math.nan


def mean_value(rows: Sequence[Mapping[str, float]], key: str, default: float = math.nan) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else default


def paired_differences(values: Mapping[str, Mapping[str, float]], reference: str = "dense"
                       ) -> dict[str, dict[str, float | dict[str, float]]]:
    """values[arm][seed] -> per arm != reference: {"diffs": {seed: arm - reference}, "n",
    "mean", "ci_low", "ci_high"} over the seeds both have (95% t-interval; NaN for n < 2)."""
    ref = values.get(reference, {})
    out = {}
    for arm, by_seed in values.items():
        if arm == reference:
            continue
        diffs = {s: by_seed[s] - ref[s] for s in by_seed
                 if s in ref and np.isfinite(by_seed[s]) and np.isfinite(ref[s])}
        d = np.asarray(list(diffs.values()), np.float64)
        n = d.size
        mean = float(d.mean()) if n else math.nan
        if n >= 2:
            half = _T975[min(n - 1, 30) - 1] * d.std(ddof=1) / math.sqrt(n) if n - 1 <= 30 else (
                1.96 * d.std(ddof=1) / math.sqrt(n))
        else:
            half = math.nan
        out[arm] = {"diffs": diffs, "n": n, "mean": mean, "ci_low": mean - half,
                    "ci_high": mean + half}
    return out


def paired_markdown(results: Mapping[str, Sequence[Mapping[str, float]]], *,
                    metric: str = "eval_dense/ref_p_exact", reference: str = "dense") -> str:
    """The paired table of `results` (arm@seed -> metrics.jsonl rows)."""
    values: dict[str, dict[str, float]] = {}
    start: dict[str, dict[str, float]] = {}
    kv: dict[str, list[float]] = {}
    for name, rows in results.items():
        arm, seed = split_arm(name)
        if seed is None:
            continue
        values.setdefault(arm, {})[seed] = last_value(rows, metric)
        start.setdefault(arm, {})[seed] = first_value(rows, metric)
        kv.setdefault(arm, []).append(mean_value(rows, "schedule/kv_fraction", 1.0))
    diffs = paired_differences(values, reference)
    lines = [f"# Paired comparison: `{metric}` at the last evaluation, minus `{reference}` of "
             "the same seed", "",
             "| arm | seeds | first -> last (mean over seeds) | per-seed difference to "
             f"{reference} | mean difference [95% CI] | KV fraction read |",
             "|---|---|---|---|---|---|"]
    for arm in values:
        v = np.asarray(list(values[arm].values()))
        s0 = np.asarray(list(start[arm].values()))
        kvf = float(np.mean(kv[arm]))
        if arm == reference:
            lines.append(f"| {arm} | {len(v)} | {np.nanmean(s0):.4f} -> {np.nanmean(v):.4f} | "
                         f"(reference) | | {kvf:.3f} |")
            continue
        d = diffs[arm]
        per = ", ".join(f"{s}: {x:+.4f}" for s, x in d["diffs"].items())
        ci = (f"{d['mean']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]"
              if d["n"] >= 2 else (f"{d['mean']:+.4f}" if d["n"] else ""))
        lines.append(f"| {arm} | {len(v)} | {np.nanmean(s0):.4f} -> {np.nanmean(v):.4f} | "
                     f"{per} | {ci} | {kvf:.3f} |")
    return "\n".join(lines) + "\n"


def write_paired_report(output_dir: Path, results: Mapping[str, Sequence[Mapping[str, float]]],
                        *, metric: str = "eval_dense/ref_p_exact", reference: str = "dense",
                        stem: str = "paired") -> Path | None:
    """``<stem>.md`` when some arm is named ``arm@seed``; None otherwise."""
    if not any(split_arm(n)[1] is not None for n in results):
        return None
    path = Path(output_dir) / f"{stem}.md"
    path.write_text(paired_markdown(results, metric=metric, reference=reference))
    return path
