"""The trainer's side of the schedule controller: per-unit exceedance counts from the learner's
alpha, the probe replay's budgets, and the per-step control metrics (host-side).

One RL step: rollout at the schedule -> (probe: the learner replays the same batch at
``ScheduleController.replay_budgets()``, one rung lower for the bins being considered) ->
learner (alpha at the live budgets) -> ``counts`` for both -> ``ScheduleController.update``
-> ``step_metrics``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparrow_jax.runtime import multihost
from sparrow_jax.sparsity.controller import EvidenceUnit, ScheduleController
from sparrow_jax.sparsity.evidence import exceedance_counts, group_units
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

__all__ = ["counts", "step_metrics", "kv_read", "run_kv_read", "budget_label",
           "schedule_line", "budget_metrics"]


def _host(x) -> np.ndarray:
    """Every process's rows of a (possibly multi-process) batch array, on the host."""
    return np.asarray(multihost.all_rows(multihost.local_rows(x)))


def counts(ctrl: ScheduleController, alpha, traj, group_size: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """alpha [B, T] of a batch -> (hits, tokens) ``[units, num_bins]``: tokens with alpha below
    the controller's target per row (or per prompt: ``ControllerConfig.unit``) and bin."""
    sched = ctrl.schedule
    hits, tokens = exceedance_counts(_host(alpha), _host(traj.cached_lengths), _host(traj.mask),
                                     target=ctrl.config.target, bin_size=sched.bin_size,
                                     num_bins=sched.num_bins)
    if ctrl.config.unit == EvidenceUnit.PROMPT:
        hits, tokens = group_units(hits, tokens, group_size)
    return hits, tokens


def kv_read(budgets, cached_lengths, mask, *, num_layers: int, num_sparse_layers: int,
            bin_size: int, num_bins: int) -> dict[str, float]:
    """Whole-model KV read of one batch's decode steps, overall and per length bin.

    Each generated token reads, per layer, ``min(budget, length)`` cached entries in a sparse
    layer and ``length`` in a dense one (length = cached tokens incl. the fed one; a recorded
    budget of 0 = dense), so the model reads
    ``(num_dense * length + num_sparse * min(budget, length)) / (num_layers * length)`` of its
    KV. budgets/cached_lengths/mask ``[B, T]``.

    Returns:
      ``kv/read_model`` (the whole model's share), ``kv/read_sparse_layers`` (the sparse
      layers' share alone: sum of min(budget, length) / sum of length, which the trainer also
      logs as ``schedule/kv_fraction`` for sparse rollout), ``kv/model_read_tokens`` and ``kv/model_total_tokens`` (numerator
      and denominator in layer-token units, summed so a run's share pools over steps) and
      ``kv/read_bin_XX`` per bin with tokens (the bin of a token = min(length // bin_size,
      num_bins - 1), as the controller's).
    """
    if not 0 <= num_sparse_layers <= num_layers or num_layers < 1:
        raise ValueError(f"num_sparse_layers = {num_sparse_layers} must be in [0, num_layers = "
                         f"{num_layers}] and num_layers >= 1")
    cached = _host(cached_lengths).astype(np.int64)
    length = cached.astype(np.float64) + 1
    budget = _host(budgets).astype(np.float64)
    mask = _host(mask).astype(bool)
    sparse_read = np.where(budget > 0, np.minimum(budget, length), length)
    dense = num_layers - num_sparse_layers
    read = (dense * length + num_sparse_layers * sparse_read)[mask]
    total = (num_layers * length)[mask]
    nan = float("nan")
    out = {"kv/model_read_tokens": float(read.sum()), "kv/model_total_tokens": float(total.sum()),
           "kv/read_model": float(read.sum() / total.sum()) if total.size else nan,
           "kv/read_sparse_layers": (float(sparse_read[mask].sum() / length[mask].sum())
                                     if total.size else nan)}
    bins = np.clip(cached[mask] // bin_size, 0, num_bins - 1)
    for b in np.unique(bins):
        sel = bins == b
        out[f"kv/read_bin_{int(b):02d}"] = float(read[sel].sum() / total[sel].sum())
    return out


def run_kv_read(records) -> float:
    """The whole model's KV read over a run: pooled ``kv/model_read_tokens`` /
    ``kv/model_total_tokens`` of its metric records (the last record per step counts, as the
    metrics readers keep it); NaN when no step recorded them."""
    last = {}
    for r in records:
        if r.get("kv/model_total_tokens") is not None and "step" in r:
            last[int(r["step"])] = r
    read = sum(float(r["kv/model_read_tokens"]) for r in last.values())
    total = sum(float(r["kv/model_total_tokens"]) for r in last.values())
    return read / total if total > 0 else float("nan")


def budget_label(budget: int, bin_index: int, schedule: Schedule) -> str:
    """A bin's budget for people: ``dense`` for the dense rung or any budget at or above the
    bin's upper edge (dense attention for its tokens), else the number of tokens."""
    edge = (bin_index + 1) * schedule.bin_size
    last = bin_index == schedule.num_bins - 1
    if budget >= DENSE_BUDGET or (not last and budget >= edge):
        return "dense"
    return str(int(budget))


def schedule_line(schedule: Schedule) -> str:
    """``[dense, dense, 256, ...]``: the schedule's budgets labelled by ``budget_label``."""
    return "[" + ", ".join(budget_label(b, i, schedule)
                           for i, b in enumerate(schedule.budgets)) + "]"


def budget_metrics(schedule: Schedule) -> dict[str, float]:
    """``budget/bin_XX``: each bin's budget capped at the bin's upper edge (a budget at or
    above it - e.g. the dense rung - is dense attention for the bin's tokens)."""
    out = {}
    for b, budget in enumerate(schedule.budgets):
        edge = (b + 1) * schedule.bin_size
        out[f"budget/bin_{b:02d}"] = float(min(budget, edge))
    return out


def step_metrics(info: dict[str, Any], quantile: float) -> dict[str, float]:
    """The controller's per-step record: ``schedule/bins_dense`` (bins at the dense rung),
    ``bins_failing_dense`` (failing even at dense: the sparse bins before it are the cause -
    they are raised, ``bins_raised_upstream`` - or, with none left, the rollout's numerical
    noise floor is above the target), ``bins_below_target`` (the live
    budget fails by the upper bound), ``saturated`` (= bins_failing_dense: nowhere higher to
    go), ``bins_undecided`` (not enough pooled evidence), raised/lowered/probe_failed and
    ``ub_ratio_max`` (the largest decided bound / q; <= 1 = every decided bin passes)."""
    ub = np.asarray(info["upper_bound"], np.float64)
    decided = ~np.asarray(info["undecided"]) & np.isfinite(ub)
    out = {
        "schedule/num_changed": float(info["num_changed"]),
        "schedule/bins_dense": float(np.sum(info["at_dense"])),
        "schedule/bins_failing_dense": float(np.sum(info["failing_dense"])),
        "schedule/saturated": float(np.sum(info["failing_dense"])),
        "schedule/bins_below_target": float(np.sum(info["failing"])),
        "schedule/bins_undecided": float(np.sum(info["undecided"])),
        "schedule/bins_raised": float(np.sum(info["raised"])),
        "schedule/bins_lowered": float(np.sum(info["lowered"])),
        "schedule/probe_failed": float(np.sum(info["probe_failed"])),
        "schedule/bins_replay_failing": float(np.sum(info["replay_failing"])),
        "schedule/bins_raised_upstream": float(np.sum(info["raised_upstream"])),
        "schedule/ub_ratio_max": float(ub[decided].max() / quantile) if decided.any() else 0.0,
    }
    return out
