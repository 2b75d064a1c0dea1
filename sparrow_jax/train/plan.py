"""The run's configuration, resolved once: `RunPlan`.

gin builds each configurable on its own (`TrainConfig`, `RolloutConfig`, `LearnerConfig`,
`LossConfig`, the schedule, `ControllerConfig`, `DistillConfig`, `ReferenceEvalConfig`), but a
run's settings depend on each other: the rollout's mode is the run's, the selection width
follows the schedule's budgets, the controller targets the trainer's tail quantile, dense and
exact-sparse rollouts have no mismatch to measure. This module is the one place that derives
them. `resolve` is a pure function of the configs; `from_gin` builds every configurable with its
gin bindings and resolves them. The trainer, the compile plan (`train/compile_plan.py`),
`sparrow dryrun` and the benches read the same plan (tests/test_run_plan.py compares them on
every shipped config), so a dryrun reports the memory of the run `sparrow train` starts.

What is derived, and why:
- **the mode**: `TrainConfig.rollout_mode` and `RolloutConfig.mode` are one setting (`run_mode`):
  bind either; two different bound values are refused, naming both.
- **the selection width** (`RolloutConfig.max_budget`, the tokens a sparse step gathers):
  narrowed to the largest budget the run can reach (`RolloutConfig.fit_selection_width`); for
  sparse rollouts under the controller that includes its highest finite rung, capped at the
  width the user set.
- **the controller**: its quantile is `TrainConfig.tail_quantile` (one setting again), its
  finite rungs end at the selection width; it runs for sparse rollouts only.
- **the learner's alpha**: a dense or exact-sparse rollout samples the dense policy, so there is
  no sparse replay to compare ("full" becomes "none"); the rollout records the vocabulary top-k
  only when alpha reads it (`RolloutConfig.for_alpha_mode`).
- **held-out evaluation modes**: the dense policy, and the actor as training samples it.
- **the controller's probe replay**, **DistillSparse** (sparse actors only), the learner's
  length buckets and the sparse replay's layout.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sparrow_jax.evaluation.reference import ReferenceEvalConfig
from sparrow_jax.rl.distill import DistillConfig
from sparrow_jax.rl.grpo import LossConfig
from sparrow_jax.rl.learner import LearnerConfig, SparseReplay, analysis_fused
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.runtime.shapes import default_buckets
from sparrow_jax.sparsity.controller import ControllerConfig
from sparrow_jax.sparsity.schedule import Schedule, make_schedule
from sparrow_jax.train.config import ConfigError, TrainConfig, gin_value
from sparrow_jax.sparsity.mismatch import AlphaMode

__all__ = ["RunPlan", "resolve", "from_gin", "run_mode", "log_plan"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Every setting of one `sparrow train` run, derived once (module docstring).

    `rollout` holds no tokenizer ids (stop tokens, padding): the trainer adds them from the
    model's tokenizer (`RolloutConfig` fields `stop_token_ids`, `pad_token_id`); they change no
    program shape."""
    train: TrainConfig                # rollout_mode = `mode`
    rollout: RolloutConfig            # mode, selection width and top-k record fitted
    learner: LearnerConfig            # alpha_mode fitted
    loss: LossConfig
    schedule: Schedule                # the starting schedule
    controller: ControllerConfig      # quantile and finite rungs fitted
    distill: DistillConfig
    reference: ReferenceEvalConfig
    replay: SparseReplay              # how the learner replays the rollout's selection
    length_buckets: tuple[int, ...]   # response lengths the learner pads a batch to
    eval_modes: tuple[RolloutMode, ...]
    adapts: bool                      # the schedule controller runs
    probes: bool                      # ... and may replay the batch at cheaper budgets
    distills: bool                    # a DistillSparse adapter trains
    # What was derived, for the log (`log_plan`); not part of the plan's identity.
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @property
    def mode(self) -> RolloutMode:
        return self.rollout.mode

    def fused(self, rows: int) -> bool:
        """Whether the learner's analysis runs inside its gradient program for a step of
        `rows` rollouts (over all processes): `rl.learner.analysis_fused`."""
        return analysis_fused(self.learner, self.loss, rows)


def run_mode(train_mode: str, rollout_mode: str, *, train_bound: bool,
             rollout_bound: bool) -> RolloutMode:
    """The run's one rollout mode from `TrainConfig.rollout_mode` and `RolloutConfig.mode`.

    `*_bound`: whether the user set that one (a gin binding, or a TrainConfig built with a
    non-default mode). The set one wins; both set to different modes is a ConfigError naming
    both, since either reading would silently ignore the other."""
    if train_bound and rollout_bound and train_mode != rollout_mode:
        raise ConfigError([
            f"TrainConfig.rollout_mode = {str(train_mode)!r} and RolloutConfig.mode = "
            f"{str(rollout_mode)!r} disagree: they are one setting (the run's rollout mode); "
            "bind one of them"], "rollout mode")
    mode = rollout_mode if rollout_bound and not train_bound else train_mode
    return RolloutMode.parse(mode, "TrainConfig.rollout_mode")


