"""Re-planning the exact_sparse per-bin gamma inside `sparrow train` (`RolloutConfig.replan_every`).

`Replanner` holds the run's plan (the gamma of every length bin, which the next rollouts run:
`rollout`) and the evidence for the next one, gathered each step:
- every timed rollout call's rounds per round branch (`Trajectories.round_counts`) and its wall
  seconds - calls that compiled a program are left out (their time is the compile's), and only
  the calls of the last `FIT_STEPS` steps are kept (costs drift with the policy's lengths);
- each bin's verify rounds and mean alpha since the last re-fit (`exact.acceptance_by_bin_arrays`
  rows: each row's last round left out, as the step's metrics do).
Every `replan_every` steps, `replan` fits the round costs (`round_costs.fit_round_costs`:
non-negative least squares over the kept calls, else the modelled ratios of
`exact_cost.modelled_costs` at the run's context, scaled to the calls - the log says which) and
re-fits each verified bin's gamma among the compiled ones (`round_costs.replan_table`); it logs
one line per changed bin with its reason (old -> new gamma, alpha, rounds, the round costs, the
predicted speed-up), or one line that nothing changed. A dense bin drafts nothing, so nothing
measures its alpha: one that stayed dense through `replan_probe_after` re-fits with traffic is
probed - the next interval runs it at the smallest compiled draft length, and the re-fit after
decides from the alpha that measured. The new plan runs from the next step on
without a compile (the decode programs take the table as an input). The plan and its evidence
are in every checkpoint (`state_dict`), so a resume continues with the same plan.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

import jax
import numpy as np

from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.sparsity import cost_model, exact_cost, round_costs
from sparrow_jax.sparsity.schedule import Schedule

__all__ = ["Replanner", "Replan", "FIT_STEPS"]

log = logging.getLogger(__name__)

FIT_STEPS = 8          # the round costs are fitted on the calls of this many last steps


@dataclasses.dataclass(frozen=True)
class Replan:
    """What one re-fit decided: the bins' choices, the costs it used, its log lines."""
    choices: tuple[round_costs.BinChoice, ...]
    costs: round_costs.RoundCosts
    lines: tuple[str, ...]

    @property
    def changed(self) -> tuple[round_costs.BinChoice, ...]:
        return tuple(c for c in self.choices if c.new != c.old)

    @property
    def probed(self) -> tuple[round_costs.BinChoice, ...]:
        """Dense bins set to draft for one interval to measure alpha (no prediction)."""
        return tuple(c for c in self.choices if c.probe)


