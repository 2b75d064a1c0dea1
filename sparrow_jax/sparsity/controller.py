"""The online schedule controller: moves each length bin's KV budget from the tail alpha the
learner measured for that bin this step (``sparrow_jax.sparsity.mismatch.tail_by_bin``).

A bin whose tail falls below the target is raised at once; one that stays above target + margin
for ``patience`` steps is lowered one rung, unless it failed at that budget recently. Pure
``controller_update`` on a frozen ``ControllerState`` (JSON-able for checkpoints), plus a small
mutable wrapper; it runs on the host once per RL step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import gin
import numpy as np

from sparrow_jax.sparsity.schedule import NUM_RESERVED_BLOCKS, Schedule

__all__ = ["ControllerConfig", "ControllerState", "controller_update", "ScheduleController"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """How the controller moves budgets. Budgets move along a ladder of rungs.

    Attributes:
      target: a bin passes when its tail alpha >= target.
      margin: lowering is considered only when tail >= target + margin (hysteresis band).
      patience: consecutive steps with tail >= target + margin before lowering one rung.
        A failing bin is raised at once, ``up_rungs`` rungs.
      min_tokens: bins with fewer tokens this step (or a NaN tail) are left untouched.
      min_budget, max_budget: bounds (rounded to the block size, at least 3 blocks).
      step_factor: ratio between rungs of the default geometric ladder.
      ladder: explicit rungs (tokens) instead of the geometric ladder.
      fail_memory: after a failure at budget b, do not lower back to <= b for this many
        steps (stops a bin from re-probing a failing budget every ``patience`` steps).
      monotone: keep budgets non-decreasing over bins (cumulative max; raising is safe).
    """

    target: float = 0.86
    margin: float = 0.03
    patience: int = 3
    min_tokens: int = 256
    min_budget: int = 256
    max_budget: int = 16384
    step_factor: float = 1.25
    ladder: tuple[int, ...] | None = None
    up_rungs: int = 1
    fail_memory: int = 20
    monotone: bool = True

    def __post_init__(self):
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        for field in ("patience", "up_rungs"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget {self.min_budget} > max_budget {self.max_budget}")
        if self.step_factor <= 1.0:
            raise ValueError(f"step_factor must be > 1, got {self.step_factor}")
        if self.ladder is not None:
            object.__setattr__(self, "ladder", tuple(int(b) for b in self.ladder))

    def rungs(self, block_size: int) -> tuple[int, ...]:
        """The sorted budgets the controller may use, all within [min_budget, max_budget]."""
        lo = max(-(-self.min_budget // block_size), NUM_RESERVED_BLOCKS) * block_size
        hi = max(self.max_budget // block_size * block_size, lo)
        if self.ladder is not None:
            bad = [b for b in self.ladder if b % block_size]
            if bad:
                raise ValueError(f"ladder budgets {bad} are not multiples of block_size {block_size}")
            rungs = sorted({b for b in self.ladder if lo <= b <= hi} | {lo, hi})
            return tuple(rungs)
        rungs, b = [], lo
        while b < hi:
            rungs.append(b)
            b = max(b + block_size, -(-int(math.ceil(b * self.step_factor)) // block_size) * block_size)
        rungs.append(hi)
        return tuple(rungs)


@dataclasses.dataclass(frozen=True)
class ControllerState:
    """Controller state; JSON-able through ``to_dict`` for checkpoints.

    Attributes:
      schedule: the current schedule.
      streak: per bin, consecutive active steps with tail >= target + margin.
      last_fail: per bin, the budget at the last failure (0 = never failed).
      fail_age: per bin, steps since that failure.
      step: number of updates applied.
    """

    schedule: Schedule
    streak: tuple[int, ...]
    last_fail: tuple[int, ...]
    fail_age: tuple[int, ...]
    step: int = 0

    def __post_init__(self):
        n = self.schedule.num_bins
        for field in ("streak", "last_fail", "fail_age"):
            value = tuple(int(v) for v in getattr(self, field))
            if len(value) != n:
                raise ValueError(f"{field} has {len(value)} entries, schedule has {n} bins")
            object.__setattr__(self, field, value)

    @classmethod
    def initial(cls, schedule: Schedule) -> "ControllerState":
        n = schedule.num_bins
        return cls(schedule, (0,) * n, (0,) * n, (0,) * n, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_dict(), "streak": list(self.streak),
                "last_fail": list(self.last_fail), "fail_age": list(self.fail_age),
                "step": self.step}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ControllerState":
        return cls(Schedule.from_dict(data["schedule"]), tuple(data["streak"]),
                   tuple(data["last_fail"]), tuple(data["fail_age"]), int(data["step"]))


def controller_update(
    state: ControllerState, tail: Any, counts: Any, config: ControllerConfig
) -> tuple[ControllerState, dict[str, Any]]:
    """One controller step from this RL step's per-bin tail (pure; host-side NumPy).

    Args:
      state: current state.
      tail: ``[num_bins]`` per-bin tail alpha (NaN = no data).
      counts: ``[num_bins]`` tokens per bin.
      config: controller settings.
    Returns:
      (new state, info) where info holds NumPy arrays ``budgets_before``, ``budgets`` and bool
      masks ``raised``, ``lowered``, ``skipped``, ``saturated`` (failing at max_budget),
      ``blocked`` (lowering vetoed by fail memory), plus ``num_changed``.
    """
    sched = state.schedule
    n = sched.num_bins
    tail = np.asarray(tail, np.float64).reshape(-1)
    counts = np.asarray(counts).reshape(-1)
    if tail.shape != (n,) or counts.shape != (n,):
        raise ValueError(f"tail {tail.shape} / counts {counts.shape} must both be ({n},)")
    rungs = np.asarray(config.rungs(sched.block_size))
    lo, hi = int(rungs[0]), int(rungs[-1])
    before = np.asarray(sched.budgets, np.int64)
    budgets = np.clip(before, lo, hi)  # bounds win over whatever the schedule started with
    streak = np.asarray(state.streak, np.int64)
    last_fail = np.asarray(state.last_fail, np.int64)
    fail_age = np.asarray(state.fail_age, np.int64) + 1
    flags = {k: np.zeros(n, bool) for k in ("skipped", "saturated", "blocked")}

    for i in range(n):
        b = int(budgets[i])
        if counts[i] < config.min_tokens or not np.isfinite(tail[i]):
            flags["skipped"][i] = True  # no evidence: keep budget and streak as they are
        elif tail[i] < config.target:
            above = rungs[rungs > b]
            if above.size:
                budgets[i] = above[min(config.up_rungs, above.size) - 1]
            else:
                flags["saturated"][i] = True
            last_fail[i], fail_age[i], streak[i] = b, 0, 0
        elif tail[i] >= config.target + config.margin:
            streak[i] += 1
            below = rungs[rungs < b]
            if streak[i] >= config.patience and below.size:
                cand = int(below[-1])
                if cand <= last_fail[i] and fail_age[i] < config.fail_memory:
                    flags["blocked"][i] = True
                    streak[i] = config.patience  # stay ready; try when the memory expires
                else:
                    budgets[i], streak[i] = cand, 0
            streak[i] = min(streak[i], config.patience)
        else:
            streak[i] = 0  # inside the hysteresis band: hold

    if config.monotone:
        budgets = np.maximum.accumulate(budgets)
    new_sched = dataclasses.replace(sched, budgets=tuple(int(b) for b in budgets))
    new_state = ControllerState(new_sched, tuple(streak), tuple(last_fail), tuple(fail_age),
                                state.step + 1)
    info = {"budgets_before": before, "budgets": budgets.copy(), "raised": budgets > before,
            "lowered": budgets < before, "num_changed": int(np.sum(budgets != before)), **flags}
    return new_state, info


class ScheduleController:
    """Mutable convenience wrapper: holds a config and the current ``ControllerState``."""

    def __init__(self, schedule: Schedule, config: ControllerConfig | None = None,
                 state: ControllerState | None = None):
        self.config = config if config is not None else ControllerConfig()
        self.state = state if state is not None else ControllerState.initial(schedule)

    @property
    def schedule(self) -> Schedule:
        return self.state.schedule

    def update(self, tail: Any, counts: Any) -> dict[str, Any]:
        self.state, info = controller_update(self.state, tail, counts, self.config)
        return info

    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    @classmethod
    def from_state_dict(cls, data: dict[str, Any],
                        config: ControllerConfig | None = None) -> "ScheduleController":
        state = ControllerState.from_dict(data)
        return cls(state.schedule, config, state)
