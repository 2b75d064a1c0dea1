"""Pure parts of offline calibration: pick a schedule from a budget x bin tail table, and plot it.

The calibration driver (someone else's CLI) decodes prompts at each candidate budget, measures
alpha per token against the dense policy, and fills ``tails[i, j]`` = the per-bin tail
(``mismatch.tail_by_bin``) of bin ``j`` at budget ``budgets[i]`` (NaN where a bin had no
tokens). This module turns that table into a ``Schedule`` and a heatmap PNG.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from sparrow_jax.sparsity.controller import ControllerConfig, certifies
from sparrow_jax.sparsity.evidence import Evidence, lower_bound
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

__all__ = ["pick_schedule", "certify_schedule", "write_heatmap"]


def pick_schedule(
    tails: Any,
    budgets: Sequence[int],
    target: float = 0.86,
    fallback: str = "max",
    *,
    bin_size: int = 2000,
    block_size: int = 16,
    monotone: bool = True,
    name: str = "calibrated",
) -> tuple[Schedule, dict[str, Any]]:
    """Per bin, the cheapest budget whose tail meets ``target``.

    Tails need not be monotone in the budget (they are noisy estimates), so the rule is
    "cheapest budget meeting the target", not a bisection.

    Args:
      tails: ``[num_budgets, num_bins]`` tail alpha; NaN = no data.
      budgets: ``[num_budgets]`` tokens (any order; multiples of ``block_size``).
      target: required tail alpha.
      fallback: for a bin with data where no budget meets the target: ``"max"`` takes the
        largest budget, ``"dense"`` takes ``DENSE_BUDGET``; the bin is flagged either way.
      monotone: make budgets non-decreasing over bins (cumulative max), as the published
        tables are; raising a budget never hurts the tail.
    Returns:
      (schedule, info) with info ``unmet_bins`` (bins where nothing met the target),
      ``no_data_bins`` (inherited from the previous bin; leading ones from the first bin with
      data), ``ok`` (no unmet bins) and ``picked`` (per-bin choice before monotone/filling).
    """
    tails = np.asarray(tails, np.float64)
    budgets_arr = np.asarray(budgets, np.int64).reshape(-1)
    if tails.ndim != 2 or tails.shape[0] != budgets_arr.size:
        raise ValueError(
            f"tails must be [num_budgets={budgets_arr.size}, num_bins], got {tails.shape}"
        )
    if fallback not in ("max", "dense"):
        raise ValueError(f"fallback must be 'max' or 'dense', got {fallback!r}")
    order = np.argsort(budgets_arr, kind="stable")
    budgets_arr, tails = budgets_arr[order], tails[order]
    has_data = np.isfinite(tails).any(axis=0)
    if not has_data.any():
        raise ValueError("tail table holds no data (all NaN)")
    fallback_budget = int(budgets_arr[-1]) if fallback == "max" else DENSE_BUDGET
    # NaN >= target is False, so a missing cell never "meets" the target.
    meets = np.nan_to_num(tails, nan=-np.inf) >= target
    picked = np.full(tails.shape[1], -1, np.int64)
    unmet = []
    for j in np.flatnonzero(has_data):
        rows = np.flatnonzero(meets[:, j])
        if rows.size:
            picked[j] = budgets_arr[rows[0]]  # sorted ascending: first = cheapest
        else:
            picked[j] = fallback_budget
            unmet.append(int(j))
    chosen = picked.copy()
    first = int(np.flatnonzero(has_data)[0])
    chosen[:first] = chosen[first]
    for j in range(first + 1, chosen.size):
        if chosen[j] < 0:
            chosen[j] = chosen[j - 1]
    if monotone:
        chosen = np.maximum.accumulate(chosen)
    schedule = Schedule(tuple(int(b) for b in chosen), bin_size, block_size, name)
    info = {"unmet_bins": unmet, "no_data_bins": [int(j) for j in np.flatnonzero(~has_data)],
            "ok": not unmet, "picked": picked, "target": target}
    return schedule, info


def certify_schedule(hits: Any, tokens: Any, budgets: Sequence[int], config: ControllerConfig,
                     *, bin_size: int, block_size: int = 16, name: str = "certified"
                     ) -> tuple[Schedule, dict[str, Any]]:
    """Per bin, the cheapest budget that the controller's own lowering rule certifies.

    The rule is ``controller.certifies`` - the one a probe replay must pass to lower a bin: the
    same q, rows (units) as the statistical unit, the same one-sided bound, ``min_rows`` and the
    tokens needed to certify; a bin no budget certifies starts at the dense rung. A controller
    started from this table (``make_schedule.path``) then holds or raises it, and lowers only by
    the same rule.

    Args:
      hits, tokens: ``[num_budgets, units, num_bins]`` per-unit exceedances (alpha < target) and
        tokens at each budget (``evidence.exceedance_counts``; units = rows unless grouped).
      budgets: ``[num_budgets]`` the budget of each sweep (every bin at that budget).
      config: the controller's settings (target, quantile, confidence, min_rows, min_tokens,
        lower_margin: those of the training run that starts from the table).
    Returns:
      (schedule, info): info ``upper_bound`` and ``lower_bound`` ``[num_budgets, num_bins]``
      (NaN = no tokens), ``certified`` (bool, same shape), ``dense_bins`` (bins no budget
      certifies), ``one_rung_lower`` (a Schedule one grid budget below the certified one per
      bin) with ``one_rung_lower_failing_bins`` (bins where that budget is shown failing: lower
      bound > q) and the rule's ``quantile``, ``margin`` and ``confidence``.
    """
    hits, tokens = np.asarray(hits), np.asarray(tokens)
    budgets_arr = np.asarray(budgets, np.int64).reshape(-1)
    if hits.ndim != 3 or hits.shape != tokens.shape or hits.shape[0] != budgets_arr.size:
        raise ValueError(f"hits {hits.shape} / tokens {tokens.shape} must both be [num_budgets="
                         f"{budgets_arr.size}, units, num_bins]")
    order = np.argsort(budgets_arr, kind="stable")
    ubs, oks = [], []
    for i in order:
        ub, ok = certifies(Evidence.from_counts(hits[i], tokens[i]), config)
        ubs.append(ub)
        oks.append(ok)
    ub, ok = np.stack(ubs), np.stack(oks)
    lb = np.stack([lower_bound(Evidence.from_counts(hits[i], tokens[i]), config.confidence)
                   for i in order])
    sorted_b = budgets_arr[order]
    chosen, lower, lower_fails = [], [], []
    for j in range(hits.shape[2]):
        rows = np.flatnonzero(ok[:, j])
        chosen.append(int(sorted_b[rows[0]]) if rows.size else DENSE_BUDGET)
        # One grid budget cheaper than the certified one (the largest when none is certified):
        # the "M" arm of the pre-registered experiment, a table just below what passes.
        k = (rows[0] if rows.size else sorted_b.size) - 1
        lower.append(int(sorted_b[max(k, 0)]))
        lower_fails.append(bool(k >= 0 and lb[k, j] > config.quantile))
    schedule = Schedule(tuple(chosen), bin_size, block_size, name)
    back = np.argsort(order, kind="stable")      # report rows in the caller's budget order
    info = {"upper_bound": ub[back], "lower_bound": lb[back], "certified": ok[back],
            "one_rung_lower": Schedule(tuple(lower), bin_size, block_size, f"{name}-1"),
            "one_rung_lower_failing_bins": [j for j, f in enumerate(lower_fails) if f],
            "dense_bins": [j for j, b in enumerate(chosen) if b >= DENSE_BUDGET],
            "quantile": config.quantile, "margin": config.lower_margin,
            "confidence": config.confidence}
    return schedule, info


def _tokens_label(n: int) -> str:
    """2000 -> '2k', 256 -> '256', 1536 -> '1.5k' (bins smaller than 1000 tokens stay readable)."""
    return f"{n / 1000:g}k" if n >= 1000 else str(n)


def write_heatmap(
    path_png: str | os.PathLike,
    tails: Any,
    budgets: Sequence[int],
    schedule: Schedule | None,
    bin_size: int = 2000,
    *,
    target: float = 0.86,
    title: str = "",
) -> str:
    """Heatmap of tail alpha (rows = budgets, columns = bins) with the schedule drawn on it.

    Cells meeting ``target`` are outlined by a contour at ``target``; NaN cells are grey; the
    schedule is a white step line through the chosen budget of each bin. Uses the Agg canvas
    directly (no pyplot), so it works headless and leaves global matplotlib state alone.

    Returns:
      the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    import matplotlib as mpl

    tails = np.asarray(tails, np.float64)
    budgets_arr = np.asarray(budgets, np.int64).reshape(-1)
    order = np.argsort(budgets_arr, kind="stable")
    budgets_arr, tails = budgets_arr[order], tails[order]
    num_budgets, num_bins = tails.shape

    fig = Figure(figsize=(max(6.0, 0.45 * num_bins + 2), max(4.0, 0.3 * num_budgets + 1.5)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = mpl.colormaps["viridis"].with_extremes(bad="#bbbbbb")
    finite = tails[np.isfinite(tails)]
    # Colour range focused around the target: everything below 0.5 is simply "far off".
    vmin = max(0.5, float(min(finite.min(), target - 0.05))) if finite.size else 0.5
    img = ax.imshow(np.ma.masked_invalid(tails), origin="lower", aspect="auto", cmap=cmap,
                    vmin=vmin, vmax=1.0, interpolation="nearest")
    fig.colorbar(img, ax=ax, label="tail alpha (per-bin quantile)")
    if finite.size and np.nanmin(tails) < target <= np.nanmax(tails):
        # Masked (NaN) cells are left out of the contour instead of faking a boundary there.
        ax.contour(np.arange(num_bins), np.arange(num_budgets), np.ma.masked_invalid(tails),
                   levels=[target], colors="red", linewidths=1.2)
    for i in range(num_budgets):  # value labels: the table is small (~18 x 20)
        for j in range(num_bins):
            if np.isfinite(tails[i, j]):
                ax.text(j, i, f"{tails[i, j]:.2f}", ha="center", va="center", fontsize=5,
                        color="white" if tails[i, j] < (vmin + 1.0) / 2 else "black")
    if schedule is not None:
        # Fractional row position so budgets between grid rows are drawn where they belong.
        rows = np.interp(np.asarray(schedule.budgets[:num_bins], np.float64), budgets_arr,
                         np.arange(num_budgets))
        ax.step(np.arange(rows.size), rows, where="mid", color="white", linewidth=2.0)
        ax.plot(np.arange(rows.size), rows, "o", color="white", markersize=3)
    ax.set_xticks(np.arange(num_bins))
    ax.set_xticklabels([_tokens_label(j * bin_size) + ("+" if j == num_bins - 1 else "")
                        for j in range(num_bins)], fontsize=6, rotation=90)
    ax.set_yticks(np.arange(num_budgets))
    ax.set_yticklabels([str(b) for b in budgets_arr], fontsize=6)
    ax.set_xlabel("total cached length bin")
    ax.set_ylabel("KV budget (tokens)")
    sched_label = f", white: schedule {schedule.name}" if schedule is not None else ""
    ax.set_title(title or f"tail alpha per bin and budget (red: target {target}{sched_label})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path_png), dpi=120)
    return os.fspath(path_png)
