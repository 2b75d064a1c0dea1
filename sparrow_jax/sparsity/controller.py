"""The online schedule controller: each length bin's KV budget from pooled tail evidence.

The tail condition ``p_q(alpha) >= target`` is ``P(alpha < target) <= q``: a bin passes when the
rate of tokens with alpha below the target is at most q. Per bin the controller pools exceedance
counts at the bin's current budget over steps (decayed, reset when the budget changes; rows or
prompts as the statistical unit, ``sparrow_jax.sparsity.evidence``) and bounds the rate from
above with a one-sided confidence bound. With enough evidence (``min_rows`` units and
``min_tokens`` tokens):

- **raise** as soon as the bound exceeds q: back to the last rung this bin passed at (the rung
  it was lowered from), or to the **dense** rung when there is none. Every bin's ladder ends at
  dense (``DENSE_BUDGET``; a budget >= the bin's upper edge already is dense attention for the
  bin's tokens, and the rollout takes its dense path for rows whose budget covers their length),
  so a failing bin always has somewhere to go;
- **lower** one rung only when a teacher-forced replay of the same batches at that rung (the
  *probe*, ``probe_budgets``) passes by a stricter bar (bound <= ``lower_margin`` * q;
  between that and q the probe keeps pooling evidence), while the current rung passes too,
  and no bin *after* it fails in that replay. Sparsity propagates downstream: a token's keys and
  values in the later layers come from hidden states computed at its own bin's budget, so a
  cheaper early bin can push a later bin below target even at the dense rung. A bin without a
  probe that fails in the replay (a *witness*) marks the nearest probe upstream of it failed.
  Live rollouts never carry an untested cheaper budget;
- a bin failing **at the dense rung** is failing because of the bins before it: every sparse
  bin upstream returns to the rung it last passed at (the next rung up when none).

A rung that failed (live or in a probe) is not probed again for ``fail_memory`` steps. Pure
``controller_update`` on a frozen, JSON-able ``ControllerState`` plus a small mutable wrapper;
host-side, once per RL step.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Any

import gin
import numpy as np

from sparrow_jax.runtime.choices import Choice
from sparrow_jax.sparsity.evidence import Evidence, lower_bound, upper_bound
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, NUM_RESERVED_BLOCKS, Schedule

__all__ = ["ControllerConfig", "EvidenceUnit", "RaiseOn", "ControllerState", "controller_update", "ScheduleController",
           "bin_ladders", "certify_tokens", "certifies"]


class EvidenceUnit(Choice):
    """The controller's independent statistical unit (`ControllerConfig.unit`)."""
    ROW = "row"            # each sampled row
    PROMPT = "prompt"      # a GRPO group's rows summed (they share a prompt)