class Replanner:
    """The run's per-bin gamma plan and the evidence for re-fitting it (module docstring)."""

    def __init__(self, rollout: RolloutConfig, schedule: Schedule,
                 model_shape: cost_model.ModelShape, hardware: cost_model.Hardware | None, *,
                 batch: int):
        self.every = rollout.replan_every
        self.min_rounds = rollout.replan_min_rounds
        self.probe_after = rollout.replan_probe_after
        self.gammas = rollout.round_gammas
        self.branches = rollout.round_branches
        self.gamma = rollout.gamma
        self.first_approximate = rollout.approximate_from_bin
        self.bin_size = schedule.bin_size
        self.budgets = tuple(int(b) for b in schedule.budgets)
        self.block_size = rollout.block_size
        # The modelled costs' model and device (None: not in the table, h100's ratios) and
        # rows per rollout call (a decode step's weight reads are shared by the batch).
        self.shape, self.hardware, self.batch = model_shape, hardware, batch
        self.table = rollout.gamma_table(schedule.num_bins)
        n = len(self.table)
        self.alpha_sum, self.rounds = np.zeros(n), np.zeros(n, np.int64)
        self.alpha_rounds = np.zeros(n, np.int64)
        self.dense_refits = np.zeros(n, np.int64)   # re-fits each bin has stayed dense through
        self.calls: collections.deque = collections.deque()   # (step, counts [R], seconds)

    # -- evidence ----------------------------------------------------------------------------
    def observe_call(self, step: int, counts: Sequence[int], seconds: float) -> None:
        """One timed rollout call of RL step `step` (1-based) that compiled nothing."""
        self.calls.append((int(step), [int(c) for c in counts], float(seconds)))
        while self.calls and self.calls[0][0] <= step - FIT_STEPS:
            self.calls.popleft()

    def observe_rounds(self, rows: Sequence[dict]) -> None:
        """A step's per-bin acceptance rows (`exact.acceptance_by_bin_arrays`)."""
        for r in rows:
            j = min(int(r["bin"]), len(self.table) - 1)
            self.rounds[j] += r["rounds"]
            if np.isfinite(r["mean_alpha"]):
                self.alpha_sum[j] += r["mean_alpha"] * r["rounds"]
                self.alpha_rounds[j] += r["rounds"]

    def due(self, step: int) -> bool:
        """Whether RL step `step` (1-based, done) ends with a re-fit."""
        return self.every > 0 and step % self.every == 0

    # -- the plan ----------------------------------------------------------------------------
    def rollout(self, cfg: RolloutConfig) -> RolloutConfig:
        """cfg running the current plan (the same programs: the table is their input)."""
        return dataclasses.replace(cfg, gamma_by_bin=tuple(self.table))

    def modelled(self) -> np.ndarray:
        """The branches' modelled round costs [R] (eFLOPs) at the context where the rounds
        since the last re-fit ran (the rounds-weighted mean of the bins' middles)."""
        mids = (np.arange(len(self.table)) + 0.5) * self.bin_size
        ctx = float(np.average(mids, weights=self.rounds)) if self.rounds.any() else mids[0]
        budget = self.budgets[min(int(ctx // self.bin_size), len(self.budgets) - 1)]
        drafted = [g for g in self.gammas if g > 0]
        draft, verify, dense = exact_cost.modelled_costs(
            self.shape, self.hardware or "h100", [ctx], [budget], drafted,
            block_size=self.block_size, batch=self.batch)
        ver = dict(zip(drafted, verify[:, 0]))
        cost = {f"gamma_{g}": (g * draft[0, 0] + ver[g]) if g else dense[0]
                for g in self.gammas}
        cost["approximate"] = (self.gamma + 1) * draft[0, 0]
        return np.asarray([cost[b] for b in self.branches], np.float64)

    def replan(self, step: int) -> Replan:
        """Re-fits the plan (applied from the next step on) and starts new evidence."""
        calls = list(self.calls)
        costs = round_costs.fit_round_costs([c[1] for c in calls], [c[2] for c in calls],
                                            self.modelled())
        with np.errstate(invalid="ignore", divide="ignore"):
            alpha = np.where(self.alpha_rounds > 0, self.alpha_sum / self.alpha_rounds, np.nan)
        choices = round_costs.replan_table(
            self.table, self.gammas, costs.seconds[:len(self.gammas)], alpha, self.rounds,
            min_rounds=self.min_rounds, first_approximate=self.first_approximate,
            dense_refits=self.dense_refits, probe_after=self.probe_after)
        unit, scale = ("ms", 1e3) if costs.in_seconds else ("modelled", 1.0)
        per_round = ", ".join(f"{b} {scale * c:.4g}" for b, c in zip(self.branches,
                                                                    costs.seconds))
        source = (f"fitted on {costs.calls} calls" if costs.measured else
                  f"{costs.note} ({costs.calls} timed calls; hardware "
                  f"{self.hardware.name if self.hardware else 'h100 (device not in the table)'})")
        lines = [f"exact_sparse re-plan at step {step}: round costs ({unit}) {per_round}; "
                 f"{source}; bins with under replan_min_rounds = {self.min_rounds} verify "
                 "rounds keep their gamma"]
        for c in choices:
            where = (f"exact_sparse re-plan, bin {c.bin} ({c.bin * self.bin_size}-"
                     f"{(c.bin + 1) * self.bin_size} tokens): gamma {c.old} -> {c.new}")
            if c.probe:
                lines.append(f"{where} ({c.rounds} dense rounds; {c.reason})")
            elif c.new != c.old:
                lines.append(f"{where} (alpha {c.alpha:.3f} over {c.rounds} rounds, predicted "
                             f"{c.speedup:.2f}x the old gamma's tokens per second; {c.reason})")
        if not any(c.new != c.old for c in choices):
            lines.append(f"exact_sparse re-plan at step {step}: no bin changed (gamma per bin "
                         f"{list(self.table)})")
        table = list(self.table)
        for c in choices:
            table[c.bin] = c.new
        self.table = tuple(table)
        self.dense_refits = np.where(np.asarray(table) == 0, self.dense_refits + 1, 0)
        self.alpha_sum[:] = 0
        self.rounds[:] = 0
        self.alpha_rounds[:] = 0
        for line in lines:
            log.info("%s", line)
        return Replan(tuple(choices), costs, tuple(lines))

    def metrics(self, replan: Replan | None = None) -> dict[str, float]:
        """`exact_plan/gamma_bin_xx`: the gamma each bin runs next; at a re-fit also the
        round costs (`exact_plan/round_ms/<branch>`, or `round_modelled/` without a timed
        call), whether they were measured, and how many bins changed."""
        m = {f"exact_plan/gamma_bin_{j:02d}": float(g) for j, g in enumerate(self.table)}
        if replan is not None:
            c = replan.costs
            for b, s in zip(self.branches, c.seconds):
                m[f"exact_plan/round_{'ms' if c.in_seconds else 'modelled'}/{b}"] = (
                    1e3 * s if c.in_seconds else s)
            m["exact_plan/costs_measured"] = float(c.measured)
            m["exact_plan/bins_changed"] = float(len(replan.changed))
            m["exact_plan/bins_probed"] = float(len(replan.probed))
        return m

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"table": list(self.table), "alpha_sum": self.alpha_sum.tolist(),
                "alpha_rounds": self.alpha_rounds.tolist(), "rounds": self.rounds.tolist(),
                "calls": [list(c) for c in self.calls], "branches": list(self.branches),
                "dense_refits": self.dense_refits.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's plan and evidence (of the same compiled gammas: the resume check
        refuses changed replan settings)."""
        table = tuple(int(g) for g in state["table"])
        if len(table) != len(self.table) or not set(table[:self.first_approximate or None]) \
                <= set(self.gammas):
            raise ValueError(f"checkpoint's exact_sparse plan {list(table)} does not fit "
                             f"{len(self.table)} bins of gammas {list(self.gammas)}")
        self.table = table
        self.alpha_sum = np.asarray(state["alpha_sum"], np.float64)
        self.alpha_rounds = np.asarray(state["alpha_rounds"], np.int64)
        self.rounds = np.asarray(state["rounds"], np.int64)
        # A checkpoint from before probing (2026-11-29) counts from its restore on.
        self.dense_refits = np.asarray(state.get("dense_refits", [0] * len(table)), np.int64)
        self.calls = collections.deque((int(s), list(c), float(t))
                                       for s, c, t in state["calls"])


def for_run(rollout: RolloutConfig, schedule: Schedule, model_config, *, batch: int
            ) -> Replanner | None:
    """The run's Replanner (re-planning on: `replan_every` > 0 in exact_sparse), or None.
    model_config: the policy's `Qwen3Config` (the modelled costs' shape); batch: rows per
    rollout call."""
    if not (rollout.replans and rollout.replan_every):
        return None
    shape = cost_model.ModelShape.from_hf_config(model_config.to_hf_dict(dtype="bfloat16"),
                                                 dense_layers=rollout.dense_layers)
    hardware = cost_model.hardware_for_device(jax.devices()[0].device_kind)
    return Replanner(rollout, schedule, shape, hardware, batch=batch)
