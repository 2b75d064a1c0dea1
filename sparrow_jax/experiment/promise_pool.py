"""The results file of `sparrow promise`: every run of one registered config, pooled.

One JSON line per run (`Report.pool_record`): the config's identity (`config_sha`: its gin
files' text and overrides), the run's registered seed, the held-out metric at the start and per
arm after the registered steps, and the run's speeds. Runs of the same config pool: per arm, the
differences to the reference arm over the runs' seeds give the registered TOST
(`prereg.tost`), its pooled estimate and interval, and where that stands against the registered
power analysis (`prereg.power_summary`): how many seeds - one per run - are still needed.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sparrow_jax.experiment.prereg import PreregConfig, power_summary, tost

__all__ = ["results_path", "read", "append", "next_seed", "pooled"]


def results_path(out: Path, name: str, committed: Path) -> Path:
    """`out/name`, started from the committed copy (`committed/name`) when `out` has none:
    a run written elsewhere (a lent host's output folder) pools with the runs committed so far,
    and its file replaces the committed one when brought back."""
    path = out / name
    seed = committed / name
    if not path.exists() and seed.is_file() and seed.resolve() != path.resolve():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(seed, path)
    return path


def read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append(path: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Adds one run's record; returns every record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return read(path)


def next_seed(records: Sequence[dict[str, Any]], sha: str, seeds: Sequence[int]
              ) -> tuple[int, bool]:
    """The first registered seed no run of config `sha` used yet, and True; once all are used,
    a seed past them and False (a run beyond the registered count: measured, not pooled into the
    registered test)."""
    used = {int(r["seed"]) for r in records if r.get("config_sha") == sha}
    for s in seeds:
        if s not in used:
            return int(s), True
    return max([*seeds, *used]) + 1, False


def pooled(records: Sequence[dict[str, Any]], sha: str, pre: PreregConfig, arms: Sequence[str],
           *, seeds_registered: int) -> dict[str, Any]:
    """Every registered run of config `sha` pooled: per arm but the reference, the per-seed
    differences of the metric to the reference arm, their TOST at the registered margin (>= 2
    seeds), the power analysis (seeds needed at the registered and at the observed s.d.), and
    the runs' mean speed-ups and KV reads."""
    runs = [r for r in records if r.get("config_sha") == sha and r.get("registered", True)]
    out: dict[str, Any] = {"runs": len(runs), "seeds_registered": seeds_registered,
                           "metric": pre.metric, "margin": pre.margin, "alpha": pre.alpha,
                           "arms": {}}
    for arm in arms:
        if arm == pre.reference:
            continue
        diffs = {int(r["seed"]): r["values"][arm] - r["values"][pre.reference] for r in runs
                 if _finite(r["values"].get(arm)) and _finite(r["values"].get(pre.reference))}
        d = list(diffs.values())
        entry: dict[str, Any] = {"seeds": len(d), "diffs": diffs,
                                 "tost": tost(d, pre.margin, pre.alpha) if len(d) >= 2 else None,
                                 "power": power_summary(d, pre)}
        for key in ("speedup_step", "speedup_rollout", "kv_read"):
            vals = [r[key][arm] for r in runs if _finite((r.get(key) or {}).get(arm))]
            entry[key] = float(np.mean(vals)) if vals else math.nan
        out["arms"][arm] = entry
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
