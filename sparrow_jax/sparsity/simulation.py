"""The controller on simulated bins whose true exceedance rate per rung is known (pure NumPy).

What the controller guarantees is a statement about error rates: how often it lowers a bin onto
a rung whose true rate P(alpha < target) is above q, how often it raises a bin off a rung that
is below q (or fails to raise it off one above q), and the rate it ends up holding. These are
checked here by simulation against known rates - the only independent reference there is - with
the same ``controller_update`` the trainer runs. Each run is one bin (``units`` rows of
``tokens`` tokens per step); rows differ (each row's rate is Gamma-distributed around the rung's
rate with coefficient of variation ``row_cv``), so the cluster-robust bound is exercised.

Many runs go through one ``controller_update`` call as the bins of one schedule (every bin's
ladder holds every rung: the bins are wider than the top rung), with ``downstream=False``: no
bin blocks, implicates or raises another, so one call of R bins is R independent single-bin
runs at about the cost of one. The replay measures only the bins that have a probe, as a
single-bin run replays only when its bin has one.

Reproduce the numbers in docs/mismatch.md ("What the controller guarantees") with
``python -m sparrow_jax.sparsity.simulation``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from sparrow_jax.sparsity.controller import ControllerConfig, ControllerState, controller_update
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

__all__ = ["SimRuns", "simulate_runs", "error_rates", "held_rate", "drift_rates"]


@dataclasses.dataclass(frozen=True)
class SimRuns:
    """Simulated runs: ``budgets`` [runs, steps + 1] live budget before each step and after the
    last; ``rates`` [runs, steps] the true rate of the live rung at each step."""
    budgets: np.ndarray
    rates: np.ndarray


def _draw(rng: np.random.Generator, rate: np.ndarray, units: int, tokens: int, row_cv: float
          ) -> tuple[np.ndarray, np.ndarray]:
    """[units, R] exceedances and tokens at true rates ``rate`` [R] (rows' rates vary with CV
    row_cv; a rate of 0 draws no exceedance)."""
    rate = np.asarray(rate, np.float64)
    if row_cv > 0:
        shape = 1.0 / row_cv ** 2
        rows = np.minimum(rng.gamma(shape, 1.0 / shape, (units, rate.size)) * rate, 1.0)
    else:
        rows = np.broadcast_to(rate, (units, rate.size))
    n = np.full((units, rate.size), tokens)
    return rng.binomial(n, rows), n


def simulate_runs(rates: Mapping[int, float], start: int, config: ControllerConfig, *,
                  steps: int, runs: int, units: int = 32, tokens: int = 64,
                  row_cv: float = 0.5, drift: Sequence[float] | None = None, seed: int = 0
                  ) -> SimRuns:
    """``runs`` independent runs of ``controller_update`` for ``steps`` steps, each one bin
    starting at rung ``start``, all in one schedule of ``runs`` bins (see the module doc).

    Args:
      rates: true exceedance rate per finite rung (``DENSE_BUDGET`` is 0 unless given); every
        rung of ``config.ladder`` needs one.
      start: the warm-start budget (a rung of the ladder, or ``DENSE_BUDGET``).
      drift: per step, a factor on every finite rung's rate (``[steps]``; None: constant), e.g.
        ten 1s then ten 4s: a rung at 0.5 q that becomes 2 q halfway.
    """
    table = {int(k): float(v) for k, v in rates.items()}
    table.setdefault(DENSE_BUDGET, 0.0)
    if drift is not None and len(drift) != steps:
        raise ValueError(f"drift has {len(drift)} factors for {steps} steps")
    rungs = np.asarray(sorted(table), np.int64)
    values = np.asarray([table[int(b)] for b in rungs])
    rng = np.random.default_rng(seed)
    top = max(config.ladder or (config.max_budget,))
    sched = Schedule((int(start),) * runs, bin_size=max(top, 16) * 4, block_size=16, name="sim")
    state = ControllerState.initial(sched)

    def true_rate(budgets: np.ndarray, step: int) -> np.ndarray:
        idx = np.searchsorted(rungs, budgets)
        if np.any(idx >= rungs.size) or np.any(rungs[np.minimum(idx, rungs.size - 1)] != budgets):
            raise ValueError(f"budgets {sorted(set(budgets.tolist()) - set(rungs.tolist()))} "
                             "have no true rate")
        factor = 1.0 if drift is None else float(drift[step])
        return np.where(rungs[idx] >= DENSE_BUDGET, values[idx], values[idx] * factor)

    budgets = np.empty((runs, steps + 1), np.int64)
    held = np.empty((runs, steps))
    budgets[:, 0] = start
    for step in range(steps):
        live = np.asarray(state.schedule.budgets, np.int64)
        held[:, step] = true_rate(live, step)
        hits, toks = _draw(rng, held[:, step], units, tokens, row_cv)
        probe = state.replay_budgets() if config.probe else None
        ph = pt = None
        if probe is not None:
            has = np.asarray(state.probe_budgets) > 0
            ph, pt = _draw(rng, np.where(has, true_rate(probe, step), 0.0), units, tokens, row_cv)
            ph, pt = ph * has, pt * has          # a run without a probe makes no replay
        state, _ = controller_update(state, hits, toks, config, probe_hits=ph, probe_tokens=pt,
                                     downstream=False)
        budgets[:, step + 1] = state.schedule.budgets
    return SimRuns(budgets, held)


def error_rates(config: ControllerConfig, multiples=(0.1, 0.5, 1.0, 2.0), *, steps: int = 20,
                runs: int = 100, seed: int = 0, **kw) -> dict[str, dict[float, float]]:
    """Per true rate ``m * q`` of a rung: the share of ``runs`` runs that

    - ``lower``: were lowered onto it at some step within ``steps`` steps, starting on a clean
      rung above it (rate 0);
    - ``raise``: were raised off it within ``steps`` steps, warm-started on it (probing off, so
      only the raise rule acts; once raised, a run stays off it).

    Lowering onto a rung above q and raising off one below q are errors, and so is *not*
    raising off a rung above q (1 - ``raise``); the others are power.
    """
    q = config.quantile
    lo, hi = sorted(config.ladder or (config.min_budget, config.max_budget))[:2]
    cfg_lower = dataclasses.replace(config, ladder=(lo, hi), min_budget=lo, max_budget=hi)
    cfg_raise = dataclasses.replace(cfg_lower, probe=False)
    out: dict[str, dict[float, float]] = {"lower": {}, "raise": {}}
    for i, m in enumerate(multiples):
        rates = {lo: m * q, hi: 0.0}
        down = simulate_runs(rates, hi, cfg_lower, steps=steps, runs=runs, seed=seed + 2 * i,
                             **kw).budgets
        up = simulate_runs(rates, lo, cfg_raise, steps=steps, runs=runs, seed=seed + 2 * i + 1,
                           **kw).budgets
        out["lower"][m] = float(np.mean((down[:, 1:] == lo).any(1)))
        out["raise"][m] = float(np.mean(up[:, -1] > lo))
    return out


def drift_rates(config: ControllerConfig, before: float = 0.5, after: float = 2.0, *,
                steps: int = 40, runs: int = 200, seed: int = 0, **kw) -> dict[str, float]:
    """A rung whose true rate is ``before * q`` for the first half of the run and ``after * q``
    for the second (the policy moved), starting on a clean rung above it, probing on.

    Returns the share of runs ``on_at_switch`` (lowered onto it by the halfway step: power when
    before < 1), ``stuck`` (of those, still on it at the end: failures to raise), the mean
    ``steps_to_raise`` after the switch (of those raised), and ``exposure``: the share of the
    second half's run-steps spent on it."""
    q = config.quantile
    lo, hi = sorted(config.ladder or (config.min_budget, config.max_budget))[:2]
    cfg = dataclasses.replace(config, ladder=(lo, hi), min_budget=lo, max_budget=hi)
    half = steps // 2
    factor = [1.0] * half + [after / before] * (steps - half)
    sim = simulate_runs({lo: before * q, hi: 0.0}, hi, cfg, steps=steps, runs=runs, seed=seed,
                        drift=factor, **kw)
    on = sim.budgets[:, half] == lo                   # live during the first drifted step
    late = sim.budgets[:, half:steps] == lo           # live at steps half .. steps - 1
    off = ~late
    first_off = np.where(off.any(1), off.argmax(1), steps - half)
    raised = on & off.any(1)
    return {"on_at_switch": float(on.mean()),
            "stuck": float(np.mean(sim.budgets[on, -1] == lo)) if on.any() else float("nan"),
            "steps_to_raise": float(first_off[raised].mean()) if raised.any() else float("nan"),
            "exposure": float(late.mean())}


