"""One RL step: prompts -> rollout -> rewards -> learner -> mismatch tail -> controller.

`rl_step(plan, stages, step, timer)` reads top to bottom in one place: the run's settings come
from its `RunPlan` (train/plan.py), the built stages from `Stages` (the trainer builds them once
per run), and it returns the step's metrics with the policy updated. Each stage hands the next a
typed value: `PromptBatch`-like prompts, `Trajectories`, the rewards' report, the learner's
per-token analysis.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from sparrow_jax.rewards import scoring
from sparrow_jax.rewards.pool import RewardPool, RewardReport
from sparrow_jax.rl.actor import RolloutActor
from sparrow_jax.rl.distill import Distiller
from sparrow_jax.rl.learner import Learner
from sparrow_jax.rollout.api import generate_timed
from sparrow_jax.rollout.batching import rollout_in_sub_batches, trim_to_bucket
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.runtime import compile_cache, faults, multihost
from sparrow_jax.runtime.checkpoint import CheckpointManager, last_checkpoint_phrase
from sparrow_jax.runtime.metrics import StepTimer
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import mismatch
from sparrow_jax.sparsity.controller import ScheduleController
from sparrow_jax.train import exact_step, schedule_step
from sparrow_jax.train.exact_replan import Replanner
from sparrow_jax.train.plan import RunPlan

__all__ = ["Stages", "rl_step", "check_rewards"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Stages:
    """The built stages one RL step runs. The controller and the checkpoint manager carry the
    run's state across steps; everything else is fixed for the run."""
    data: Any                          # data.prompts.PromptIterator: the next prompt batch
    tokenizer: Any
    actor: RolloutActor
    rollout: RolloutConfig             # the plan's, with the tokenizer's stop and pad ids
    spec: ShardingSpec | None
    rewards: RewardPool
    diagnostics: Mapping[str, RewardPool]
    learner: Learner
    controller: ScheduleController
    distiller: Distiller | None
    checkpoints: CheckpointManager     # a stop request while the rewards were scored
    # exact_sparse re-planning (`RolloutConfig.replan_every`): the run's per-bin gamma plan,
    # which `rollout` already runs; None when off.
    replanner: Replanner | None = None


def _scalars(prefix: str, d: Mapping[str, Any]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in d.items() if np.ndim(v) == 0}


