"""`sparrow train`: the sparse-rollout GRPO loop.

  prompts (grain) -> rollout (sparse, budget per length bin from the schedule) -> rewards
  -> learner (dense logprobs + alpha per token, GRPO+TIS update) -> mismatch tail per bin
  -> schedule controller -> metrics (TensorBoard + metrics.jsonl) / checkpoint (orbax)

Everything of a run lives in `run_dir`: checkpoints (params, optimizer, data-iterator position,
controller state, step; the operative gin config beside each), TensorBoard events,
operative_config.gin and metrics.jsonl. Re-running the same command resumes from the last
checkpoint with the same data order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from sparrow_jax import checkpoint as ckpt
from sparrow_jax import evaluation, mismatch, multihost
from sparrow_jax.controller import ControllerConfig, ScheduleController
from sparrow_jax.data import synthetic  # noqa: F401  (registers the synthetic rewards)
from sparrow_jax.data.prompts import PromptDataset, make_prompt_iterator
from sparrow_jax.metrics import MetricsWriter, StepTimer, gin_config_markdown
from sparrow_jax.model import compute_copy, load_hf, load_tokenizer, stop_token_ids
from sparrow_jax.rl.learner import Learner, LearnerConfig, SparseReplay
from sparrow_jax.rl.rewards import RewardPool
from sparrow_jax.rollout.batching import rollout_in_sub_batches, trim_to_bucket
from sparrow_jax.rollout.engine import RolloutConfig
from sparrow_jax.shapes import default_buckets
from sparrow_jax.schedule import make_schedule
from sparrow_jax.sharding import ShardingSpec, make_mesh

log = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"
    model_path: str = ""              # local Hugging Face directory (weights + tokenizer)
    train_data: str = ""              # JSONL / Parquet prompts with answers
    eval_data: str = ""               # held-out prompts ("" = no validation)
    reward: str = "math_verify"       # name in the reward registry (sparrow_jax.rl.rewards)
    diagnostic_rewards: tuple[str, ...] = ()
    reward_processes: int = 4         # 0 = score in-process (cheap rewards)
    reward_timeout_s: float = 10.0
    prompts_per_step: int = 4
    group_size: int = 8
    total_steps: int = 100
    rollout_mode: str = "sparse"      # "sparse" | "dense"
    adapt_schedule: bool = True       # online schedule controller on the measured tail
    tail_quantile: float = 0.05       # the per-bin tail statistic the controller targets
    eval_every: int = 10
    eval_prompts: int = 32
    eval_temperature: float = 0.0     # 0 = greedy validation
    checkpoint_every: int = 10
    max_to_keep: int = 3
    seed: int = 0
    dtype: str = "auto"               # compute dtype of rollout and learner forwards:
                                      # "auto" = bf16 on accelerators, f32 on CPU
    param_dtype: str = "float32"      # master weights and AdamW moments (bf16 cannot hold an
                                      # lr-1e-6 update); the rollout gets a compute-dtype copy
    rollout_batch_prompts: int = 0    # prompts per rollout program call (0 = prompts_per_step):
                                      # a step's rollout runs in sequential calls of this size
    mesh_model: int = 1               # model-parallel axis size; the rest of the devices is data
    distributed: bool = False         # multi-host: jax.distributed.initialize() (TPU pods, SLURM)
    # Explicit multi-process launch where no cluster is auto-detected (plain GPU nodes, local
    # tests): all three set, or none. Each process's prompts_per_step is its own share.
    coordinator_address: str = ""     # "host:port" of process 0
    num_processes: int = 0
    process_id: int = -1

    def __post_init__(self):
        missing = [f for f in ("model_path", "train_data") if not getattr(self, f)]
        if missing:
            raise ValueError(f"TrainConfig: set {missing} (e.g. --gin_param "
                             f"'TrainConfig.{missing[0]} = \"...\"')")
        if self.rollout_mode not in ("sparse", "dense"):
            raise ValueError(f"TrainConfig.rollout_mode must be sparse|dense, got {self.rollout_mode!r}")
        explicit = (bool(self.coordinator_address), self.num_processes > 0, self.process_id >= 0)
        if any(explicit) and not all(explicit):
            raise ValueError("TrainConfig: set coordinator_address, num_processes and process_id "
                             "together (or none of them, for cluster auto-detection)")
        if all(explicit) and not self.distributed:
            raise ValueError("TrainConfig: coordinator_address/num_processes/process_id need "
                             "distributed = True")
        if self.group_size < 2:
            raise ValueError(f"GRPO needs group_size >= 2, got {self.group_size}")
        if self.rollout_batch_prompts < 0 or (
                self.rollout_batch_prompts and self.prompts_per_step % self.rollout_batch_prompts):
            raise ValueError(f"TrainConfig.rollout_batch_prompts={self.rollout_batch_prompts} "
                             f"must divide prompts_per_step={self.prompts_per_step}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value != "auto" or name == "param_dtype":
                try:
                    jnp.dtype(value)
                except TypeError:
                    raise ValueError(f"TrainConfig.{name} = {value!r} is not a dtype name "
                                     "(float32, bfloat16, ...)") from None


def _scalars(prefix: str, d: dict) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in d.items() if np.ndim(v) == 0}


class Trainer:
    """Builds every stage from gin and runs/resumes the loop."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # A URI (gs://...) stays a URI for orbax and epath; a local path becomes absolute
        # (orbax needs that). pathlib's resolve() would turn gs://b/run into <cwd>/gs:/b/run.
        self.run_dir = ckpt.resolve_run_dir(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
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
        self._rollout_copy = None
        self.tokenizer = load_tokenizer(cfg.model_path)
        tok = self.tokenizer
        self.data = make_prompt_iterator(cfg.train_data, tok, batch_size=cfg.prompts_per_step,
                                         seed=cfg.seed)
        self.eval_batch = None
        if cfg.eval_data:
            ds = PromptDataset.from_files(cfg.eval_data, tok)
            log.info("eval data: %s", ds.report.summary())
            # Each process evaluates its share of the held-out prompts, padded to a row count
            # the data axis divides (padded rows are masked out of every metric).
            self.eval_batch = evaluation.shard_eval_batch(ds.records[:cfg.eval_prompts],
                                                          tok.pad_token_id, spec=self.spec)
        stops = stop_token_ids(tok, cfg.model_path)
        log.info("stop tokens: %s", list(stops))
        self.rollout_cfg = RolloutConfig(stop_token_ids=stops, pad_token_id=tok.pad_token_id or 0)
        self.rollout_cfg = dataclasses.replace(self.rollout_cfg, mode=cfg.rollout_mode)
        schedule = make_schedule()
        ctrl_cfg = ControllerConfig()
        self.controller = ScheduleController(schedule, ctrl_cfg)
        rc = self.rollout_cfg
        if rc.mode == "sparse":
            top = max(max(schedule.budgets), ctrl_cfg.max_budget if cfg.adapt_schedule else 0)
            if top > rc.max_budget:
                raise ValueError(f"schedule/controller budgets reach {top} tokens but "
                                 f"RolloutConfig.max_budget = {rc.max_budget}: raise max_budget "
                                 "or lower ControllerConfig.max_budget")
            # max_budget is the static gather width: a wider one only gathers padding (measured:
            # at 8K context a 1K budget under a 4K width cost more than dense attention).
            top = -(-top // rc.block_size) * rc.block_size
            if top < rc.max_budget:
                log.info("selection width: max_budget %d -> %d (largest reachable budget)",
                         rc.max_budget, top)
                self.rollout_cfg = rc = dataclasses.replace(rc, max_budget=top)
        self.replay = SparseReplay(bin_size=schedule.bin_size,
                                   max_selected=rc.max_budget // rc.block_size,
                                   block_size=rc.block_size, dense_layers=tuple(rc.dense_layers))
        learner_cfg = LearnerConfig()
        if rc.mode == "dense" and learner_cfg.alpha_mode == "full":
            learner_cfg = dataclasses.replace(learner_cfg, alpha_mode="none")
        self.length_buckets = learner_cfg.length_buckets or default_buckets(
            rc.max_new_tokens, multiple=rc.block_size)
        # The learner's policy is the rollout's sampling distribution (temperature, truncation).
        self.learner = Learner(self.model, learner_cfg, group_size=cfg.group_size,
                               sampling=self.rollout_cfg.sampling)
        self.pool = RewardPool(cfg.reward, processes=cfg.reward_processes,
                               timeout_s=cfg.reward_timeout_s)
        self.diagnostics = {n: RewardPool(n, processes=0) for n in cfg.diagnostic_rewards}
        self.ckpt = ckpt.CheckpointManager(self.run_dir, max_to_keep=cfg.max_to_keep,
                                           save_interval_steps=cfg.checkpoint_every,
                                           catch_sigterm=True)
        self.writer = MetricsWriter(self.run_dir)
        self.step = 0
        self.operative = gin.operative_config_str()
        ckpt.write_text_atomic(self.run_dir / "operative_config.gin", self.operative)
        self.writer.text(0, "config/operative_gin", gin_config_markdown(self.operative))

    def rollout_model(self):
        """The policy in the compute dtype for rollout and evaluation: cast once per RL step
        (after the update), not per decode step; the same model when dtypes already agree."""
        if self._rollout_copy is None:
            self._rollout_copy = compute_copy(self.model)
        return self._rollout_copy

    # -- checkpoints ------------------------------------------------------------------------
    def _extra(self) -> dict:
        return {"step": self.step, "data": self.data.get_state(),
                "controller": self.controller.state_dict(), "seed": self.cfg.seed}

    def save(self, force: bool = False) -> None:
        if self.ckpt.save(self.step, self.learner.params, self.learner.opt_state, self._extra(),
                          operative_config=self.operative, force=force):
            log.info("checkpoint saved at step %d", self.step)

    def maybe_resume(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is None:
            return
        params, opt_state, extra = self.ckpt.restore(
            latest, ckpt.abstract_like(self.learner.params), ckpt.abstract_like(self.learner.opt_state))
        nnx.update(self.model, params)
        self._rollout_copy = None
        self.learner.opt_state = opt_state
        # Saved by process 0; hosts run in lock step, so only the shard index differs.
        self.data.set_state({**extra["data"], "shard_index": jax.process_index()})
        self.controller = ScheduleController.from_state_dict(extra["controller"],
                                                             self.controller.config)
        self.step = int(extra["step"])
        log.info("resumed from %s at step %d", self.ckpt.step_dir(latest), self.step)

    # -- one RL step -------------------------------------------------------------------------
    def rl_step(self, timer: StepTimer) -> dict[str, float]:
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
        with timer("learner"):
            # The learner works on the batch's longest sequence rounded up to a bucket.
            traj = trim_to_bucket(traj, self.length_buckets, multiple=self.rollout_cfg.block_size)
            # Advantages need whole groups; a process's rows are whole groups of its prompts.
            rows = (multihost.rows_to_global(rewards.astype(np.float32), self.spec)
                    if multihost.is_multiprocess() else rewards)
            analysis, loss_metrics = self.learner.step(traj, self.learner.advantages(rows),
                                                       budgets, self.replay)
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
            if cfg.adapt_schedule and cfg.rollout_mode == "sparse":
                m["schedule/num_changed"] = self.controller.update(tail, counts)["num_changed"]
        for b, budget in enumerate(self.controller.schedule.budgets):
            m[f"budget/bin_{b:02d}"] = float(budget)
        return m

    def evaluate(self) -> dict[str, float]:
        if self.eval_batch is None:
            return {}
        out = {}
        sched = self.controller.schedule
        rng = jax.random.key(self.cfg.seed + 1)
        for mode in ("dense", "sparse"):
            rc = dataclasses.replace(self.rollout_cfg, mode=mode,
                                     temperature=self.cfg.eval_temperature)
            r = evaluation.evaluate(self.rollout_model(), self.tokenizer, self.pool, self.eval_batch, cfg=rc,
                                    budgets=np.asarray(sched.budgets), bin_size=sched.bin_size,
                                    rng=rng, spec=self.spec, diagnostics=self.diagnostics)
            out.update({f"eval_{mode}/{k}": v for k, v in r.items()})
        return out

    # -- loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        self.maybe_resume()
        timer = StepTimer()
        history = {}
        if self.step == 0 and self.eval_batch is not None:
            self.evaluate()  # compiles both eval programs so that timed evaluations are warm
            history["first"] = self.evaluate()
            self.writer.scalars(0, history["first"])
            log.info("eval at step 0: %s", _fmt(history["first"]))
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train", unit="step")
        while self.step < cfg.total_steps:
            start = time.perf_counter()
            m = self.rl_step(timer)
            self.step += 1
            m.update(timer.summary())
            m["time/step"] = time.perf_counter() - start
            if self.step % cfg.eval_every == 0 or self.step == cfg.total_steps:
                ev = self.evaluate()
                m.update(ev)
                if ev:
                    history["last"] = ev
                    log.info("eval at step %d: %s", self.step, _fmt(ev))
            self.writer.scalars(self.step, m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward/mean']:.2f}", len=f"{m['response/length_mean']:.0f}",
                            tail=f"{m.get('alpha/tail_min', float('nan')):.3f}")
            preempted = self.ckpt.should_stop_for_preemption(self.step)
            self.save(force=preempted or self.step == cfg.total_steps)
            if preempted:
                log.warning("preemption requested: saved step %d and stopping", self.step)
                break
        bar.close()
        self.close()
        return self.report(history)

    def report(self, history: dict) -> dict[str, float]:
        first, last = history.get("first", {}), history.get("last", {})
        lines = [f"run directory: {self.run_dir}"]
        for mode in ("dense", "sparse"):
            key = f"eval_{mode}/reward"
            if key in last:
                lines.append(f"held-out reward ({mode} decoding): {first.get(key, math.nan):.3f} "
                             f"-> {last[key]:.3f}")
        if "eval_dense/tokens_per_s" in last:
            ratio = last["eval_sparse/tokens_per_s"] / last["eval_dense/tokens_per_s"]
            lines.append(f"measured rollout speed, sparse vs dense (same prompts, one run): "
                         f"{last['eval_sparse/tokens_per_s']:.0f} vs "
                         f"{last['eval_dense/tokens_per_s']:.0f} tokens/s = {ratio:.2f}x")
            last = {**last, "speedup_sparse_over_dense": ratio}
        lines.append(f"final schedule (tokens per bin): {list(self.controller.schedule.budgets)}")
        print("\n".join(lines), flush=True)
        ckpt.save_json_atomic(self.run_dir / "summary.json", {"first": first, "last": last})
        return last

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()
        self.pool.close()
        for p in self.diagnostics.values():
            p.close()


def _fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in sorted(d.items()))


def train(cfg: TrainConfig | None = None) -> dict[str, float]:
    cfg = cfg or TrainConfig()
    if cfg.distributed:
        if cfg.coordinator_address:
            jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                                       process_id=cfg.process_id)
        else:
            jax.distributed.initialize()  # cluster auto-detection (TPU pod, SLURM, Open MPI, k8s)
        log.info("process %d of %d", jax.process_index(), jax.process_count())
    return Trainer(cfg).run()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # everything is configured through gin


def main(args: argparse.Namespace) -> int:
    del args
    result = train()
    log.info("done: %s", json.dumps({k: round(v, 4) for k, v in result.items()}))
    return 0