def held_rate(config: ControllerConfig, multiples, *, steps: int = 40, runs: int = 40,
              seed: int = 0, **kw) -> float:
    """Mean true rate / q of the live rung over the second half of ``runs`` runs that start at
    the dense rung, on a ladder whose rungs (cheapest first) have rates ``multiples * q``."""
    q = config.quantile
    ladder = tuple(sorted(config.ladder))
    if len(multiples) != len(ladder):
        raise ValueError(f"{len(multiples)} rate multiples for {len(ladder)} rungs")
    rates = {b: m * q for b, m in zip(ladder, multiples)}
    sim = simulate_runs(rates, DENSE_BUDGET, config, steps=steps, runs=runs, seed=seed, **kw)
    return float(sim.rates[:, steps // 2:].mean() / q)


def main() -> None:
    """Prints the error rates, drift behaviour and held rate of the certified rule (the
    default) and of the older demo rule."""
    import time
    base = dict(target=0.9, quantile=0.01, min_rows=16, min_tokens=256, decay=0.8,
                ladder=(64, 96, 128, 192, 256, 384, 512), min_budget=64, max_budget=512)
    rules = {"certified (the default): lower at ub <= q, raise at lb > q": ControllerConfig(**base),
             "older demo rule: lower at ub <= 0.25 q, raise at ub > q": ControllerConfig(
                 **base, lower_margin=0.25, raise_on="upper")}
    geometric = tuple(2.0 ** (k / 2) for k in range(3, -4, -1))   # 2.8q ... 0.35q, cheapest first
    runs = 1000
    for name, cfg in rules.items():
        t0 = time.perf_counter()
        print(name)
        for kind, by_m in error_rates(cfg, (0.1, 0.5, 1.0, 1.25, 1.5, 2.0), runs=runs).items():
            print(f"  P({kind} within 20 steps), {runs} runs:",
                  ", ".join(f"{m:g}q: {p:.3f}" for m, p in by_m.items()))
        d = drift_rates(cfg, runs=runs)
        print(f"  rung at 0.5 q, 2 q from step 21 of 40 ({runs} runs): on it at step 21 "
              f"{d['on_at_switch']:.3f}, still on it at step 40 {d['stuck']:.3f}, steps to raise "
              f"{d['steps_to_raise']:.1f}, share of steps 21-40 on it {d['exposure']:.3f}")
        print(f"  rate held over steps 21-40 on rungs at {', '.join(f'{m:.2f}' for m in geometric)}"
              f" q: {held_rate(cfg, geometric, runs=200):.3f} q  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
