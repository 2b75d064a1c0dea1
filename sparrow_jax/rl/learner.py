"""GRPO learner: dense old-policy logprobs + mismatch, then PPO mini-batch AdamW updates.

One RL step's learner work (`Learner.step`):
  analysis  -> a TokenAnalysis: logp_old [B, T] (dense policy pi_old), alpha [B, T] (acceptance
               rate vs the sparse actor, for the schedule controller through
               mismatch.tail_by_bin)
  updates   -> `ppo_epochs` passes over `B / ppo_mini_batch_size` mini-batches, one AdamW step
               each; inside a mini-batch, micro-batches whose (loss_sum, grads) are summed against
               the mini-batch's global denominator, so each step equals the full mini-batch step.
With one mini-batch and one epoch the analysis is fused into the gradient program (pi = pi_old
there, so the dense forward runs once). Precision: the parameters held here are the f32 master
weights (and AdamW's moments alike); forwards compute in the model's dtype (bf16 on
accelerators). The compiled programs live in `sparrow_jax.rl.learner_programs`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rl import grpo
from sparrow_jax.rl.learner_programs import (AlphaMode, LearnerBatch, ProgramOptions, RematMode,
                                             SparseReplay, TokenAnalysis, analyze_program,
                                             apply_program, check_model, data_row_shards,
                                             fusable, grads_program, merge_micro_batches,
                                             opt_state_shardings, split_micro_batches)
from sparrow_jax.rollout.sampling import SamplingParams
from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.runtime.shapes import COMPILES
from sparrow_jax.runtime.sharding import ShardingSpec, residual_spec
from sparrow_jax.sparsity import cost_model

log = logging.getLogger(__name__)
# after_step(batch with logp_old, mini_index, num_mini) -> metrics; see Learner.update.
AfterStep = Callable[["LearnerBatch", int, int], dict[str, float]]
__all__ = ["LearnerConfig", "Learner", "analysis_fused", "LearnerBatch", "SparseReplay",
           "TokenAnalysis", "AlphaMode", "RematMode", "make_optimizer", "split_micro_batches",
           "merge_micro_batches", "data_row_shards"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    ppo_mini_batch_size: int = 0   # rows per optimizer step (multiple of the group size);
                                   # 0 = the whole batch (one step per RL step)
    ppo_epochs: int = 1            # passes over the batch's mini-batches
    micro_batch_size: int = 0      # rows per micro-batch inside a mini-batch; 0 = all
    logit_chunk: int = 256         # time steps per [B, chunk, V] logits slice
    attention_chunk: int = 0       # queries per [B, H, chunk, <=T] score block, causal groups,
                                   # rematerialised in backward (long sequences); 0 = one-shot
    remat: RematMode = RematMode.NONE   # per-layer remat of the gradient forward: none|full|dots
    length_buckets: tuple[int, ...] = ()   # response lengths the learner pads a batch to (the
                                   # longest response rounded up); () = two per octave up to
                                   # RolloutConfig.max_new_tokens (sparrow_jax.runtime.shapes)
    alpha_mode: AlphaMode = AlphaMode.FULL   # "full": exact full-vocabulary alpha via a
                                   # sparse replay; "topk": the paper's top-k lower bound (no
                                   # extra forward); "none": skip the mismatch statistic

    def __post_init__(self):
        # gin gives strings; the members still equal (and hash like) them.
        for name, mode in (("alpha_mode", AlphaMode), ("remat", RematMode)):
            object.__setattr__(self, name,
                               mode.parse(getattr(self, name), f"LearnerConfig.{name}"))
        if self.attention_chunk < 0:
            raise ValueError(f"LearnerConfig.attention_chunk must be >= 0 (0 = one-shot), got "
                             f"{self.attention_chunk}")
        if self.ppo_epochs < 1 or self.ppo_mini_batch_size < 0:
            raise ValueError(f"LearnerConfig: ppo_epochs must be >= 1 and ppo_mini_batch_size "
                             f">= 0, got {self.ppo_epochs} and {self.ppo_mini_batch_size}")
        bad = [f"LearnerConfig.{name} must be {rule}, got {getattr(self, name)}"
               for name, rule, ok in (("learning_rate", "finite and > 0",
                                       0 < self.learning_rate < float("inf")),
                                      ("micro_batch_size", ">= 0 (0 = all)",
                                       self.micro_batch_size >= 0),
                                      ("logit_chunk", "> 0", self.logit_chunk > 0)) if not ok]
        if bad:
            raise ValueError("; ".join(bad))


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
    lr = (optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
          if cfg.warmup_steps else cfg.learning_rate)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def _mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Metrics over optimizer steps: max of *_max, min of *_min, mean of the rest."""
    out = {}
    for k in steps[0]:
        vals = [s[k] for s in steps]
        out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else (
            float(np.mean(vals)))
    return out