class RaiseOn(Choice):
    """When a held rung counts as failing (`ControllerConfig.raise_on`)."""
    UPPER = "upper"        # its upper bound exceeds q (no longer certified)
    LOWER = "lower"        # its lower bound exceeds q (shown failing): the certified rule


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """How the controller moves budgets along each bin's ladder of rungs.

    Attributes:
      target: alpha threshold tau; a token with alpha < target is an exceedance.
      quantile: q, the allowed exceedance rate (the trainer sets it to TrainConfig.tail_quantile).
      confidence: one-sided level of the upper bound on a bin's exceedance rate.
      decay: weight of the previous step's pooled evidence (0 = this step only).
      min_rows: decayed units (rows or prompts) with tokens in a bin before it is judged at
        all, to pass or to fail.
      min_tokens: decayed tokens in a bin before it can be shown failing (with ``raise_on =
        "lower"``). Passing - holding a rung under ``raise_on = "upper"``, taking one by a probe,
        certifying one in calibration - needs ``max(min_tokens, certify_tokens / margin)``: a
        clean bin with fewer tokens than the bound needs (~z^2/q) is undecided, not failing.
      unit: "row" or "prompt" (a GRPO group's rows summed): the independent unit.
      min_budget, max_budget: bounds of the finite rungs (multiples of the block size, at least
        3 blocks); above them every ladder ends at the dense rung.
      step_factor: ratio between rungs of the default geometric ladder.
      ladder: explicit finite rungs (tokens) instead of the geometric ladder.
      fail_memory: steps during which a rung that failed is not probed again.
      probe: replay one rung lower each step (False: budgets only ever rise).
      lower_margin: a probe passes only when its bound is at most lower_margin * q. 1 (the
        default, the certified rule): a rung is taken when certified at q. Below 1 the bar for
        lowering is stricter than the one for holding (an older rule: with ``raise_on =
        "upper"`` it held ~0.01 q in simulation, docs/mismatch.md).
      raise_on: when a held rung counts as failing (raised live; a probe marked failed):
        "lower" (the default, the certified rule) - its lower bound exceeds q (shown failing at
        ``confidence``): with lower_margin = 1 a rung is taken when certified at q and left when
        shown above q, so the rate held is q's order, not a tenth of it; "upper" - its upper
        bound exceeds q (not certified any more: holds rates well below q). docs/mismatch.md,
        "What the controller guarantees".

    The defaults are the certified rule (``lower_margin = 1``, ``raise_on = "lower"``; until
    issue 56 they were 0.5 and "upper"): every config that does not set them gets it, and
    ``sparrow calibrate`` certifies a starting table by the same rule.
    """

    target: float = 0.86
    quantile: float = 0.05
    confidence: float = 0.95
    decay: float = 0.8
    min_rows: int = 16
    min_tokens: int = 256
    unit: EvidenceUnit = EvidenceUnit.ROW
    min_budget: int = 256
    max_budget: int = 16384
    step_factor: float = 1.25
    ladder: tuple[int, ...] | None = None
    fail_memory: int = 10
    probe: bool = True
    lower_margin: float = 1.0
    raise_on: RaiseOn = RaiseOn.LOWER

    def __post_init__(self):
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile}")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.min_rows < 1 or self.min_tokens < 0 or self.fail_memory < 0:
            raise ValueError(f"min_rows >= 1, min_tokens >= 0, fail_memory >= 0 needed: {self}")
        for name, choice in (("unit", EvidenceUnit), ("raise_on", RaiseOn)):
            object.__setattr__(self, name, choice.parse(getattr(self, name),
                                                        f"ControllerConfig.{name}"))
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget {self.min_budget} > max_budget {self.max_budget}")
        if not 0.0 < self.lower_margin <= 1.0:
            raise ValueError(f"lower_margin must be in (0, 1], got {self.lower_margin}")
        if self.step_factor <= 1.0:
            raise ValueError(f"step_factor must be > 1, got {self.step_factor}")
        if self.ladder is not None:
            object.__setattr__(self, "ladder", tuple(int(b) for b in self.ladder))

    def rungs(self, block_size: int) -> tuple[int, ...]:
        """The sorted finite budgets, all within [min_budget, max_budget] (dense comes after)."""
        lo = max(-(-self.min_budget // block_size), NUM_RESERVED_BLOCKS) * block_size
        hi = max(self.max_budget // block_size * block_size, lo)
        if self.ladder is not None:
            bad = [b for b in self.ladder if b % block_size]
            if bad:
                raise ValueError(f"ladder budgets {bad} are not multiples of block_size {block_size}")
            return tuple(sorted({b for b in self.ladder if lo <= b <= hi} | {lo, hi}))
        rungs, b = [], lo
        while b < hi:
            rungs.append(b)
            b = max(b + block_size, -(-int(math.ceil(b * self.step_factor)) // block_size) * block_size)
        rungs.append(hi)
        return tuple(rungs)


def bin_ladders(schedule: Schedule, config: ControllerConfig) -> list[tuple[int, ...]]:
    """Per bin: the finite rungs below the bin's upper edge, then ``DENSE_BUDGET``.

    Bin i < last holds cached lengths up to (i + 1) * bin_size, so any budget >= that edge is
    dense attention for its tokens; the last bin is open-ended and keeps every finite rung."""
    finite = config.rungs(schedule.block_size)
    n = schedule.num_bins
    return [tuple(r for r in finite if i == n - 1 or r < (i + 1) * schedule.bin_size)
            + (DENSE_BUDGET,) for i in range(n)]


def _snap(budget: int, ladder: tuple[int, ...]) -> int:
    """The cheapest rung >= budget (a budget above every finite rung is dense)."""
    return next(r for r in ladder if r >= budget)


@dataclasses.dataclass(frozen=True)
class ControllerState:
    """Controller state; JSON-able through ``to_dict`` for checkpoints.

    Attributes:
      schedule: the current schedule (the live rollout's budgets).
      evidence: pooled evidence at each bin's current budget.
      probe_budgets: per bin, the lower rung the next replay tests (0 = none).
      probe_evidence: pooled evidence at each bin's probe budget.
      last_pass: per bin, the rung the bin was last lowered from (where it passed); a failing
        bin returns there, or to dense when it is not above the failing budget.
      last_fail: per bin, the last rung that failed (0 = never); fail_age: steps since.
      step: number of updates applied.
    """

    schedule: Schedule
    evidence: Evidence
    probe_budgets: tuple[int, ...]
    probe_evidence: Evidence
    last_pass: tuple[int, ...]
    last_fail: tuple[int, ...]
    fail_age: tuple[int, ...]
    step: int = 0

    def __post_init__(self):
        n = self.schedule.num_bins
        for field in ("probe_budgets", "last_pass", "last_fail", "fail_age"):
            value = tuple(int(v) for v in getattr(self, field))
            if len(value) != n:
                raise ValueError(f"{field} has {len(value)} entries, schedule has {n} bins")
            object.__setattr__(self, field, value)
        for field in ("evidence", "probe_evidence"):
            if len(getattr(self, field).units) != n:
                raise ValueError(f"{field} does not have {n} bins")

    @classmethod
    def initial(cls, schedule: Schedule) -> "ControllerState":
        """A fresh state at ``schedule``. Each bin's starting budget counts as its last pass
        (a warm start from a certified table passed there): a bin raised because a later bin
        fails at dense goes one rung up, not back to dense; a bin failing at its own starting
        rung goes to dense (nothing above it is known to pass)."""
        n = schedule.num_bins
        zeros = (0,) * n
        return cls(schedule, Evidence.empty(n), zeros, Evidence.empty(n),
                   tuple(int(b) for b in schedule.budgets), zeros, zeros, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_dict(), "evidence": self.evidence.to_dict(),
                "probe_budgets": list(self.probe_budgets),
                "probe_evidence": self.probe_evidence.to_dict(),
                "last_pass": list(self.last_pass), "last_fail": list(self.last_fail),
                "fail_age": list(self.fail_age), "step": self.step}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ControllerState":
        if "evidence" not in data:   # a checkpoint of the earlier single-step controller
            return dataclasses.replace(cls.initial(Schedule.from_dict(data["schedule"])),
                                       step=int(data.get("step", 0)))
        return cls(Schedule.from_dict(data["schedule"]), Evidence.from_dict(data["evidence"]),
                   tuple(data["probe_budgets"]), Evidence.from_dict(data["probe_evidence"]),
                   tuple(data["last_pass"]), tuple(data["last_fail"]), tuple(data["fail_age"]),
                   int(data["step"]))

    def replay_budgets(self) -> np.ndarray | None:
        """``[num_bins]`` budgets for the probe replay (probe rung where one is proposed, the
        current budget elsewhere), or None when no bin has a probe."""
        probe = np.asarray(self.probe_budgets, np.int64)
        if not probe.any():
            return None
        return np.where(probe > 0, probe, np.asarray(self.schedule.budgets, np.int64))


def certify_tokens(config: ControllerConfig) -> float:
    """Tokens without a single exceedance that the bound needs to pass a bin at all
    (Wilson: z^2 (1 - q) / q). With fewer, a clean bin is undecided, not failing."""
    z = NormalDist().inv_cdf(config.confidence)
    return z * z * (1.0 - config.quantile) / config.quantile


def _judge(ev: Evidence, config: ControllerConfig, margin: float = 1.0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(upper bound [nb], enough evidence [nb], above [nb]) for pooled evidence: enough to
    certify a clean bin at margin * q, and the upper bound above margin * q."""
    ub = upper_bound(ev, config.confidence)
    need = max(float(config.min_tokens), certify_tokens(config) / margin)
    enough = (np.asarray(ev.units) >= config.min_rows) & (np.asarray(ev.tokens) >= need)
    return ub, enough, enough & (ub > margin * config.quantile)


def certifies(ev: Evidence, config: ControllerConfig) -> tuple[np.ndarray, np.ndarray]:
    """(upper bound [nb], certified [nb]): the rule a rung must pass to be taken - by a probe
    replay here, by ``sparrow calibrate``'s starting table (``calibration.certify_schedule``):
    at least ``min_rows`` units and the tokens to certify a clean bin, and the one-sided
    ``confidence`` upper bound on the exceedance rate at most ``lower_margin * q``."""
    ub, enough, above = _judge(ev, config, config.lower_margin)
    return ub, enough & ~above


def _failing(ev: Evidence, config: ControllerConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(upper bound [nb], enough [nb], failing [nb]) by ``config.raise_on``: "upper" = not
    certified at q (the bound of ``_judge``), "lower" = the lower bound above q (min_rows units
    and min_tokens tokens suffice: failure needs no certification volume)."""
    ub, enough, above = _judge(ev, config)
    if config.raise_on == RaiseOn.UPPER:
        return ub, enough, above
    basic = (np.asarray(ev.units) >= config.min_rows) & (np.asarray(ev.tokens) >= config.min_tokens)
    return ub, enough, basic & (lower_bound(ev, config.confidence) > config.quantile)


def controller_update(state: ControllerState, hits, tokens, config: ControllerConfig, *,
                      probe_hits=None, probe_tokens=None, downstream: bool = True
                      ) -> tuple[ControllerState, dict[str, Any]]:
    """One controller step (pure; host-side NumPy).

    Args:
      state: current state.
      hits, tokens: ``[U, num_bins]`` per unit (row or prompt) exceedances (alpha < target) and
        tokens, measured at ``state.schedule``'s budgets (``evidence.exceedance_counts``).
      config: controller settings.
      probe_hits, probe_tokens: the same from the replay at ``state.replay_budgets()`` (None:
        no replay this step; only bins with a probe budget read them).
      downstream: the bins are the length bins of one sequence, so a bin's budget acts on the
        bins after it (a failing replay blocks the probes before it, a witness implicates one,
        a bin failing at dense raises the bins before it). False: every bin is an independent
        run of one bin - what ``sparsity.simulation`` runs many of in one call.
    Returns:
      (new state, info): NumPy ``budgets_before``, ``budgets``, ``upper_bound``, ``probe_upper``
      and bool masks ``failing`` (bound above q at the live budget: below target), ``undecided``
      (not enough evidence), ``raised``, ``lowered``, ``at_dense``, ``failing_dense``
      (failing at the dense rung: the sparse bins before it are the cause, or the rollout's
      numerical noise floor when none is left), ``probe_failed``, ``replay_failing`` (bins
      failing in the replay), ``raised_upstream`` (raised because a later bin failed at
      dense), plus ``num_changed``.
    """
    sched = state.schedule
    n = sched.num_bins
    hits, tokens = np.asarray(hits), np.asarray(tokens)
    if hits.ndim != 2 or hits.shape != tokens.shape or hits.shape[1] != n:
        raise ValueError(f"hits {hits.shape} / tokens {tokens.shape} must both be [units, {n}]")
    ladders = bin_ladders(sched, config)
    before = np.asarray(sched.budgets, np.int64)
    current = np.asarray([_snap(int(b), lad) for b, lad in zip(before, ladders)], np.int64)
    ev = state.evidence.combine(Evidence.from_counts(hits, tokens), config.decay)
    ub, enough, failing = _failing(ev, config)
    probe = np.asarray(state.probe_budgets, np.int64)
    pev = state.probe_evidence
    if probe_hits is not None:
        pev = pev.combine(Evidence.from_counts(probe_hits, probe_tokens), config.decay,
                          keep=probe > 0)
    pub, penough, pfail = _failing(pev, config)        # the probed rung fails (raise_on)
    ppass = certifies(pev, config)[1]                  # ... passes the lowering bar

    has_probe = (probe > 0) & (probe_hits is not None)
    # The replay's verdict on every bin at its replay budget: probed bins by their pooled probe
    # evidence, the others (witnesses at their current budget) by this step's replay alone.
    # Sparsity propagates downstream - a token's K/V in later layers come from hidden states
    # computed with the budget of *its* bin - so a lowered bin can push any later bin below
    # target, also one at the dense rung. A probe is accepted only when no bin at or after it
    # fails in the replay.
    replay_fail = np.zeros(n, bool)
    if probe_hits is not None:
        replay_fail = np.where(has_probe, pfail,
                               _failing(Evidence.from_counts(probe_hits, probe_tokens), config)[2])
    blocked = np.flip(np.logical_or.accumulate(np.flip(replay_fail))) if downstream else replay_fail
    # A witness failing in the replay implicates the probes upstream of it: the nearest one is
    # marked failed, so the next replay tests a different set (one suspect fewer per step).
    implicated = np.zeros(n, bool)
    for k in np.flatnonzero(replay_fail & ~has_probe & downstream):
        upstream = np.flatnonzero(has_probe[:k])
        if upstream.size:
            implicated[upstream[-1]] = True
    last_pass = np.asarray(state.last_pass, np.int64)
    last_fail = np.asarray(state.last_fail, np.int64)
    fail_age = np.asarray(state.fail_age, np.int64) + 1
    budgets = current.copy()
    reset = np.zeros(n, bool)          # evidence at the (new) budget starts empty
    carry = np.zeros(n, bool)          # evidence at the new budget = the probe's
    probe_failed = has_probe & (pfail | implicated)
    lowered = np.zeros(n, bool)
    for i in range(n):
        b = int(current[i])
        if failing[i]:
            if b < DENSE_BUDGET:
                budgets[i] = last_pass[i] if last_pass[i] > b else DENSE_BUDGET
                last_pass[i] = DENSE_BUDGET
                reset[i] = True
            last_fail[i], fail_age[i] = b, 0
        elif (enough[i] and has_probe[i] and ppass[i] and not probe_failed[i]
              and not blocked[i] and probe[i] < b):
            budgets[i], last_pass[i], carry[i], lowered[i] = probe[i], b, True, True
        if probe_failed[i]:       # the probed rung fails: remember it (with a live failure)
            recent = int(last_fail[i]) if fail_age[i] == 0 else 0
            last_fail[i], fail_age[i] = max(int(probe[i]), recent), 0
    # A bin failing live at the dense rung is not failing because of its own budget: the
    # sparse bins upstream of it return to the rung they last passed at (or the next rung up).
    raised_upstream = np.zeros(n, bool)
    dense_fail = failing & (current >= DENSE_BUDGET)
    if downstream and dense_fail.any():
        for j in range(int(np.flatnonzero(dense_fail)[-1])):
            if budgets[j] >= DENSE_BUDGET or budgets[j] > current[j]:
                continue            # dense, or already raised by its own failure
            up = [r for r in ladders[j] if r > budgets[j]]
            target = int(last_pass[j]) if last_pass[j] > budgets[j] else up[0]
            last_fail[j], fail_age[j] = int(budgets[j]), 0
            budgets[j], last_pass[j] = target, DENSE_BUDGET
            reset[j], carry[j], lowered[j], raised_upstream[j] = True, False, False, True
    empty = Evidence.empty(n)
    new_ev = ev.select(~reset, empty).select(~carry, pev)
    # The next probe: one rung below the (new) budget, unless that rung failed recently.
    next_probe = np.zeros(n, np.int64)
    if config.probe:
        for i in range(n):
            lad = ladders[i]
            below = [r for r in lad if r < budgets[i]]
            if not below:
                continue
            cand = below[-1]
            if cand <= last_fail[i] and fail_age[i] < config.fail_memory:
                continue
            next_probe[i] = cand
    same_probe = (next_probe == probe) & ~probe_failed & ~carry & ~reset
    new_pev = pev.select(same_probe & (next_probe > 0), empty)
    new_sched = dataclasses.replace(sched, budgets=tuple(int(b) for b in budgets))
    new_state = ControllerState(new_sched, new_ev, tuple(next_probe), new_pev, tuple(last_pass),
                                tuple(last_fail), tuple(fail_age), state.step + 1)
    at_dense = current >= DENSE_BUDGET
    info = {"budgets_before": before, "budgets": budgets.copy(), "upper_bound": ub,
            "probe_upper": np.where(has_probe, pub, np.nan), "failing": failing,
            "undecided": ~enough, "raised": budgets > current, "lowered": lowered,
            "at_dense": at_dense, "failing_dense": failing & at_dense,
            "probe_failed": probe_failed, "replay_failing": replay_fail,
            "raised_upstream": raised_upstream, "num_changed": int(np.sum(budgets != before))}
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

    def replay_budgets(self) -> np.ndarray | None:
        return self.state.replay_budgets() if self.config.probe else None

    def update(self, hits, tokens, probe_hits=None, probe_tokens=None) -> dict[str, Any]:
        self.state, info = controller_update(self.state, hits, tokens, self.config,
                                             probe_hits=probe_hits, probe_tokens=probe_tokens)
        return info

    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    @classmethod
    def from_state_dict(cls, data: dict[str, Any],
                        config: ControllerConfig | None = None) -> "ScheduleController":
        state = ControllerState.from_dict(data)
        return cls(state.schedule, config, state)
