"""Paired comparison of experiment arms across seeds (host-side, pure).

Arms named ``<arm>@<seed>`` (e.g. ``dense@0``, ``controller@0``) share the seed's data order and
sampling keys (``TrainConfig.seed``), so each seed's difference ``arm - reference`` (reference =
``dense``) is paired. Per arm: the per-seed differences of a held-out metric at the last
evaluation, their mean with a 95% t-interval over seeds, and the share of the KV cache the
arm's rollouts read: over the whole
model, dense layers included (`whole_model_kv`), and in brackets over the sparse layers
(``schedule/kv_fraction``: sum of min(budget, length) / sum of length; 1 for dense rollout).
With both runs' ``eval_reference.jsonl`` (sparrow_jax.evaluation.reference), each seed's difference
also gets its standard error over prompts (per-prompt exact probabilities, paired by prompt id).
Per arm also: mean alpha, the smallest per-bin tail and the share of steps with a bin below the
controller's target, over each run's steps after the controller's first five.

What the interval over seeds is *not*: the variance of training runs. Shared sampling keys make
the two runs of a pair draw the same tokens wherever the arm samples what dense would (a
controller at the dense rung, a sparse actor close to dense), so their difference is small by
construction while they stay coupled. The interval is the spread of the difference *under
shared randomness*; independent runs of the same distribution differ far more (exact sparse vs
dense, identical in distribution: -0.050 and +0.045 in two seeds, docs/experiment.md). The
report says so under its table (``SHARED_KEYS_NOTE``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

__all__ = ["split_arm", "last_value", "start_value", "late_mean", "reference_scores",
           "prompt_se", "paired_differences", "paired_markdown", "write_paired_report",
           "SHARED_KEYS_NOTE"]

# Steps >= FROM_STEP: after the controller's first five steps (its start from the dense rung).
FROM_STEP = 6

# Under every paired table: what its interval over seeds carries, and what it does not.
SHARED_KEYS_NOTE = (
    "The 95% CI is a t-interval over seeds of the paired differences. It does not carry the "
    "variance of training runs: the runs of a pair share the data order and the sampling keys, "
    "so where the arm samples what dense would (a controller at the dense rung, a sparse actor "
    "close to dense) they draw the same tokens and their difference is small by construction. "
    "It is the spread of the difference under shared randomness; independent runs of the same "
    "distribution differ far more (exact sparse vs dense: -0.050 and +0.045 in two seeds, "
    "docs/experiment.md).")

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


def start_value(rows: Sequence[Mapping[str, float]], key: str) -> float:
    """The metric at step 0 (the starting point); NaN when the run logged none there
    (TrainConfig.eval_at_start = False)."""
    vals = [r[key] for r in rows if r.get(key) is not None and int(r["step"]) == 0]
    return float(vals[0]) if vals else math.nan


def late_mean(rows: Sequence[Mapping[str, float]], key: str, from_step: int = FROM_STEP, *,
              positive: bool = False) -> float:
    """Mean of the metric over steps >= from_step (with positive: the share of those steps where
    it is > 0); NaN when the run does not log it there."""
    vals = [float(r[key]) for r in rows if r.get(key) is not None and int(r["step"]) >= from_step
            and math.isfinite(float(r[key]))]
    if not vals:
        return math.nan
    return float(np.mean(np.asarray(vals) > 0)) if positive else float(np.mean(vals))


def reference_scores(lines: Sequence[str], mode: str = "dense") -> dict[str, float]:
    """eval_reference.jsonl lines (one JSON object per evaluation: step, mode, ids, logp) ->
    {prompt id: exact probability exp(logp)} of the last evaluation in `mode` ({} if none)."""
    last = None
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:      # a torn last line
            continue
        if row.get("mode") == mode and (last is None or row["step"] >= last["step"]):
            last = row
    if last is None:
        return {}
    return {str(i): math.exp(lp) for i, lp in zip(last["ids"], last["logp"])}


def prompt_se(arm: Mapping[str, float], ref: Mapping[str, float]) -> float:
    """Standard error over prompts of the mean per-prompt difference arm - ref (prompts both
    scored; NaN for fewer than two)."""
    d = np.asarray([arm[i] - ref[i] for i in arm if i in ref], np.float64)
    return float(d.std(ddof=1) / math.sqrt(d.size)) if d.size >= 2 else math.nan


def whole_model_kv(rows: Sequence[Mapping[str, float]]) -> float:
    """The run's mean whole-model KV read per step, dense layers included: an exact-sparse run's
    `exact/kv_read_model` (drafts + verify), else `kv/read_model`; NaN when neither is logged."""
    vals = [r.get("exact/kv_read_model", r.get("kv/read_model")) for r in rows]
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else math.nan


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
                    metric: str = "eval_dense/ref_p_exact", reference: str = "dense",
                    prompt_scores: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """The paired table of `results` (arm@seed -> metrics.jsonl rows). prompt_scores: arm@seed ->
    {prompt id: per-prompt value of `metric` at the last evaluation} (`reference_scores`), for
    each seed's standard error over prompts."""
    prompt_scores = prompt_scores or {}
    # Every arm starts from the same checkpoint: a run without a step-0 evaluation starts where
    # the first run that has one does.
    shared_from, shared = None, math.nan
    for name, rows in results.items():
        if np.isfinite(start_value(rows, metric)):
            shared_from, shared = name, start_value(rows, metric)
            break
    values: dict[str, dict[str, float]] = {}
    start: dict[str, dict[str, float]] = {}
    per_run: dict[str, dict[str, list[float]]] = {}
    borrowed: set[str] = set()
    late = (("alpha", "alpha/alpha_mean", False), ("tail", "alpha/tail_min", False),
            ("below", "schedule/bins_below_target", True))
    for name, rows in results.items():
        arm, seed = split_arm(name)
        if seed is None:
            continue
        values.setdefault(arm, {})[seed] = last_value(rows, metric)
        s0 = start_value(rows, metric)
        if not np.isfinite(s0) and np.isfinite(shared):
            s0 = shared
            borrowed.add(arm)
        start.setdefault(arm, {})[seed] = s0
        runs = per_run.setdefault(arm, {c: [] for c in ("kv", "kv_model", "alpha", "tail",
                                                        "below")})
        # An exact-sparse run's drafts and verify have no sparse-layer fraction of their own.
        exact = any("exact/kv_read_model" in r for r in rows)
        runs["kv"].append(math.nan if exact else mean_value(rows, "schedule/kv_fraction", 1.0))
        runs["kv_model"].append(whole_model_kv(rows))
        for col, key, positive in late:
            runs[col].append(late_mean(rows, key, positive=positive))
    diffs = paired_differences(values, reference)
    lines = [f"# Paired comparison: `{metric}` at the last evaluation, minus `{reference}` of "
             "the same seed", "",
             "| arm | seeds | first -> last (mean over seeds) | per-seed difference to "
             f"{reference} (+- s.e. over prompts) | mean difference [95% CI] | KV read: whole model "
             "(sparse layers) "
             "| mean alpha | min per-bin tail | steps with a bin below target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in values:
        v = np.asarray(list(values[arm].values()))
        s0 = np.asarray(list(start[arm].values()))
        first = f"{np.nanmean(s0):.4f}{'*' if arm in borrowed else ''} -> {np.nanmean(v):.4f}"
        whole = float(np.mean(per_run[arm]["kv_model"]))
        sparse = float(np.mean(per_run[arm]["kv"]))
        kvf = " ".join(["-" if math.isnan(whole) else f"{whole:.3f}",
                        "(-)" if math.isnan(sparse) else f"({sparse:.3f})"])
        extra = " | ".join(_mean_cell(per_run[arm][c], spec) for c, spec in (
            ("alpha", ".4f"), ("tail", ".3f"), ("below", ".0%")))
        if arm == reference:
            lines.append(f"| {arm} | {len(v)} | {first} | (reference) | | {kvf} | {extra} |")
            continue
        d = diffs[arm]
        per = ", ".join(f"{s}: {x:+.4f}" + _se_text(prompt_scores.get(f"{arm}@{s}"),
                                                    prompt_scores.get(f"{reference}@{s}"))
                        for s, x in d["diffs"].items())
        ci = (f"{d['mean']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]"
              if d["n"] >= 2 else (f"{d['mean']:+.4f}" if d["n"] else ""))
        lines.append(f"| {arm} | {len(v)} | {first} | {per} | {ci} | {kvf} | {extra} |")
    lines.append("")
    if borrowed:
        lines += ["\\* no step-0 evaluation in these runs (`TrainConfig.eval_at_start = False`): "
                  f"the start shown is `{shared_from}`'s - every arm starts from the same "
                  "checkpoint, so it is the shared start.", ""]
    lines += [SHARED_KEYS_NOTE + " The +- beside a seed's difference is the standard error "
              "over prompts of that seed's paired per-prompt differences at the last evaluation "
              "(`eval_reference.jsonl`): the prompt sampling only, not the training-run "
              "variance. Mean alpha, min per-bin tail and the share of steps with a bin below "
              "the controller's target (`schedule/bins_below_target` > 0; blank where an arm "
              f"does not log it) are means over seeds of each run's steps >= {FROM_STEP} (after "
              f"the controller's first {FROM_STEP - 1})."]
    return "\n".join(lines) + "\n"


def _mean_cell(vals: Sequence[float], spec: str) -> str:
    finite = [x for x in vals if np.isfinite(x)]
    return format(float(np.mean(finite)), spec) if finite else ""


def _se_text(arm: Mapping[str, float] | None, ref: Mapping[str, float] | None) -> str:
    se = prompt_se(arm, ref) if arm and ref else math.nan
    return f" (+- {se:.4f})" if np.isfinite(se) else ""


def write_paired_report(output_dir: Path, results: Mapping[str, Sequence[Mapping[str, float]]],
                        *, metric: str = "eval_dense/ref_p_exact", reference: str = "dense",
                        stem: str = "paired") -> Path | None:
    """``<stem>.md`` when some arm is named ``arm@seed``; None otherwise. For a reference metric
    (``eval_<mode>/ref_p_exact``), per-prompt values come from each run's eval_reference.jsonl."""
    if not any(split_arm(n)[1] is not None for n in results):
        return None
    scores = {}
    match = re.fullmatch(r"eval_(\w+)/ref_p_exact", metric)
    for name in results:
        path = Path(output_dir) / name / "eval_reference.jsonl"
        if match and path.is_file():
            scores[name] = reference_scores(path.read_text().splitlines(), match.group(1))
    path = Path(output_dir) / f"{stem}.md"
    path.write_text(paired_markdown(results, metric=metric, reference=reference,
                                    prompt_scores=scores))
    return path