def _one_quantile(train: TrainConfig, controller: ControllerConfig, bound: bool
                  ) -> ControllerConfig:
    """The controller targets the trainer's tail quantile (q in P(alpha < tau) <= q)."""
    if bound and controller.quantile != train.tail_quantile:
        raise ConfigError([
            f"ControllerConfig.quantile = {controller.quantile} and TrainConfig.tail_quantile = "
            f"{train.tail_quantile} disagree: the controller targets the tail the trainer "
            "reports; set TrainConfig.tail_quantile"], "controller")
    return dataclasses.replace(controller, quantile=train.tail_quantile)


def resolve(train: TrainConfig, rollout: RolloutConfig, learner: LearnerConfig,
            loss: LossConfig, schedule: Schedule, controller: ControllerConfig,
            distill: DistillConfig, reference: ReferenceEvalConfig, *,
            train_mode_bound: bool = True, rollout_mode_bound: bool = False,
            quantile_bound: bool = False) -> RunPlan:
    """The plan of these configs (pure: no gin, no logging; see the module docstring).

    `*_bound`: whether the user set `TrainConfig.rollout_mode`, `RolloutConfig.mode`,
    `ControllerConfig.quantile` (`run_mode`; by default the trainer's mode applies). Raises
    ConfigError / ValueError on settings that cannot work together."""
    notes: list[str] = []
    warnings: list[str] = []
    mode = run_mode(train.rollout_mode, rollout.mode, train_bound=train_mode_bound,
                    rollout_bound=rollout_mode_bound)
    train = dataclasses.replace(train, rollout_mode=mode)
    rollout = dataclasses.replace(rollout, mode=mode)
    controller = _one_quantile(train, controller, quantile_bound)
    adapts = train.adapt_schedule and mode == RolloutMode.SPARSE
    if loss.kl_coef != 0.0:
        # grpo.policy_loss adds the k3 KL only beside a reference policy's logprobs, which the
        # trainer never computes: the setting would be silently ignored.
        raise ConfigError([f"LossConfig.kl_coef = {loss.kl_coef} has no effect in sparrow train: "
                           "the learner keeps no reference policy to take a KL to (the recipe "
                           "trains without a KL term); remove the setting or set it to 0"],
                          "loss")
    if (rollout.replan_gammas or rollout.replan_every) and mode != RolloutMode.EXACT_SPARSE:
        raise ConfigError([f"RolloutConfig.replan_gammas = {rollout.replan_gammas} / "
                           f"replan_every = {rollout.replan_every} re-plan exact_sparse "
                           f"rollouts, but the mode is {str(mode)!r}: unset them or use "
                           "rollout_mode 'exact_sparse'"], "rollout")
    if rollout.gamma_by_bin:
        if mode != RolloutMode.EXACT_SPARSE:
            raise ConfigError([f"RolloutConfig.gamma_by_bin = {rollout.gamma_by_bin} is a plan "
                               f"for exact_sparse rollouts, but the mode is {str(mode)!r}: "
                               "unset it or use rollout_mode 'exact_sparse'"], "rollout")
        if len(rollout.gamma_by_bin) > schedule.num_bins:
            raise ConfigError([f"RolloutConfig.gamma_by_bin has {len(rollout.gamma_by_bin)} "
                               f"entries but the schedule has {schedule.num_bins} length bins: "
                               "give one per bin (the last holds beyond)"], "rollout")
    if rollout.approximate_from_bin:
        k = rollout.approximate_from_bin
        if mode != RolloutMode.EXACT_SPARSE:
            raise ConfigError([f"RolloutConfig.approximate_from_bin = {k} is part of a plan for "
                               f"exact_sparse rollouts, but the mode is {str(mode)!r}: unset "
                               "it or use rollout_mode 'exact_sparse'"], "rollout")
        if k >= schedule.num_bins:
            raise ConfigError([f"RolloutConfig.approximate_from_bin = {k} but the schedule has "
                               f"{schedule.num_bins} length bins (0-{schedule.num_bins - 1}): "
                               "no bin would decode approximately; unset it or name a bin"],
                              "rollout")
    if mode == RolloutMode.SPARSE:
        also = 0
        if adapts:
            if controller.max_budget > rollout.max_budget:
                notes.append(f"controller: finite rungs capped at the selection width "
                             f"{rollout.max_budget} (from ControllerConfig.max_budget "
                             f"{controller.max_budget}); above them, the dense rung")
                controller = dataclasses.replace(
                    controller, max_budget=rollout.max_budget,
                    min_budget=min(controller.min_budget, rollout.max_budget))
            also = controller.max_budget
        rollout, note = rollout.fit_selection_width(schedule.budgets, also=also)
        notes += [note] if note else []
    elif mode == RolloutMode.EXACT_SPARSE:
        if train.adapt_schedule:
            notes.append("exact_sparse rollout: the schedule controller does not run (the "
                         "samples are the dense policy's: no mismatch tail to control); drafts "
                         "use the schedule's budgets as they are")
        if schedule.is_dense:
            warnings.append("exact_sparse rollout: every schedule budget is the dense rung, so "
                            "the drafts attend densely (every draft is accepted; no KV read is "
                            "saved)")
        rollout, note = rollout.fit_selection_width(schedule.budgets)
        notes += [note] if note else []
        if rollout.replan_every:
            notes.append(f"exact_sparse rollout: the gamma per length bin is re-fitted every "
                         f"{rollout.replan_every} steps among {list(rollout.round_gammas)} from "
                         "the run's measured alpha and round costs (train/exact_replan.py)")
        notes.append(f"exact_sparse rollout: gamma per length bin {list(rollout.gamma_by_bin)} "
                     f"(0: dense decoding), draft budgets {list(schedule.budgets)}"
                     if rollout.gamma_by_bin else
                     f"exact_sparse rollout: gamma {rollout.gamma} drafts per dense verify "
                     f"pass, draft budgets {sorted(set(schedule.budgets))}")
        if rollout.approximate_from_bin:
            k = rollout.approximate_from_bin
            notes.append(f"exact_sparse rollout: length bins {k}+ decode approximately sparse "
                         f"at budgets {list(schedule.budgets[k:])} (unverified drafts, not the "
                         "dense policy's samples: the learner's TIS corrects them; the "
                         "controller does not run, so nothing re-certifies those budgets "
                         "during the run)")
    # Dense and exact-sparse samples are the dense policy's: no sparse replay to compare.
    if (mode in (RolloutMode.DENSE, RolloutMode.EXACT_SPARSE)
            and learner.alpha_mode == AlphaMode.FULL):
        learner = dataclasses.replace(learner, alpha_mode="none")
    # The vocabulary top-k is recorded per token only when the learner's alpha reads it.
    rollout = rollout.for_alpha_mode(learner.alpha_mode)
    distills = distill.enabled and mode == RolloutMode.SPARSE
    if distill.enabled and not distills:
        warnings.append(f"DistillConfig.rank = {distill.rank} ignored: a {mode} rollout has no "
                        "sparse actor to adapt")
    replay = SparseReplay(bin_size=schedule.bin_size,
                          max_selected=rollout.max_budget // rollout.block_size,
                          block_size=rollout.block_size, dense_layers=tuple(rollout.dense_layers),
                          mode=RolloutMode.COMPRESS if mode == RolloutMode.COMPRESS
                          else RolloutMode.SPARSE)
    actor = mode if mode in (RolloutMode.COMPRESS, RolloutMode.EXACT_SPARSE) else RolloutMode.SPARSE
    return RunPlan(
        train=train, rollout=rollout, learner=learner, loss=loss, schedule=schedule,
        controller=controller, distill=distill, reference=reference, replay=replay,
        length_buckets=tuple(learner.length_buckets or default_buckets(
            rollout.max_new_tokens, multiple=rollout.block_size)),
        eval_modes=(RolloutMode.DENSE, actor), adapts=adapts,
        probes=adapts and learner.alpha_mode == AlphaMode.FULL, distills=distills,
        notes=tuple(notes), warnings=tuple(warnings))


def _bound(name: str) -> bool:
    return gin_value(name) is not None


def from_gin(train: TrainConfig | None = None) -> RunPlan:
    """The plan of the parsed gin configuration (each configurable built with its bindings);
    `train`: a TrainConfig built by the caller instead of from gin."""
    given = train is not None
    train = train if given else TrainConfig()
    return resolve(train, RolloutConfig(), LearnerConfig(), LossConfig(), make_schedule(),
                   ControllerConfig(), DistillConfig(), ReferenceEvalConfig(),
                   train_mode_bound=_bound("TrainConfig.rollout_mode") or (
                       given and train.rollout_mode != RolloutMode.SPARSE),
                   rollout_mode_bound=_bound("RolloutConfig.mode"),
                   quantile_bound=_bound("ControllerConfig.quantile"))


def log_plan(plan: RunPlan, logger: Any = log) -> None:
    """What the plan derived, one line each (the run's log says why a setting changed)."""
    for line in plan.notes:
        logger.info("%s", line)
    for line in plan.warnings:
        logger.warning("%s", line)
