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
from sparrow_jax.runtime import multihost
from sparrow_jax.runtime.metrics import StepTimer
from sparrow_jax.sparsity import mismatch
from sparrow_jax.train import schedule_step

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
    counts = multihost.all_rows(np.asarray([[info["timeouts"], info["errors"]]]))
    m = {"reward/mean": float(rewards.mean()), "reward/timeouts": int(counts[:, 0].sum()),
         "reward/errors": int(counts[:, 1].sum()), "response/length_mean": float(lengths.mean()),
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
    if cfg.rollout_mode == "sparse":
        m["schedule/kv_fraction"] = schedule_step.kv_fraction(traj.budgets,
                                                              traj.cached_lengths, traj.mask)
    # The whole model's KV read (dense layers included; 1 for dense rollout), overall and per bin.
    layers = self.model.config.num_hidden_layers
    m.update(schedule_step.kv_read(traj.budgets, traj.cached_lengths, traj.mask,
                                   num_layers=layers,
                                   num_sparse_layers=self.rollout_cfg.num_sparse_layers(layers),
                                   bin_size=sched.bin_size, num_bins=len(budgets)))
    m.update(schedule_step.budget_metrics(self.controller.schedule))
    return m

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
