"""The trainer: builds every stage of one RL step from gin, checkpoints and resumes, evaluates.

  prompts (grain) -> rollout (sparse, budget per length bin from the schedule) -> rewards
  -> learner (dense logprobs + alpha per token, GRPO+TIS update) -> mismatch tail per bin
  -> schedule controller -> metrics (TensorBoard + metrics.jsonl) / checkpoint (orbax)

The step itself is `sparrow_jax.train.step.rl_step`; the `sparrow train` command around it is
`sparrow_jax.train.command`. Everything of a run lives in `run_dir`: checkpoints (params,
optimizer, data-iterator position, controller state, step; the operative gin config beside each),
TensorBoard events, operative_config.gin and metrics.jsonl. Re-running the same command resumes
from the last checkpoint with the same data order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from sparrow_jax.data import check as data_check
from sparrow_jax.data import synthetic  # noqa: F401  (registers the synthetic rewards)
from sparrow_jax.data.prompts import PromptDataset, make_prompt_iterator
from sparrow_jax.evaluation import heldout as evaluation
from sparrow_jax.evaluation import reference as reference_eval
from sparrow_jax.model import compute_copy, load_hf, load_tokenizer, stop_token_ids
from sparrow_jax.rl.actor import RolloutActor
from sparrow_jax.rl.distill import Distiller
from sparrow_jax.rl.learner import Learner
from sparrow_jax.rewards.pool import RewardPool
from sparrow_jax.rollout import warmup
from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime import faults, multihost, resume_check
from sparrow_jax.runtime import metrics
from sparrow_jax.runtime.metrics import MetricsWriter, StepTimer, gin_config_markdown
from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh
from sparrow_jax.sparsity.controller import ScheduleController
from sparrow_jax.train import compile_plan, exact_replan, resume_config, schedule_step, step
from sparrow_jax.train.config import TrainConfig, gin_value
from sparrow_jax.train.plan import RunPlan, log_plan
from sparrow_jax.train.plan import from_gin as plan_from_gin
from sparrow_jax.rollout.config import RolloutMode

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

EXACT_PLAN_KEY = "exact_plan"      # in each checkpoint's JSON extra: the re-planned gamma plan


def learner_speed(m: dict[str, float]) -> dict[str, float]:
    """The learner's achieved model FLOP/s (`learner/model_flops` / `time/learner`) and, where
    the devices' peak is known (`learner/peak_flops`), its share of it: timing, hence under
    time/ (a first step's includes its compiles: `time/compile/learner`)."""
    if not m.get("time/learner") or "learner/model_flops" not in m:
        return {}
    out = {"time/learner_flops_per_s": m["learner/model_flops"] / m["time/learner"]}
    if m.get("learner/peak_flops"):
        out["time/learner_flops_share"] = out["time/learner_flops_per_s"] / m["learner/peak_flops"]
    return out


class Trainer:
    """Builds every stage from gin and runs/resumes the loop."""

    def __init__(self, cfg: TrainConfig, data_sha256: str | None = None,
                 resume_plan: resume_config.ResumePlan | None = None, *,
                 plan: RunPlan | None = None):
        # Every setting derived from the configs, once (train/plan.py): the compile plan and
        # `sparrow dryrun` read the same plan.
        self.plan = plan = plan_from_gin(cfg) if plan is None else plan
        self.cfg = cfg = plan.train
        # The training data's content fingerprint, saved with each step (a resume compares it)
        # and the settings a resume accepted (recorded once the checkpoint restored).
        self.data_sha256 = data_sha256
        self.resume_plan = resume_plan
        # A URI (gs://...) stays a URI for orbax and epath; a local path becomes absolute
        # (orbax needs that). pathlib's resolve() would turn gs://b/run into <cwd>/gs:/b/run.
        self.run_dir = ckpt.resolve_run_dir(cfg.run_dir)
        faults.check_run_dir_writable(self.run_dir)
        log.info("devices: %s", jax.devices())
        self.spec = None
        if jax.device_count() > 1:
            self.spec = ShardingSpec.create(make_mesh(model=cfg.mesh_model))
            log.info("mesh %s", dict(self.spec.mesh.shape))
            if multihost.is_multiprocess():
                multihost.check_mesh(self.spec)
        dtype = None if cfg.dtype == "auto" else jnp.dtype(cfg.dtype)
        # The learner's model holds the f32 master weights and computes in `dtype`.
        self.model = load_hf(cfg.model_path, dtype=dtype, param_dtype=jnp.dtype(cfg.param_dtype),
                             mesh=self.spec.mesh if self.spec else None)
        log.info("precision: master weights %s, compute %s", cfg.param_dtype,
                 jnp.dtype(self.model.dtype).name)
        self.tokenizer = load_tokenizer(cfg.model_path)
        tok = self.tokenizer
        mcfg = self.model.config
        faults.check_vocabulary(tok, mcfg.vocab_size, cfg.model_path, {
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
            "stop_token_ids": max(stop_token_ids(tok, cfg.model_path), default=None)})
        log_plan(plan, log)
        rc = plan.rollout
        # Prompts longer than the rollout can take are dropped at load (counted and logged).
        capacity = faults.prompt_capacity(mcfg.max_position_embeddings, rc.max_new_tokens,
                                          gin_value("make_prompt_iterator.max_prompt_len"))
        log.info("prompts of up to %d tokens (max_position_embeddings %d - max_new_tokens, or "
                 "make_prompt_iterator.max_prompt_len); longer ones are dropped", capacity,
                 mcfg.max_position_embeddings)
        self.data = make_prompt_iterator(cfg.train_data, tok, batch_size=cfg.prompts_per_step,
                                         seed=cfg.seed, max_prompt_len=capacity)
        data_check.log_first_prompt(self.data.first_record, cfg.reward)  # what the model sees
        self.eval_batch = None
        self._eval_warm = False          # set by the first evaluate(), which also compiles
        if cfg.eval_data:
            ds = PromptDataset.from_files(cfg.eval_data, tok, max_prompt_len=capacity)
            log.info("eval data: %s", ds.report.summary())
            # Each process evaluates its share of the held-out prompts, padded to a row count
            # the data axis divides (padded rows are masked out of every metric).
            self.eval_batch = evaluation.shard_eval_batch(ds.records[:cfg.eval_prompts],
                                                          tok.pad_token_id, spec=self.spec)
        stops = stop_token_ids(tok, cfg.model_path)
        log.info("stop tokens: %s", list(stops))
        # The plan's rollout with the tokenizer's ids (no program shape depends on them).
        self.rollout_cfg = rc = dataclasses.replace(rc, stop_token_ids=stops,
                                                    pad_token_id=tok.pad_token_id or 0)
        self.controller = ScheduleController(plan.schedule, plan.controller)
        # exact_sparse re-planning: the per-bin gamma plan the rollouts run (its table is an
        # input of the decode programs: a new plan compiles nothing).
        self.replanner = exact_replan.for_run(
            rc, plan.schedule, mcfg,
            batch=(cfg.rollout_batch_prompts or cfg.prompts_per_step) * cfg.group_size)
        self.replay = plan.replay
        self.eval_modes = plan.eval_modes
        # Teacher-forced reference evaluation (exact p(T=1 sample = reference), greedy
        # reproduction; sparrow_jax.evaluation.reference), when ReferenceEvalConfig.data is set.
        self.reference = None
        if plan.reference.data:
            records = PromptDataset.from_files(plan.reference.data, tok,
                                               max_prompt_len=capacity).records
            self.reference = reference_eval.ReferenceEvaluator(
                plan.reference, records, tok, block_size=rc.block_size,
                rows_path=str(self.run_dir / "eval_reference.jsonl")
                if "://" not in str(cfg.run_dir) else None)
        self.length_buckets = plan.length_buckets
        # The learner's policy is the rollout's sampling distribution (temperature, truncation).
        self.learner = Learner(self.model, plan.learner, plan.loss, group_size=cfg.group_size,
                               sampling=rc.sampling)
        # DistillSparse: a LoRA adapter only the sparse actor carries (sparrow_jax.rl.distill).
        self.distiller = (Distiller(plan.distill, self.learner, self.replay) if plan.distills
                          else None)
        self.actor = RolloutActor(self.model, self.distiller)
        self.pool = RewardPool(cfg.reward, processes=cfg.reward_processes,
                               timeout_s=cfg.reward_timeout_s)
        self.diagnostics = {n: RewardPool(n, processes=0) for n in cfg.diagnostic_rewards}
        self.ckpt = ckpt.CheckpointManager(self.run_dir, max_to_keep=cfg.max_to_keep,
                                           save_interval_steps=cfg.checkpoint_every,
                                           catch_sigterm=True, catch_sigint=True)
        self.ckpt.before_exit_at_once = self.pool.kill_now   # no orphan workers (issue #45)
        self.writer = MetricsWriter(self.run_dir)
        self.step = 0
        self.guard = faults.NonFiniteGuard(cfg.max_consecutive_skips)
        self.operative = gin.operative_config_str()
        if self.ckpt.latest_step() is None:   # fresh: a resume writes it once the step fits
            ckpt.write_text_atomic(self.run_dir / "operative_config.gin", self.operative)

    def rollout_model(self):
        """The rollout's copy of the policy (`rl.actor.RolloutActor`)."""
        return self.actor.model()

    # -- checkpoints ------------------------------------------------------------------------
    def _extra(self) -> dict:
        # Fingerprints of the arrays: a resume verifies them (flipped bytes restore silently).
        sums = {"params": faults.tree_checksums(self.learner.params),
                "opt_state": faults.tree_checksums(self.learner.opt_state)}
        return {"step": self.step, "data": self.data.get_state(),
                "controller": self.controller.state_dict(), "seed": self.cfg.seed,
                "faults": self.guard.state_dict(), faults.CHECKSUM_KEY: sums,
                resume_config.DATA_KEY: self.data_sha256,
                **({EXACT_PLAN_KEY: self.replanner.state_dict()} if self.replanner else {})}

    def save(self, force: bool = False) -> None:
        distill = self.distiller.state() if self.distiller else None
        try:
            saved = self.ckpt.save(self.step, self.learner.params, self.learner.opt_state,
                                   self._extra(), operative_config=self.operative, force=force,
                                   distill=distill)
        except Exception as e:    # disk full, permissions: earlier steps stay intact
            raise faults.save_failure(self.ckpt, self.step, e) from e
        if saved:
            log.info("checkpoint saved at step %d", self.step)

    def _restore_step(self, step: int):
        # Orbax converts dtypes on restore without raising: a step of another structure is a
        # configuration error before its fingerprints could call it damaged.
        incompatible = self._incompatible(step)
        if incompatible:
            raise faults.RunError(incompatible)
        params, opt_state, extra = self.ckpt.restore(
            step, ckpt.abstract_like(self.learner.params), ckpt.abstract_like(self.learner.opt_state))
        faults.verify_checksums(step, {"params": params, "opt_state": opt_state},
                                extra.get(faults.CHECKSUM_KEY))
        return params, opt_state, extra

    def _incompatible(self, step: int) -> str | None:
        """A configuration error when ``step``'s arrays do not fit this configuration (a
        changed setting, not damage: nothing is moved); None otherwise."""
        differences = resume_check.structure_differences(
            self.ckpt, step, {"params": self.learner.params, "opt_state": self.learner.opt_state})
        if not differences:        # matching, or unreadable metadata: damage
            return None
        return resume_check.config_change_message(self.ckpt, step, differences, self.operative)

    def maybe_resume(self) -> None:
        # The newest step that restores and matches its fingerprints; damaged newer steps are
        # reported and set aside, a step of another configuration is a configuration error
        # (sparrow_jax.runtime.faults, sparrow_jax.runtime.resume_check).
        found = faults.restore_newest_good(self.ckpt, self._restore_step, self._incompatible)
        if found is None:
            refused = resume_check.check_fresh_start(str(self.run_dir), self.writer.local_dir)
            if refused:
                raise faults.RunError(refused)
            self.writer.truncate_after(None)  # no checkpoint: whatever was logged is redone
            return
        latest, (params, opt_state, extra) = found
        nnx.update(self.model, params)
        self.actor.policy_changed()
        self.learner.opt_state = opt_state
        if self.distiller:
            state = self.ckpt.restore_distill(latest, ckpt.abstract_like(self.distiller.state()))
            if state is None:
                log.warning("checkpoint %d has no DistillSparse adapter: starting a fresh one",
                            latest)
            else:
                self.distiller.load_state(state)
        # Saved by process 0; hosts run in lock step, so only the shard index differs.
        self.data.set_state({**extra["data"], "shard_index": jax.process_index()})
        self.controller = ScheduleController.from_state_dict(extra["controller"],
                                                             self.controller.config)
        self.step = int(extra["step"])
        self.guard.load_state_dict(extra.get("faults"))
        if self.replanner is not None and EXACT_PLAN_KEY in extra:
            self.replanner.load_state_dict(extra[EXACT_PLAN_KEY])
            log.info("exact_sparse plan restored from step %d: gamma per bin %s", latest,
                     list(self.replanner.table))
        # Steps after the checkpoint are redone: their metrics lines go (no duplicates).
        dropped = self.writer.truncate_after(self.step)
        log.info("resumed from %s at step %d%s", self.ckpt.step_dir(latest), self.step,
                 f" (dropped {dropped} metrics.jsonl lines of later steps)" if dropped else "")

    # -- one RL step -------------------------------------------------------------------------
    @property
    def current_rollout(self):
        """The rollout config the next rollout runs: with re-planning, the current plan's."""
        return (self.replanner.rollout(self.rollout_cfg) if self.replanner
                else self.rollout_cfg)

    def stages(self) -> step.Stages:
        """The built stages of this run, as one RL step takes them (the controller and the
        exact_sparse plan as of now: a resume replaces them)."""
        return step.Stages(
            data=self.data, tokenizer=self.tokenizer, actor=self.actor,
            rollout=self.current_rollout, spec=self.spec, rewards=self.pool,
            diagnostics=self.diagnostics, learner=self.learner, controller=self.controller,
            distiller=self.distiller, checkpoints=self.ckpt, replanner=self.replanner)

    def rl_step(self, timer: StepTimer) -> dict[str, float]:
        return step.rl_step(self.plan, self.stages(), self.step, timer)

    def train_slots(self) -> int:
        """Slots of a training rollout (all processes); the paged evaluation runs in the same
        slots, so that it shares the training rollout's decode programs (compile_plan) - its
        dense decoding too, in the sparse programs at the dense rung (`dense_via_sparse`)."""
        per_call = self.cfg.rollout_batch_prompts or self.cfg.prompts_per_step
        return self.rollout_cfg.max_slots or per_call * self.cfg.group_size * jax.process_count()

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates: held-out prompts to decode (`TrainConfig.eval_data`)
        and/or references to score teacher-forced (`ReferenceEvalConfig.data`; alone, the
        evaluation decodes nothing: cheap at long generations)."""
        return self.eval_batch is not None or self.reference is not None

    def evaluate(self) -> dict[str, float]:
        if not self.evaluates:
            return {}
        out = {}
        sched = self.controller.schedule
        rng = jax.random.key(self.cfg.seed + 1)
        for mode in self.eval_modes:
            if self.eval_batch is None:          # the references alone
                out.update(self.score_references(mode))
                continue
            rc = dataclasses.replace(self.current_rollout, mode=mode,
                                     temperature=self.cfg.eval_temperature,
                                     max_slots=self.train_slots(),
                                     dense_via_sparse=self.rollout_cfg.mode == RolloutMode.SPARSE)
            # Dense decoding evaluates the policy itself, never the sparse actor's adapter.
            model = (compute_copy(self.model) if self.distiller and mode == RolloutMode.DENSE
                     else self.rollout_model())
            # Long generations make this minutes of silence otherwise (4.5K tokens: ~10 min on CPU).
            t0 = time.perf_counter()
            log.info("held-out evaluation at step %d: %s decoding of %d prompts, up to %d new "
                     "tokens%s", self.step, mode, int(np.sum(self.eval_batch.valid)),
                     rc.max_new_tokens, ", then the teacher-forced references"
                     if self.reference is not None
                     and mode in (RolloutMode.DENSE, RolloutMode.SPARSE) else "")
            r = evaluation.evaluate(model, self.tokenizer, self.pool, self.eval_batch, cfg=rc,
                                    budgets=np.asarray(sched.budgets), bin_size=sched.bin_size,
                                    rng=rng, spec=self.spec, diagnostics=self.diagnostics,
                                    samples=self.cfg.eval_samples)
            out.update({f"eval_{mode}/{k}": v for k, v in r.items()})
            out.update(self.score_references(mode, model))
            log.info("held-out evaluation at step %d, %s: done in %.0f s", self.step, mode,
                     time.perf_counter() - t0)
        if not self._eval_warm:
            # This process's first evaluation also compiled the eval programs: its timings are
            # compile time, not speed - dropped (later evaluations are warm and keep theirs).
            self._eval_warm = True
            out = {k: v for k, v in out.items() if not k.endswith(("/tokens_per_s", "/seconds"))}
        return out

    def score_references(self, mode: RolloutMode, model=None) -> dict[str, float]:
        """The teacher-forced reference metrics (`eval_<mode>/ref_*`) of the dense policy or
        the sparse actor at the schedule; {} without references or in another mode."""
        if self.reference is None or mode not in (RolloutMode.DENSE, RolloutMode.SPARSE):
            return {}
        if model is None:
            model = (compute_copy(self.model) if self.distiller and mode == RolloutMode.DENSE
                     else self.rollout_model())
        rc, sched = self.rollout_cfg, self.controller.schedule
        r = self.reference(model, mode, self.step, budgets=np.asarray(sched.budgets),
                           bin_size=sched.bin_size, max_budget=rc.max_budget,
                           block_size=rc.block_size, dense_layers=tuple(rc.dense_layers))
        return {f"eval_{mode}/{k}": v for k, v in r.items()}

    # -- loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        self.maybe_resume()
        # A reward worker that cannot start (its module fails to import there) stops the run
        # here with the worker's error, before the first rollout compiles.
        self.pool.wait_ready()
        # Only once the checkpoint fits: a refused resume leaves the run's record as it was.
        if self.resume_plan is not None and self.step:
            self.resume_plan.record(self.run_dir, self.step)
        ckpt.write_text_atomic(self.run_dir / "operative_config.gin", self.operative)
        # After the resume: a fresh start's TensorBoard "restart" marker would hide it.
        self.writer.text(0, "config/operative_gin", gin_config_markdown(self.operative))
        # Why step 1 takes minutes: the programs it compiles (or `warmup` compiles first).
        shape = compile_plan.trainer_shape(self)
        warm = compile_plan.warm_for_run(self.plan, self.model.config, shape, self.rollout_cfg)
        compile_plan.log_plan(compile_plan.for_run(self.plan, self.model.config, shape,
                                                   self.rollout_cfg, warm))
        self.stop_if_interrupted()
        timer = StepTimer()
        if warm:                   # the plan's rollout programs, one progress line each
            sched = self.controller.schedule
            # time/warmup and time/compile/warmup join the first step's metrics
            with timer("warmup"):
                warmup.warm(self.rollout_model(), warm, spec=self.spec,
                            budgets=np.asarray(sched.budgets, np.int32), bin_size=sched.bin_size)
        history = {}
        if self.step == 0 and self.evaluates and cfg.eval_at_start:
            history["first"] = self.evaluate()     # compiles: no speeds (see evaluate)
            self.writer.scalars(0, history["first"])
            log.info("eval at step 0: %s", evaluation.short_line(history["first"], self.eval_modes))
        self.stop_if_interrupted()
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train", unit="step")
        while self.step < cfg.total_steps:
            start = time.perf_counter()
            m = self.rl_step(timer)
            self.step += 1
            m.update(timer.summary())
            m["time/step"] = time.perf_counter() - start
            m.update(learner_speed(m))
            # A non-finite loss/gradient skipped the update; too many in a row stop the run.
            stop = self.guard.observe(self.step, m.get("learner/skipped_updates", 0.0), m)
            m["train/skipped_steps"] = self.guard.total
            if self.step % cfg.eval_every == 0 or self.step == cfg.total_steps:
                ev = self.evaluate()
                m.update(ev)
                if ev:
                    history["last"] = ev
                    log.info("eval at step %d: %s", self.step, evaluation.short_line(ev, self.eval_modes))
            self.writer.scalars(self.step, m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward/mean']:.2f}", len=f"{m['response/length_mean']:.0f}",
                            tail=f"{m.get('alpha/tail_min', float('nan')):.3f}")
            preempted = self.ckpt.should_stop_for_preemption(self.step)
            self.save(force=preempted or stop or self.step == cfg.total_steps)
            if stop:
                bar.close()
                raise faults.RunError(self.guard.stop_message(self.step,
                                                              self.ckpt.step_dir(self.step)))
            if preempted:
                log.warning("%s: saved step %d and stopping", self.ckpt.stop_reason, self.step)
                break
        bar.close()
        self.close()
        result = self.report(history)
        if self.step < cfg.total_steps:     # stopped early by a signal: not a finished run
            raise faults.RunStopped(self.step, self.ckpt.stop_reason, self.ckpt.stop_exit_code)
        return result

    def stop_if_interrupted(self) -> None:
        """A Ctrl-C or SIGTERM that came after the loop's handlers were installed but before
        its first step (restoring, reward workers starting, compiles, the first evaluation):
        stop now, with nothing trained, rather than after a step (issue 58)."""
        if self.ckpt.stop_requested:
            raise faults.RunStopped(self.step, self.ckpt.stop_reason, self.ckpt.stop_exit_code,
                                    saved=False)

    def report(self, history: dict) -> dict[str, float]:
        # A resumed (or already finished) run keeps the evaluations of earlier processes.
        earlier = resume_check.read_summary(self.run_dir)
        first = history.get("first") or earlier.get("first", {})
        last = history.get("last") or earlier.get("last", {})
        lines, last = evaluation.summary_lines(first, last, self.eval_modes)
        layers = self.model.config.num_hidden_layers
        sparse = self.rollout_cfg.num_sparse_layers(layers)
        # From metrics.jsonl (the writer's record, resumed runs included); only process 0 has it.
        kv = (schedule_step.run_kv_read(metrics.read_jsonl(self.run_dir))
              if jax.process_index() == 0 else math.nan)
        lines = [f"run directory: {self.run_dir}", *lines,
                 f"KV read over the run's rollouts, whole model ({sparse} of {layers} layers "
                 f"sparse): {kv:.3f}",
                 f"final schedule (tokens per bin): {schedule_step.schedule_line(self.controller.schedule)}"]
        last = {**last, "kv/read_model_run": kv}
        print("\n".join(lines), flush=True)
        ckpt.save_json_atomic(self.run_dir / "summary.json", {"first": first, "last": last})
        return last

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()
        self.pool.close()
        for p in self.diagnostics.values():
            p.close()