def _param_shardings(model: Qwen3ForCausalLM) -> tuple[jax.sharding.NamedSharding, ...] | None:
    """The Param leaves' shardings, flattened (None unless every one is a NamedSharding)."""
    shardings = tuple(getattr(x, "sharding", None)
                      for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not shardings or not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return None
    return shardings


def _residual_spec(model: Qwen3ForCausalLM) -> ShardingSpec | None:
    """Sequence-parallel residuals over the parameters' mesh (None when they have no mesh)."""
    shardings = _param_shardings(model)
    return None if shardings is None else residual_spec(shardings[0].mesh)


def mini_batches(cfg: LearnerConfig, rows: int) -> int:
    """Optimizer steps per epoch over a batch of `rows` rows (`ppo_mini_batch_size` each)."""
    mini = cfg.ppo_mini_batch_size or rows
    if rows % mini:
        raise ValueError(f"batch of {rows} rows is not a multiple of ppo_mini_batch_size={mini}")
    return rows // mini


def analysis_fused(cfg: LearnerConfig, loss_cfg: grpo.LossConfig, rows: int) -> bool:
    """Whether a step of `rows` rollouts runs the analysis inside its gradient program: one
    mini-batch, one epoch and a loss whose normalisation does not need pi_old first, so pi_old's
    logprobs and alpha come out of the gradient program's own forward."""
    return mini_batches(cfg, rows) == 1 and cfg.ppo_epochs == 1 and fusable(loss_cfg)


class Learner:
    """Holds the policy (an NNX model updated in place: the f32 master weights) and AdamW's state.

    `sampling` is the rollout's sampling distribution (`RolloutConfig.sampling`): the learner's
    logprobs, PPO ratio, TIS weight and alpha are all computed under it (same temperature, same
    top-k / top-p truncation), so there is no second setting to disagree.
    """

    def __init__(self, model: Qwen3ForCausalLM, cfg: LearnerConfig,
                 loss_cfg: grpo.LossConfig | None = None, *, group_size: int,
                 sampling: SamplingParams = SamplingParams()):
        self.model, self.cfg = model, cfg
        self.loss_cfg = loss_cfg or grpo.LossConfig()
        self.group_size = group_size
        self.sampling = sampling
        for name in ("micro_batch_size", "ppo_mini_batch_size"):
            size = getattr(cfg, name)
            if size and size % group_size:
                raise ValueError(f"{name}={size} must be a multiple of the group size "
                                 f"{group_size} (groups are never split)")
        mini, micro = cfg.ppo_mini_batch_size, cfg.micro_batch_size
        if mini and micro and mini % micro:
            raise ValueError(f"ppo_mini_batch_size={mini} must be a multiple of "
                             f"micro_batch_size={micro}")
        check_model(model)
        self.tx = make_optimizer(cfg)
        self.opts = ProgramOptions(logit_chunk=cfg.logit_chunk, attention_chunk=cfg.attention_chunk,
                                   remat=cfg.remat, alpha_mode=cfg.alpha_mode, sampling=sampling,
                                   residual_spec=_residual_spec(model),
                                   param_shardings=_param_shardings(model))
        self.graphdef, _, self.rest = nnx.split(model, nnx.Param, ...)
        self._opt_state = None  # created on first use: analysis-only users never pay for Adam
        self.last_step_metrics: list[dict[str, float]] = []   # per optimizer step of the last update

    @property
    def opt_state(self):
        if self._opt_state is None:
            params = self.params
            self._opt_state = jax.jit(self.tx.init,
                                      out_shardings=opt_state_shardings(self.tx, params))(params)
        return self._opt_state

    @opt_state.setter
    def opt_state(self, value) -> None:
        self._opt_state = value

    @property
    def params(self) -> nnx.State:
        return nnx.state(self.model, nnx.Param)

    def fused(self, rows: int) -> bool:
        """`analysis_fused` of this learner's configs."""
        return analysis_fused(self.cfg, self.loss_cfg, rows)

    def analyze(self, traj: Trajectories, budgets=None, replay: SparseReplay | None = None,
                sparse_model: Qwen3ForCausalLM | None = None) -> TokenAnalysis:
        """Dense logprobs of the sampled tokens (the PPO anchor) and per-token alpha.

        `sparse_model`: the sparse actor that sampled, when its weights differ from the policy's
        (a DistillSparse adapter merged in): the alpha replay runs it; the dense side never does."""
        graphdef, state = nnx.split(self.model)
        sparse_state = None if sparse_model is None else nnx.state(sparse_model)
        budgets = jnp.zeros((1,), jnp.int32) if budgets is None else jnp.asarray(budgets, jnp.int32)
        layout = self.micro_batch_layout(traj.tokens, num_mini=1)
        COMPILES.note("learner/analyze", rows=traj.tokens.shape[0],
                      prompt_width=traj.prompt_tokens.shape[1], response=traj.tokens.shape[1],
                      **layout)
        return analyze_program(graphdef, state, traj, budgets, replay=replay, opts=self.opts,
                               sparse_state=sparse_state, **layout)

    def num_mini_batches(self, rows: int) -> int:
        """`mini_batches` of this learner's config."""
        return mini_batches(self.cfg, rows)

    def micro_batch_layout(self, x: jax.Array, num_mini: int = 1) -> dict[str, int]:
        """Static micro-batch layout inside one of `num_mini` mini-batches of a batch whose rows
        are `x`'s rows: the programs' keyword arguments {"num_micro", "row_shards"}."""
        rows = x.shape[0] // num_mini
        mb = self.cfg.micro_batch_size or rows
        if rows % mb:
            raise ValueError(f"mini-batch of {rows} rows is not a multiple of "
                             f"micro_batch_size={mb}")
        num_micro = rows // mb
        parts = num_mini * num_micro
        shards = data_row_shards(x, parts) if parts > 1 else 1
        return {"num_micro": num_micro, "row_shards": shards}

    def advantages(self, rewards) -> jax.Array:
        return grpo.group_advantages(jnp.asarray(rewards, jnp.float32), self.group_size,
                                     normalize_std=self.loss_cfg.normalize_std,
                                     eps=self.loss_cfg.advantage_eps)

    def gradients(self, batch: LearnerBatch, budgets, replay, mini_index: int, num_mini: int,
               sparse_model: Qwen3ForCausalLM | None = None):
        budgets = jnp.zeros((1,), jnp.int32) if budgets is None else jnp.asarray(budgets, jnp.int32)
        layout = self.micro_batch_layout(batch.traj.tokens, num_mini)
        COMPILES.note("learner/grads", rows=batch.traj.tokens.shape[0],
                      prompt_width=batch.traj.prompt_tokens.shape[1],
                      response=batch.traj.tokens.shape[1], num_mini=num_mini,
                      fused=batch.logp_old is None, **layout)
        sparse_params = None if sparse_model is None else nnx.state(sparse_model, nnx.Param)
        return grads_program(self.params, self.rest, batch, budgets, jnp.int32(mini_index),
                             graphdef=self.graphdef, opts=self.opts, loss_cfg=self.loss_cfg,
                             replay=replay, num_mini=num_mini, sparse_params=sparse_params,
                             **layout)

    def grads(self, batch: LearnerBatch) -> tuple[Any, dict[str, jax.Array], jax.Array]:
        """Exact gradient of the whole batch as one mini-batch. Returns (grads, metrics, loss)."""
        grads, metrics, loss, _ = self.gradients(batch, None, None, 0, 1)
        return grads, metrics, loss

    def _apply(self, grads, loss=None) -> tuple[float, bool]:
        """(grad norm, applied): non-finite steps leave params and optimizer state untouched."""
        params, self.opt_state, gnorm, applied = apply_program(self.params, self.opt_state,
                                                               grads, loss, tx=self.tx)
        nnx.update(self.model, params)
        return gnorm, bool(applied)

    def update(self, batch: LearnerBatch, budgets=None, replay: SparseReplay | None = None, *,
               sparse_model: Qwen3ForCausalLM | None = None,
               after_step: AfterStep | None = None) -> dict[str, float]:
        """`ppo_epochs` passes over the mini-batches, one AdamW step each (in row order).

        `batch.logp_old` None (only valid fused, see `fused`) makes the gradient program compute
        pi_old's logprobs and alpha itself; that TokenAnalysis is kept in `last_analysis`.
        `sparse_model`: see `analyze`. `after_step(batch, mini_index, num_mini)` runs after each
        optimizer step with the updated policy and batch.logp_old set (e.g. the DistillSparse
        adapter's step); the metrics it returns join that step's."""
        num_mini = self.num_mini_batches(batch.traj.tokens.shape[0])
        if batch.logp_old is None and not self.fused(batch.traj.tokens.shape[0]):
            raise ValueError("LearnerBatch.logp_old is needed with several mini-batches, epochs, "
                             "or token rejection / sequence veto / TIS renormalisation")
        steps, self.last_analysis = [], None
        for _ in range(self.cfg.ppo_epochs):
            for j in range(num_mini):
                grads, metrics, loss, analysis = self.gradients(batch, budgets, replay, j, num_mini,
                                                             sparse_model)
                gnorm, applied = self._apply(grads, loss)
                if analysis is not None:
                    self.last_analysis = analysis
                out = {f"loss/{k}": float(v) for k, v in metrics.items()}
                out.update({"loss/policy": float(loss), "loss/grad_norm": float(gnorm),
                            "learner/skipped_updates": float(not applied)})
                if after_step is not None:
                    anchored = batch if batch.logp_old is not None else dataclasses.replace(
                        batch, logp_old=analysis.logp_old)   # fused: one mini-batch
                    out.update(after_step(anchored, j, num_mini))
                steps.append(out)
        self.last_step_metrics = steps
        return {**_mean_metrics(steps), "learner/optimizer_steps": float(len(steps)),
                "learner/skipped_updates": sum(s["learner/skipped_updates"] for s in steps)}

    def step(self, traj: Trajectories, advantages, budgets=None,
             replay: SparseReplay | None = None, *,
             sparse_model: Qwen3ForCausalLM | None = None,
             after_step: AfterStep | None = None,
             ) -> tuple[TokenAnalysis, dict[str, float]]:
        """One RL step's learner work: (per-token analysis, update metrics).

        Analysis = logp_old [B, T] (pi_old), and alpha / logp_sparse_replay [B, T] per alpha_mode.
        Fused when possible (see `fused`): one dense forward for both. `sparse_model` and
        `after_step`: see `update`. The metrics also carry the work's model FLOPs
        (`learner/model_flops`, `flops`) and the devices' bf16 peak where the cost model's table
        knows them (`learner/peak_flops`)."""
        fused = self.fused(traj.tokens.shape[0])
        work = self.flops(traj, replay, fused)
        if fused:
            metrics = self.update(LearnerBatch(traj=traj, logp_old=None, advantages=advantages),
                                  budgets, replay, sparse_model=sparse_model,
                                  after_step=after_step)
            return self.last_analysis, {**metrics, **work}
        analysis = self.analyze(traj, budgets, replay, sparse_model)
        metrics = self.update(LearnerBatch(traj=traj, logp_old=analysis.logp_old,
                                           advantages=advantages), budgets, replay,
                              sparse_model=sparse_model, after_step=after_step)
        return analysis, {**metrics, **work}

    def flops(self, traj: Trajectories, replay: SparseReplay | None, fused: bool
              ) -> dict[str, float]:
        """`learner/model_flops` of one `step` over `traj` (`cost_model.learner_flops`: every
        row at its padded prompt + response length; `ppo_epochs` forward+backward passes, plus
        the analysis forward when not fused and the sparse replay's forward when alpha_mode is
        "full" with a replay) and `learner/peak_flops`, the bf16 peak of every device together
        (measured where the table has a measurement), where the device is in the table."""
        rows = traj.tokens.shape[0]
        seq = traj.prompt_tokens.shape[1] + traj.tokens.shape[1]
        fields = {f: getattr(self.model.config, f) for f in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size")}
        forwards = (not fused) + (self.cfg.alpha_mode == AlphaMode.FULL and replay is not None)
        out = {"learner/model_flops": cost_model.learner_flops(
            cost_model.ModelShape.from_hf_config(fields), rows, seq,
            passes=self.cfg.ppo_epochs, forwards=forwards)}
        hw = cost_model.hardware_for_device(jax.devices()[0].device_kind)
        if hw is not None:
            out["learner/peak_flops"] = hw.learner_peak_flops * jax.device_count()
        return out
