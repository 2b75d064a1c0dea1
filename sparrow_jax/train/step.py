"""One RL step of a built `Trainer`: rollout -> rewards -> learner -> mismatch tail -> controller.

A function of the trainer (not a method) so the step reads top to bottom in one place; it
returns the step's metrics and leaves the trainer's policy updated.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from sparrow_jax.evaluation import heldout as evaluation
from sparrow_jax.rollout.batching import rollout_in_sub_batches, trim_to_bucket
from sparrow_jax.runtime import faults, multihost
from sparrow_jax.runtime.metrics import StepTimer
from sparrow_jax.sparsity import mismatch
from sparrow_jax.train import exact_step, schedule_step

log = logging.getLogger(__name__)


def _scalars(prefix: str, d: dict) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in d.items() if np.ndim(v) == 0}


def rl_step(self, timer: StepTimer) -> dict[str, float]:
    """One RL step of trainer `self`; returns its metrics."""
    cfg, sched = self.cfg, self.controller.schedule
    budgets = np.asarray(sched.budgets, np.int32)
    with timer("data"):
        batch = next(self.data)
    rng = jax.random.fold_in(jax.random.key(cfg.seed), self.step)
    with timer("rollout"):
        actor = self.rollout_model()

        def generate(sub, i):
            return evaluation.timed_generate(
                actor, sub, cfg=self.rollout_cfg, budgets=budgets, bin_size=sched.bin_size,
                group_size=cfg.group_size, rng=jax.random.fold_in(rng, i), spec=self.spec)
        traj, seconds = rollout_in_sub_batches(generate, batch, cfg.rollout_batch_prompts)
    n = cfg.group_size
    answers = [a for a in batch["answers"] for _ in range(n)]
    prompts = [p for p in batch["prompts"] for _ in range(n)]
    metas = [m for m in batch["metas"] for _ in range(n)]
    with timer("reward"):
        texts = evaluation.decode_responses(self.tokenizer, traj)
        rewards, info = evaluation.score(self.pool, texts, answers, prompts, metas)
    if info["errors"] or info["timeouts"]:    # scored 0, counted in reward/errors|timeouts
        log.warning("step %d: %d reward errors, %d timeouts (scored 0)%s", self.step + 1,
                    info["errors"], info["timeouts"],
                    f"; first error: {info['first_error']}" if "first_error" in info else "")
    # Every process's counts (the decision to stop is the same on all of them).
    counts = multihost.all_rows(np.asarray([[info["timeouts"], info["errors"], len(texts),
                                             info.get("crashed", 0)]]))
    check_rewards(self, info, counts.sum(axis=0), batch, texts, answers)
    with timer("learner"):
        # The learner works on the batch's longest sequence rounded up to a bucket.
        traj = trim_to_bucket(traj, self.length_buckets, multiple=self.rollout_cfg.block_size)
        # Advantages need whole groups; a process's rows are whole groups of its prompts.
        rows = (multihost.rows_to_global(rewards.astype(np.float32), self.spec)
                if multihost.is_multiprocess() else rewards)
        def distill(mini_batch, index, num_mini):
            """The adapter's update after each base optimizer step (base frozen)."""
            with timer("distill"):
                return self.distiller.update(mini_batch, index, num_mini, budgets)
        probe = probe_alpha(self, traj, actor)       # before the update: the sampling policy
        # The alpha replay runs the actor that sampled (merged adapter, if any).
        analysis, loss_metrics = self.learner.step(
            traj, self.learner.advantages(rows), budgets, self.replay,
            sparse_model=actor if self.distiller else None,
            after_step=distill if self.distiller else None)
        self._rollout_copy = None      # the policy changed: recast before the next rollout
    # Metrics over every process's rows.
    rewards = multihost.all_rows(rewards)
    lengths = multihost.all_rows(multihost.local_rows(traj.response_lengths))
    m = {"reward/mean": float(rewards.mean()), "reward/timeouts": int(counts[:, 0].sum()),
         "reward/errors": int(counts[:, 1].sum()),
         "reward/error_share": float(counts[:, 1].sum() / max(1, counts[:, 2].sum())),
         "response/length_mean": float(lengths.mean()),
         "response/length_max": float(lengths.max()),
         "rollout/tokens_per_s": float(lengths.sum() / seconds), **loss_metrics}
    for name, pool in self.diagnostics.items():
        diag = evaluation.score(pool, texts, answers, prompts, metas)[0]
        m[f"reward/{name}"] = float(multihost.all_rows(diag).mean())
    if "alpha" in analysis:
        summary = mismatch.mismatch_summary(
            analysis["alpha"], traj.cached_lengths, traj.mask, bin_size=sched.bin_size,
            num_bins=len(budgets), quantile=cfg.tail_quantile, logp_sparse=traj.logprobs,
            logp_dense=analysis["logp_old"])
        tail, counts = np.asarray(summary.pop("tail")), np.asarray(summary.pop("counts"))
        m.update(_scalars("alpha", summary))
        for b in np.nonzero(counts)[0]:
            m[f"alpha_tail/bin_{b:02d}"] = float(tail[b])
            m[f"alpha_count/bin_{b:02d}"] = float(counts[b])
        # A skipped (non-finite) update's tails are not evidence about the policy.
        if (cfg.adapt_schedule and cfg.rollout_mode == "sparse"
                and not loss_metrics.get("learner/skipped_updates")):
            live = schedule_step.counts(self.controller, analysis["alpha"], traj, n)
            replayed = (None, None) if probe is None else schedule_step.counts(
                self.controller, probe, traj, n)
            info = self.controller.update(*live, *replayed)
            m.update(schedule_step.step_metrics(info, self.controller.config.quantile))
    # The whole model's KV read (dense layers included; 1 for dense rollout), overall and per bin.
    layers = self.model.config.num_hidden_layers
    m.update(schedule_step.kv_read(traj.budgets, traj.cached_lengths, traj.mask,
                                   num_layers=layers,
                                   num_sparse_layers=self.rollout_cfg.num_sparse_layers(layers),
                                   bin_size=sched.bin_size, num_bins=len(budgets)))
    if cfg.rollout_mode == "sparse":    # the sparse layers' share, under its older name
        m["schedule/kv_fraction"] = m["kv/read_sparse_layers"]
    m.update(schedule_step.budget_metrics(self.controller.schedule))
    if self.rollout_cfg.mode == "exact_sparse":
        # The samples are the dense policy's: no mismatch, TIS weights 1 (checked here), and
        # the draft's acceptance per bin beside its alpha prediction.
        m.update(exact_step.acceptance_metrics(
            traj, budgets, gamma=self.rollout_cfg.gamma_by_bin or self.rollout_cfg.gamma,
            bin_size=sched.bin_size,
            num_layers=layers, num_sparse_layers=self.rollout_cfg.num_sparse_layers(layers)))
        m.update(exact_step.logprob_agreement(traj, analysis["logp_old"]))
    return m