def rl_step(plan: RunPlan, stages: Stages, step: int, timer: StepTimer) -> dict[str, float]:
    """RL step number `step + 1` (`step` steps done); returns its metrics."""
    cfg, n = plan.train, plan.train.group_size
    ctrl = stages.controller
    sched = ctrl.schedule
    budgets = np.asarray(sched.budgets, np.int32)
    with timer("data"):
        batch = next(stages.data)
    rng = jax.random.fold_in(jax.random.key(cfg.seed), step)
    # -- rollout: group_size samples per prompt, sparse at the schedule's budgets ------------
    with timer("rollout"):
        actor = stages.actor.model()

        def generate(sub, i):
            compiled = compile_cache.compile_seconds()
            traj, seconds = generate_timed(
                actor, sub.prompt_ids, sub.prompt_lengths, cfg=stages.rollout, budgets=budgets,
                bin_size=sched.bin_size, group_size=n, rng=jax.random.fold_in(rng, i),
                spec=stages.spec)
            # Re-planning: the call's rounds per branch and time, unless it compiled (its time
            # would be the compile's; the run's first step compiles, so never counted).
            if (stages.replanner is not None and step > 0
                    and compile_cache.compile_seconds() == compiled):
                counts = multihost.local_rows(traj.round_counts)[0]
                stages.replanner.observe_call(step + 1, np.asarray(counts), seconds)
            return traj, seconds
        traj, seconds = rollout_in_sub_batches(generate, batch, cfg.rollout_batch_prompts)
    # -- rewards ----------------------------------------------------------------------------
    samples = batch.per_sample(n)       # the rollout's rows: group_size per prompt
    answers, prompts, metas = samples.answers, samples.prompts, samples.metas
    with timer("reward"):
        texts = scoring.decode_responses(stages.tokenizer, traj)
        report = scoring.score(stages.rewards, texts, answers, prompts, metas)
    rewards = report.rewards
    if report.errors or report.timeouts:    # scored 0, counted in reward/errors|timeouts
        log.warning("step %d: %d reward errors, %d timeouts (scored 0)%s", step + 1,
                    report.errors, report.timeouts,
                    "" if report.first_error is None else f"; first error: {report.first_error}")
    # Every process's counts (the decision to stop is the same on all of them).
    counts = multihost.all_rows(np.asarray([[report.timeouts, report.errors, len(texts),
                                             report.crashed]]))
    check_rewards(plan, stages, step, report, counts.sum(axis=0), batch.ids, texts, answers)
    # -- learner: dense logprobs + alpha, GRPO update ----------------------------------------
    with timer("learner"):
        # The learner works on the batch's longest sequence rounded up to a bucket.
        traj = trim_to_bucket(traj, plan.length_buckets, multiple=stages.rollout.block_size)
        # Advantages need whole groups; a process's rows are whole groups of its prompts.
        rows = (multihost.rows_to_global(rewards.astype(np.float32), stages.spec)
                if multihost.is_multiprocess() else rewards)

        def distill(mini_batch, index, num_mini):
            """The adapter's update after each base optimizer step (base frozen)."""
            with timer("distill"):
                return stages.distiller.update(mini_batch, index, num_mini, budgets)
    # -- controller replay: the probe budgets' alpha, before the update (the sampling policy)
    with timer("probe"):
        probe = probe_alpha(plan, stages, traj, actor)
    with timer("learner"):
        # The alpha replay runs the actor that sampled (merged adapter, if any).
        analysis, loss_metrics = stages.learner.step(
            traj, stages.learner.advantages(rows), budgets, plan.replay,
            sparse_model=actor if stages.distiller else None,
            after_step=distill if stages.distiller else None)
        stages.actor.policy_changed()      # recast before the next rollout
    # -- metrics over every process's rows ---------------------------------------------------
    rewards = multihost.all_rows(rewards)
    lengths = multihost.all_rows(multihost.local_rows(traj.response_lengths))
    m = {"reward/mean": float(rewards.mean()), "reward/timeouts": int(counts[:, 0].sum()),
         "reward/errors": int(counts[:, 1].sum()),
         "reward/error_share": float(counts[:, 1].sum() / max(1, counts[:, 2].sum())),
         "response/length_mean": float(lengths.mean()),
         "response/length_max": float(lengths.max()),
         "rollout/tokens_per_s": float(lengths.sum() / seconds), **loss_metrics}
    for name, pool in stages.diagnostics.items():
        diag = scoring.score(pool, texts, answers, prompts, metas).rewards
        m[f"reward/{name}"] = float(multihost.all_rows(diag).mean())
    # -- mismatch tail per bin -> the schedule controller ------------------------------------
    if analysis.alpha is not None:
        m.update(tail_metrics(plan, sched, analysis.alpha, analysis.logp_old, traj))
        # A skipped (non-finite) update's tails are not evidence about the policy.
        if plan.adapts and not loss_metrics.get("learner/skipped_updates"):
            live = schedule_step.counts(ctrl, analysis.alpha, traj, n)
            replayed = (None, None) if probe is None else schedule_step.counts(ctrl, probe, traj, n)
            m.update(schedule_step.step_metrics(ctrl.update(*live, *replayed),
                                                ctrl.config.quantile))
    # The whole model's KV read (dense layers included; 1 for dense rollout), overall and per bin.
    layers = stages.actor.policy.config.num_hidden_layers
    sparse_layers = stages.rollout.num_sparse_layers(layers)
    m.update(schedule_step.kv_read(traj.budgets, traj.cached_lengths, traj.mask,
                                   num_layers=layers, num_sparse_layers=sparse_layers,
                                   bin_size=sched.bin_size, num_bins=len(budgets)))
    if plan.mode == RolloutMode.SPARSE:     # the sparse layers' share, under its older name
        m["schedule/kv_fraction"] = m["kv/read_sparse_layers"]
    m.update(schedule_step.budget_metrics(ctrl.schedule))
    if plan.mode == RolloutMode.EXACT_SPARSE:
        # The samples are the dense policy's: no mismatch, TIS weights 1 (checked here), and
        # the draft's acceptance per bin beside its alpha prediction.
        rc = stages.rollout
        gamma = rc.gamma_by_bin or rc.gamma
        rows = exact_step.acceptance_rows(traj, gamma=gamma, bin_size=sched.bin_size)
        m.update(exact_step.acceptance_metrics(
            traj, budgets, gamma=gamma, bin_size=sched.bin_size, num_layers=layers,
            num_sparse_layers=sparse_layers, rows=rows))
        m.update(exact_step.logprob_agreement(traj, analysis.logp_old))
        if stages.replanner is not None:     # the plan for the next steps, every N steps
            stages.replanner.observe_rounds(rows)
            done = stages.replanner.replan(step + 1) if stages.replanner.due(step + 1) else None
            m.update(stages.replanner.metrics(done))
    return m


