"""The cost of an exact_sparse round measured in a run, and the per-bin gamma re-fit on it.

An exact_sparse decode program runs, each round, one of its round branches (a gamma of
`RolloutConfig.round_gammas`, or unverified drafts; `RolloutConfig.round_branches`) for the
whole batch, and counts how many rounds of each it ran (`Trajectories.round_counts`). A rollout
call of n_ir rounds of branch r takes t_i seconds; `fit_round_costs` fits

    t_i = t_0 + sum_r n_ir c_r      (c_r >= 0: seconds of one round of branch r; t_0 the call's
                                     prefill and readbacks)

by non-negative least squares over the calls it is given. The fit is *determined* when every
branch ran in some call and the columns [1, n_r] are independent (calls that ran different
mixes of rounds); otherwise - a branch never ran, every call ran the same mix, a branch fitted
at 0 s - the costs are `modelled` ratios (`exact_cost.modelled_costs`: eFLOPs at the run's
context) scaled to the calls by one factor (t_i = t_0 + s sum_r n_ir m_r), and unscaled when
no call was timed; `RoundCosts.measured` says which, and the re-plan's log line says it.

`replan_table` then picks per bin, among the compiled gammas, the most expected tokens per
second of round: `exact_cost.choose_per_bin` with one budget row (the schedule's, fixed: alpha
is measured at it), the bin's measured alpha, no separate draft cost and the round's cost as the
verify's (a round of gamma g costs c_g whatever its parts), dense (gamma 0) priced at the
gamma-0 round when 0 is compiled and never chosen otherwise. A round's cost is the batch's,
averaged over the contexts it ran at; the plan compares gammas at equal cost per round, which is
what the engines' shared rounds make them pay. Bins with fewer than `min_rounds` verify rounds
since the last re-fit keep their gamma (too little evidence), and so do bins without a measured
alpha (a dense bin drafts nothing, so nothing measures its drafts: it stays dense until a new
plan by gin).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from scipy import optimize

from sparrow_jax.sparsity import exact_cost


@dataclasses.dataclass(frozen=True)
class RoundCosts:
    """Seconds of one round of each branch [R] (modelled units where `in_seconds` is False:
    no call timed, or no scale fits), the per-call overhead t_0, whether the calls determined
    the fit (`measured`), why not (`note`, '' when measured) and the calls fitted."""
    seconds: tuple[float, ...]
    overhead: float
    measured: bool
    note: str = ""
    calls: int = 0
    in_seconds: bool = True


def fit_round_costs(counts, seconds, modelled: Sequence[float]) -> RoundCosts:
    """counts [N, R] rounds per branch of N timed calls, seconds [N] their wall times,
    modelled [R] > 0 the branches' modelled costs (any unit: their ratios are used) ->
    `RoundCosts` (module docstring)."""
    n = np.asarray(counts, np.float64).reshape(-1, len(modelled))
    t = np.asarray(seconds, np.float64).reshape(-1)
    m = np.asarray(modelled, np.float64)
    if n.shape[0] != t.shape[0] or not (m > 0).all():
        raise ValueError(f"fit_round_costs: {n.shape[0]} calls with {t.shape[0]} timings, "
                         f"modelled costs {m.tolist()} (each > 0)")
    if not n.shape[0]:
        return RoundCosts(tuple(m), 0.0, False, "no timed call yet: modelled ratios", 0,
                          in_seconds=False)
    design = np.concatenate([np.ones((n.shape[0], 1)), n], axis=1)
    # Rank of the columns scaled to unit norm (counts of thousands beside the 1s).
    norms = np.linalg.norm(design, axis=0)
    unused = [r for r in range(n.shape[1]) if not n[:, r].any()]
    full = not unused and np.linalg.matrix_rank(design / np.where(norms > 0, norms, 1)) == \
        design.shape[1]
    if full:
        coef = optimize.nnls(design, t)[0]
        if (coef[1:] > 0).all():
            return RoundCosts(tuple(coef[1:]), float(coef[0]), True, "", n.shape[0])
        why = "a branch fitted at 0 s"
    elif unused:
        why = f"branch(es) {unused} never ran"
    else:
        why = "the calls ran too few different mixes of rounds"
    # The modelled ratios, scaled to the calls by one factor.
    scaled = np.stack([np.ones(n.shape[0]), n @ m], axis=1)
    t0, s = optimize.nnls(scaled, t)[0] if (n @ m).any() else (0.0, 0.0)
    if s <= 0:
        return RoundCosts(tuple(m), 0.0, False, f"{why}; modelled ratios (no scale fits)",
                          n.shape[0], in_seconds=False)
    return RoundCosts(tuple(s * m), float(t0), False,
                      f"{why}: modelled ratios scaled to the calls", n.shape[0])


@dataclasses.dataclass(frozen=True)
class BinChoice:
    """A bin's re-fit: its gamma before and after, the evidence and the predicted speed-up
    of the new gamma over the old (expected tokens per second of rounds), and why. probe: a
    dense bin set to draft for one interval so that its alpha is measured (no prediction:
    speedup NaN)."""
    bin: int
    old: int
    new: int
    alpha: float
    rounds: int
    speedup: float
    reason: str
    probe: bool = False


def rate(alpha: float, gamma: int, round_cost: float) -> float:
    """Expected tokens per unit cost of a round of `gamma` at acceptance `alpha` (1 token for
    a dense step)."""
    e = 1.0 if gamma == 0 else float(exact_cost.tokens_per_pass(alpha, gamma))
    return e / round_cost


def replan_table(table: Sequence[int], gammas: Sequence[int], costs: Sequence[float],
                 alpha, rounds, *, min_rounds: int, first_approximate: int = 0,
                 dense_refits: Sequence[int] | None = None, probe_after: int = 0
                 ) -> list[BinChoice]:
    """table [bins] the gamma each bin runs now, gammas [G] the compiled round gammas and
    costs [G] one round of each (the first G of `RoundCosts.seconds`), alpha/rounds [bins]
    measured mean alpha (NaN: none) and verify rounds per bin; bins from first_approximate
    (> 0) on are approximate (not re-planned). dense_refits [bins]: the re-fits each bin has
    stayed dense through; a dense bin with rounds but no alpha (it drafted nothing) that
    stayed dense through probe_after (> 0) re-fits is probed: set to the smallest compiled
    draft length, so the next interval measures its alpha. Returns one `BinChoice` per
    re-planned bin."""
    gammas = [int(g) for g in gammas]
    cost = dict(zip(gammas, (float(c) for c in costs)))
    a = np.asarray(alpha, np.float64)
    n = np.asarray(rounds, np.int64)
    refits = np.zeros(len(table), np.int64) if dense_refits is None else np.asarray(dense_refits)
    drafted = [g for g in gammas if g > 0]
    stop = first_approximate or len(table)
    out = []
    for j in range(min(stop, len(table))):
        old = int(table[j])
        if n[j] < min_rounds:
            out.append(BinChoice(j, old, old, float(a[j]), int(n[j]), 1.0,
                                 f"{n[j]} rounds < replan_min_rounds {min_rounds}: kept"))
            continue
        if not np.isfinite(a[j]):
            if old == 0 and probe_after and drafted and refits[j] >= probe_after:
                out.append(BinChoice(
                    j, old, min(drafted), float(a[j]), int(n[j]), float("nan"),
                    f"probe: dense through {refits[j]} re-fits (replan_probe_after "
                    f"{probe_after}), nothing measured its drafts; one interval at gamma "
                    f"{min(drafted)} measures alpha", probe=True))
            else:
                out.append(BinChoice(j, old, old, float(a[j]), int(n[j]), 1.0,
                                     "no alpha measured (no drafts in this bin): kept"))
            continue
        plan = exact_cost.choose_per_bin(
            [0], [[a[j]]], [0.0], {g: cost[g] for g in drafted},
            cost[0] if 0 in cost else np.inf)
        new = plan.gammas[0]
        speedup = rate(a[j], new, cost[new]) / rate(a[j], old, cost[old])
        out.append(BinChoice(j, old, new, float(a[j]), int(n[j]), speedup, plan.reasons[0]))
    return out