def check_rewards(self, info: dict, totals: np.ndarray, batch: dict, texts: list[str],
                  answers: list[str]) -> None:
    """Stops the run (RunError, before the update: nothing of this step is saved) when
    - reward workers died while the run was stopping (SIGTERM/Ctrl-C reached them): the step's
      rewards would be zeros that no completion earned;
    - more than TrainConfig.max_reward_error_share of the rewards raised, or any did in the
      run's first step: a reward bug (a wrong signature fails on every completion) would
      otherwise train on zero reward to the end.
    `totals`: [timeouts, errors, rows, crashed workers] over every process."""
    step_no, errors, rows, crashed = self.step + 1, int(totals[1]), int(totals[2]), int(totals[3])
    if crashed and self.ckpt.stop_requested:
        raise faults.RunError(
            f"{self.ckpt.stop_reason}: {crashed} reward worker(s) died while step {step_no}'s "
            f"rewards were scored, so the step is not saved (its rewards would be 0); the last "
            f"checkpoint is step {self.ckpt.latest_step()} - re-run the same command to resume")
    limit = self.cfg.max_reward_error_share
    share = errors / max(1, rows)
    first = self.step == 0
    if not errors or limit >= 1 or (share <= limit and not first):
        return
    why = ("in the run's first step any error stops it" if first and share <= limit else
           f"more than TrainConfig.max_reward_error_share = {limit}")
    where = ""
    if "first_error_index" in info:
        i = info["first_error_index"]
        prompt_id = batch["ids"][i // self.cfg.group_size]
        where = (f" First failure: row {i} (prompt id {prompt_id!r}, answer {answers[i]!r:.80}, "
                 f"completion {texts[i]!r:.160}):\n{info['first_traceback'].rstrip()}")
    raise faults.RunError(
        f"step {step_no}: {errors} of {rows} rewards raised an error ({share:.1%}; {why}), "
        f"so the run stops before this step's update (nothing of it is saved). Fix the reward "
        f"function (TrainConfig.reward = {self.cfg.reward!r}), or raise "
        f"TrainConfig.max_reward_error_share to train on through such errors.{where}")


def probe_alpha(self, traj, actor):
    """alpha [B, T] of the batch replayed teacher-forced at the controller's probe budgets
    (one rung lower in the bins being considered), or None: no bin is considered, or no
    full-vocabulary alpha (lowering then never happens)."""
    if not (self.cfg.adapt_schedule and self.rollout_cfg.mode == "sparse"
            and self.learner.cfg.alpha_mode == "full"):
        return None
    budgets = self.controller.replay_budgets()
    if budgets is None:
        return None
    return self.learner.analyze(traj, budgets.astype(np.int32), self.replay,
                                sparse_model=actor if self.distiller else None)["alpha"]
