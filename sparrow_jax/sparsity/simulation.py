"""The controller on a simulated bin whose true exceedance rate per rung is known (pure NumPy).

What the controller guarantees is a statement about error rates: how often it lowers a bin onto
a rung whose true rate P(alpha < target) is above q, how often it raises a bin off a rung that
is below q, and the rate it ends up holding. These are checked here by simulation against known
rates - the only independent reference there is - with the same ``controller_update`` the
trainer runs. One bin (open-ended, so every finite rung is on its ladder), ``units`` rows of
``tokens`` tokens per step; rows differ (each row's rate is Gamma-distributed around the rung's
rate with coefficient of variation ``row_cv``), so the cluster-robust bound is exercised.

Reproduce the numbers in docs/mismatch.md ("What the controller guarantees") with
``python -m sparrow_jax.sparsity.simulation``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from sparrow_jax.sparsity.controller import ControllerConfig, ControllerState, controller_update
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

__all__ = ["SimResult", "simulate", "error_rates", "held_rate"]


@dataclasses.dataclass(frozen=True)
class SimResult:
    """One simulated run: ``budgets`` [steps + 1] live budget before each step and after the
    last; ``rates`` [steps] the true rate of the live rung at each step."""
    budgets: tuple[int, ...]
    rates: tuple[float, ...]


def _draw(rng: np.random.Generator, rate: float, units: int, tokens: int, row_cv: float
          ) -> tuple[np.ndarray, np.ndarray]:
    """[units, 1] exceedances and tokens at a true rate (rows' rates vary with CV row_cv)."""
    if row_cv > 0 and rate > 0:
        shape = 1.0 / row_cv ** 2
        rows = np.minimum(rng.gamma(shape, rate / shape, units), 1.0)
    else:
        rows = np.full(units, rate)
    n = np.full((units, 1), tokens)
    return rng.binomial(n, rows[:, None]), n


def simulate(rates: Mapping[int, float], start: int, config: ControllerConfig, *, steps: int,
             units: int = 32, tokens: int = 64, row_cv: float = 0.5, seed: int = 0
             ) -> SimResult:
    """Runs ``controller_update`` for ``steps`` steps on one bin starting at rung ``start``.

    Args:
      rates: true exceedance rate per finite rung (``DENSE_BUDGET`` is 0 unless given); every
        rung of ``config.ladder`` needs one.
      start: the warm-start budget (a rung of the ladder, or ``DENSE_BUDGET``).
    """
    rates = {int(k): float(v) for k, v in rates.items()}
    rates.setdefault(DENSE_BUDGET, 0.0)
    rng = np.random.default_rng(seed)
    top = max(config.ladder or (config.max_budget,))
    sched = Schedule((int(start),), bin_size=max(top, 16) * 4, block_size=16, name="sim")
    state = ControllerState.initial(sched)
    budgets, held = [int(start)], []
    for _ in range(steps):
        b = int(state.schedule.budgets[0])
        held.append(rates[b])
        hits, toks = _draw(rng, rates[b], units, tokens, row_cv)
        probe = state.replay_budgets() if config.probe else None
        ph = pt = None
        if probe is not None:
            ph, pt = _draw(rng, rates[int(probe[0])], units, tokens, row_cv)
        state, _ = controller_update(state, hits, toks, config, probe_hits=ph, probe_tokens=pt)
        budgets.append(int(state.schedule.budgets[0]))
    return SimResult(tuple(budgets), tuple(held))


def error_rates(config: ControllerConfig, multiples=(0.1, 0.5, 1.0, 2.0), *, steps: int = 20,
                runs: int = 100, **kw) -> dict[str, dict[float, float]]:
    """Per true rate ``m * q`` of a rung: the share of runs that

    - ``lower``: lowered onto it within ``steps`` steps from a clean rung above it (rate 0);
    - ``raise``: raised off it within ``steps`` steps, warm-started on it (probing off, so
      only the raise rule acts).

    Lowering onto 2q and raising off 0.1q / 0.5q are errors; the others are power.
    """
    q = config.quantile
    lo, hi = sorted(config.ladder or (config.min_budget, config.max_budget))[:2]
    cfg_lower = dataclasses.replace(config, ladder=(lo, hi), min_budget=lo, max_budget=hi)
    cfg_raise = dataclasses.replace(cfg_lower, probe=False)
    out: dict[str, dict[float, float]] = {"lower": {}, "raise": {}}
    for m in multiples:
        rates = {lo: m * q, hi: 0.0}
        down = [simulate(rates, hi, cfg_lower, steps=steps, seed=s, **kw).budgets[-1] == lo
                for s in range(runs)]
        up = [simulate(rates, lo, cfg_raise, steps=steps, seed=10_000 + s, **kw).budgets[-1] > lo
              for s in range(runs)]
        out["lower"][m], out["raise"][m] = float(np.mean(down)), float(np.mean(up))
    return out


def held_rate(config: ControllerConfig, multiples, *, steps: int = 40, runs: int = 40,
              **kw) -> float:
    """Mean true rate / q of the live rung over the second half of ``runs`` runs that start at
    the dense rung, on a ladder whose rungs (cheapest first) have rates ``multiples * q``."""
    q = config.quantile
    ladder = tuple(sorted(config.ladder))
    if len(multiples) != len(ladder):
        raise ValueError(f"{len(multiples)} rate multiples for {len(ladder)} rungs")
    rates = {b: m * q for b, m in zip(ladder, multiples)}
    late = [np.mean(simulate(rates, DENSE_BUDGET, config, steps=steps, seed=s, **kw)
                    .rates[steps // 2:]) for s in range(runs)]
    return float(np.mean(late) / q)


def main() -> None:
    """Prints the error rates and held rate of the shipped rule and the certified rule."""
    base = dict(target=0.9, quantile=0.01, min_rows=16, min_tokens=256, decay=0.8,
                ladder=(64, 96, 128, 192, 256, 384, 512), min_budget=64, max_budget=512)
    rules = {"upper bound, lower_margin 0.25 (old demo)": ControllerConfig(**base, lower_margin=0.25),
             "certified: lower at ub <= q, raise at lb > q": ControllerConfig(
                 **base, lower_margin=1.0, raise_on="lower")}
    geometric = tuple(2.0 ** (k / 2) for k in range(3, -4, -1))   # 2.8q ... 0.18q, cheapest first
    for name, cfg in rules.items():
        print(name)
        for kind, by_m in error_rates(cfg).items():
            print(f"  P({kind} within 20 steps):",
                  ", ".join(f"{m:g}q: {p:.2f}" for m, p in by_m.items()))
        print(f"  rate held over steps 21-40 on rungs at {', '.join(f'{m:.2f}' for m in geometric)}"
              f" q: {held_rate(cfg, geometric):.2f} q")


if __name__ == "__main__":
    main()