def tail_metrics(plan: RunPlan, sched, alpha, logp_dense, traj: Trajectories
                 ) -> dict[str, float]:
    """The mismatch summary (`alpha/*`) and the per-bin tail and token counts of one batch."""
    summary = mismatch.mismatch_summary(
        alpha, traj.cached_lengths, traj.mask, bin_size=sched.bin_size, num_bins=sched.num_bins,
        quantile=plan.train.tail_quantile, logp_sparse=traj.logprobs, logp_dense=logp_dense)
    tail, counts = np.asarray(summary.pop("tail")), np.asarray(summary.pop("counts"))
    m = _scalars("alpha", summary)
    for b in np.nonzero(counts)[0]:
        m[f"alpha_tail/bin_{b:02d}"] = float(tail[b])
        m[f"alpha_count/bin_{b:02d}"] = float(counts[b])
    return m


def check_rewards(plan: RunPlan, stages: Stages, step: int, report: RewardReport,
                  totals: np.ndarray, prompt_ids: Sequence[Any], texts: Sequence[str],
                  answers: Sequence[str]) -> None:
    """Stops the run (RunError, before the update: nothing of this step is saved) when
    - reward workers died while the run was stopping (SIGTERM/Ctrl-C reached them): the step's
      rewards would be zeros that no completion earned;
    - more than TrainConfig.max_reward_error_share of the rewards raised, or any did in the
      run's first step: a reward bug (a wrong signature fails on every completion) would
      otherwise train on zero reward to the end.
    `totals`: [timeouts, errors, rows, crashed workers] over every process."""
    cfg, ckpt = plan.train, stages.checkpoints
    step_no, errors, rows, crashed = step + 1, int(totals[1]), int(totals[2]), int(totals[3])
    if crashed and ckpt.stop_requested:
        raise faults.RunError(
            f"{ckpt.stop_reason}: {crashed} reward worker(s) died while step {step_no}'s "
            f"rewards were scored, so the step is not saved (its rewards would be 0); "
            f"{last_checkpoint_phrase(ckpt.latest_step())}")
    limit = cfg.max_reward_error_share
    share = errors / max(1, rows)
    first = step == 0
    if not errors or limit >= 1 or (share <= limit and not first):
        return
    why = ("in the run's first step any error stops it" if first and share <= limit else
           f"more than TrainConfig.max_reward_error_share = {limit}")
    where = ""
    if report.first_error_index is not None:
        i = report.first_error_index
        prompt_id = prompt_ids[i // cfg.group_size]
        where = (f" First failure: row {i} (prompt id {prompt_id!r}, answer {answers[i]!r:.80}, "
                 f"completion {texts[i]!r:.160}):\n{report.first_traceback.rstrip()}")
    raise faults.RunError(
        f"step {step_no}: {errors} of {rows} rewards raised an error ({share:.1%}; {why}), "
        f"so the run stops before this step's update (nothing of it is saved). Fix the reward "
        f"function (TrainConfig.reward = {cfg.reward!r}), or raise "
        f"TrainConfig.max_reward_error_share to train on through such errors.{where}")


def probe_alpha(plan: RunPlan, stages: Stages, traj: Trajectories, actor):
    """alpha [B, T] of the batch replayed teacher-forced at the controller's probe budgets
    (one rung lower in the bins being considered), or None: no bin is considered, or no
    full-vocabulary alpha (lowering then never happens)."""
    if not plan.probes:
        return None
    budgets = stages.controller.replay_budgets()
    if budgets is None:
        return None
    return stages.learner.analyze(traj, budgets.astype(np.int32), plan.replay,
                                  sparse_model=actor if stages.distiller else None).alpha
