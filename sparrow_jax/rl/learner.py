"""GRPO learner: dense old-policy logprobs + mismatch in one pass, then an exact micro-batched
AdamW update. Params and optimizer state keep the model's sharding.

One RL step's learner work:
  analyze(traj)  -> logp_old [B, T] (dense policy), alpha [B, T] (acceptance rate vs the sparse
                    actor), used by the schedule controller through mismatch.tail_by_bin
  update(batch)  -> micro-batches whose (loss_sum, grads) are summed against one global
                    denominator, so the step equals the full-batch step exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparrow_jax import mismatch
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM, chunked_causal_attention
from sparrow_jax.rl import grpo
from sparrow_jax.rollout.engine import Trajectories
from sparrow_jax.rollout.teacher_forced import (map_time_chunks, sparse_attention_fn,
                                                trajectory_hidden)

log = logging.getLogger(__name__)
ALPHA_MODES = ("full", "topk", "none")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    micro_batch_size: int = 0      # rows per micro-batch (multiple of the group size); 0 = all
    logit_chunk: int = 256         # time steps per [B, chunk, V] logits slice
    attention_chunk: int = 0       # queries per [B, H, chunk, <=T] score block, causal groups,
                                   # rematerialised in backward (long sequences); 0 = one-shot
    temperature: float = 1.0       # the sampling temperature: the policy is pi(.)^(1/T)
    alpha_mode: str = "full"       # "full": exact full-vocabulary alpha via a sparse replay
                                   # "topk": the paper's top-k lower bound (no extra forward)
                                   # "none": skip the mismatch statistic

    def __post_init__(self):
        if self.alpha_mode not in ALPHA_MODES:
            raise ValueError(f"alpha_mode must be one of {ALPHA_MODES}, got {self.alpha_mode!r}")
        if self.attention_chunk < 0:
            raise ValueError(f"LearnerConfig.attention_chunk must be >= 0 (0 = one-shot), got "
                             f"{self.attention_chunk}")
        if self.learning_rate <= 0 or self.micro_batch_size < 0 or self.logit_chunk <= 0:
            raise ValueError(f"bad learner config {self}")


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
    lr = (optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
          if cfg.warmup_steps else cfg.learning_rate)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LearnerBatch:
    """Per-row learner inputs; rows of a GRPO group are consecutive."""
    traj: Trajectories
    logp_old: jax.Array      # [B, T] dense policy before the update
    advantages: jax.Array    # [B]


@dataclasses.dataclass(frozen=True)
class SparseReplay:
    """How the rollout selected blocks, to replay it teacher-forced (for alpha_mode='full')."""
    bin_size: int
    max_selected: int
    block_size: int = 16
    dense_layers: tuple[int, ...] = (0, 1)


def _dense_attention(cfg: LearnerConfig):
    """The training forward's attention: one-shot, or query-chunked for long sequences."""
    return chunked_causal_attention(cfg.attention_chunk) if cfg.attention_chunk else None


def _analyze(model: Qwen3ForCausalLM, traj: Trajectories, budgets, replay: SparseReplay | None,
             cfg: LearnerConfig) -> dict[str, jax.Array]:
    hidden_d = trajectory_hidden(model, traj, attention_fn=_dense_attention(cfg))
    hidden_s = None
    if cfg.alpha_mode == "full" and replay is not None:
        fn = sparse_attention_fn(budgets=budgets, bin_size=replay.bin_size,
                                 prompt_lengths=traj.prompt_lengths,
                                 max_selected=replay.max_selected, block_size=replay.block_size,
                                 dense_layers=replay.dense_layers,
                                 query_chunk=cfg.attention_chunk)
        hidden_s = trajectory_hidden(model, traj, attention_fn=fn)
    k = traj.topk_ids.shape[-1]

    def chunk(h_d, tokens, top_v, top_i, h_s=None):
        lp_d = jax.nn.log_softmax(model.logits(h_d) / cfg.temperature, axis=-1)
        out = {"logp_old": jnp.take_along_axis(lp_d, tokens[..., None], -1)[..., 0]}
        if cfg.alpha_mode == "topk":
            dv, di = jax.lax.top_k(lp_d, k)
            out["alpha"] = mismatch.acceptance_rate_topk(top_v, top_i, dv, di)
        if h_s is not None:
            lp_s = jax.nn.log_softmax(model.logits(h_s) / cfg.temperature, axis=-1)
            out["alpha"] = mismatch.acceptance_rate_from_logprobs(lp_s, lp_d)
            out["logp_sparse_replay"] = jnp.take_along_axis(lp_s, tokens[..., None], -1)[..., 0]
        return out

    arrays = [hidden_d, traj.tokens, traj.topk_logprobs, traj.topk_ids]
    if hidden_s is not None:
        arrays.append(hidden_s)
    out = map_time_chunks(chunk, cfg.logit_chunk, *arrays)
    return jax.tree.map(lambda x: jnp.where(traj.mask, x, 0.0), out)


def split_micro_batches(tree, num_micro: int, row_shards: int = 1):
    """Rows `[B, ...]` of every leaf -> `[num_micro, B // num_micro, ...]` micro-batches.

    With `row_shards` = D > 1 (rows sharded D ways over the data axis), micro-batch j takes the
    j-th run of B / (D * num_micro) consecutive rows from *each* shard, so every micro-batch is
    spread over all data shards like the batch itself and slicing it moves no rows between
    devices. With D = 1 micro-batch j is rows [j * B / num_micro, (j + 1) * B / num_micro).
    """
    def split(x):
        per = x.shape[0] // (row_shards * num_micro)
        x = x.reshape(row_shards, num_micro, per, *x.shape[1:]).swapaxes(0, 1)
        return x.reshape(num_micro, row_shards * per, *x.shape[3:])
    return jax.tree.map(split, tree)


def merge_micro_batches(tree, row_shards: int = 1):
    """Inverse of `split_micro_batches`: `[num_micro, M, ...]` -> rows `[num_micro * M, ...]`."""
    def merge(x):
        n, m = x.shape[:2]
        x = x.reshape(n, row_shards, m // row_shards, *x.shape[2:]).swapaxes(0, 1)
        return x.reshape(n * m, *x.shape[3:])
    return jax.tree.map(merge, tree)


def data_row_shards(x: jax.Array, num_micro: int, group_size: int) -> int:
    """How many data shards the rows of `x` are split over, when micro-batches can take an equal
    run of whole groups from each of them (see `split_micro_batches`); otherwise 1."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return 1
    axes = sharding.spec[0]
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    return shards if x.shape[0] % (shards * num_micro * group_size) == 0 else 1


@functools.partial(jax.jit, static_argnames=("graphdef", "replay", "cfg", "num_micro",
                                             "row_shards"))
def _analyze_jit(graphdef, state, traj, budgets, *, replay, cfg, num_micro, row_shards):
    """All micro-batches of `_analyze` in one program (`lax.map`), rows back in batch order."""
    model = nnx.merge(graphdef, state)
    if num_micro == 1:
        return _analyze(model, traj, budgets, replay, cfg)
    parts = split_micro_batches(traj, num_micro, row_shards)
    out = jax.lax.map(lambda part: _analyze(model, part, budgets, replay, cfg), parts)
    return merge_micro_batches(out, row_shards)


def _loss_terms(params, rest, graphdef, batch: LearnerBatch, denominator, tis_mean,
                cfg: LearnerConfig, loss_cfg: grpo.LossConfig):
    model = nnx.merge(graphdef, params, rest)
    traj = batch.traj
    hidden = trajectory_hidden(model, traj, attention_fn=_dense_attention(cfg))

    def chunk(h, tok):
        lp = jax.nn.log_softmax(model.logits(h) / cfg.temperature, axis=-1)
        return jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]

    logp = map_time_chunks(chunk, cfg.logit_chunk, hidden, traj.tokens)
    loss_sum, _, sums = grpo.policy_loss_terms(
        logp, batch.logp_old, traj.logprobs, batch.advantages, traj.mask,
        clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high, dual_clip=loss_cfg.dual_clip,
        tis_cap=loss_cfg.tis_cap, aggregation=loss_cfg.aggregation, kl_coef=0.0,
        token_rejection=loss_cfg.token_rejection, sequence_veto=loss_cfg.sequence_veto,
        tis_renormalize=loss_cfg.tis_renormalize, tis_mean=tis_mean)
    return loss_sum / denominator, sums


def _empty_metric_sums(shapes: grpo.MetricSums) -> grpo.MetricSums:
    """Identity of `grpo.merge_metric_sums` for metric sums shaped like `shapes`."""
    def fill(name, v):
        value = -jnp.inf if name.endswith("_max") else jnp.inf if name.endswith("_min") else 0
        return jnp.full(v.shape, value, v.dtype)
    return {name: (fill(name, v), jnp.zeros(c.shape, c.dtype)) for name, (v, c) in shapes.items()}


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "loss_cfg", "num_micro",
                                             "row_shards"))
def _batch_grads(params, rest, batch: LearnerBatch, *, graphdef, cfg: LearnerConfig,
                 loss_cfg: grpo.LossConfig, num_micro: int, row_shards: int):
    """Full-batch (grads, metrics, loss), accumulated over micro-batches by a `lax.scan`.

    One program for the whole step: the global loss denominator and TIS mean, then the scan.
    Only one micro-batch's activations are alive at a time; the carry is the gradient sum.
    """
    traj = batch.traj
    eff = grpo.effective_mask(batch.logp_old, traj.logprobs, traj.mask,
                              token_rejection=loss_cfg.token_rejection,
                              sequence_veto=loss_cfg.sequence_veto)
    denominator = jnp.maximum(grpo.loss_denominator(eff, loss_cfg.aggregation), 1.0)
    tis_mean = jnp.float32(1.0)
    if loss_cfg.tis_renormalize:
        w_sum, n = grpo.tis_weight_sums(batch.logp_old, traj.logprobs, traj.mask,
                                        tis_cap=loss_cfg.tis_cap,
                                        token_rejection=loss_cfg.token_rejection,
                                        sequence_veto=loss_cfg.sequence_veto)
        tis_mean = w_sum / jnp.maximum(n, 1)
    grad_fn = jax.value_and_grad(_loss_terms, has_aux=True)

    def micro(part):
        (loss, sums), grads = grad_fn(params, rest, graphdef, part, denominator, tis_mean, cfg,
                                      loss_cfg)
        return grads, sums, loss

    if num_micro == 1:
        grads, sums, loss = micro(batch)
        return grads, grpo.finalize_metrics(sums), loss
    parts = split_micro_batches(batch, num_micro, row_shards)

    def step(carry, part):
        grads, sums, loss = micro(part)
        acc_grads, acc_sums, acc_loss = carry
        return (jax.tree.map(jnp.add, acc_grads, grads),
                grpo.merge_metric_sums(acc_sums, sums), acc_loss + loss), None

    shapes = jax.eval_shape(micro, jax.tree.map(lambda x: x[0], parts))
    init = (jax.tree.map(jnp.zeros_like, params), _empty_metric_sums(shapes[1]),
            jnp.zeros((), shapes[2].dtype))
    grads, sums, loss = jax.lax.scan(step, init, parts)[0]
    return grads, grpo.finalize_metrics(sums), loss


@functools.partial(jax.jit, static_argnames=("tx",), donate_argnums=(0, 1))
def _apply(params, opt_state, grads, *, tx):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


def _opt_state_shardings(tx: optax.GradientTransformation, params: nnx.State):
    """Shardings for `tx.init(params)`: moments shard like their parameter, counters and other
    scalars are replicated over the parameters' mesh. Without them jit places the (input-
    independent) zero moments on one device: unsharded Adam state on the first accelerator and
    a device-set clash when a checkpoint restores onto that layout."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    first = jax.tree.leaves(param_shardings)
    if not first or not isinstance(first[0], jax.sharding.NamedSharding):
        return None                 # unsharded model: one device, nothing to place
    replicated = jax.sharding.NamedSharding(first[0].mesh, jax.sharding.PartitionSpec())
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract, param_shardings,
                                 transform_non_params=lambda _: replicated)


class Learner:
    """Holds the policy (an NNX model updated in place) and its optimizer state."""

    def __init__(self, model: Qwen3ForCausalLM, cfg: LearnerConfig,
                 loss_cfg: grpo.LossConfig | None = None, *, group_size: int):
        self.model, self.cfg = model, cfg
        self.loss_cfg = loss_cfg or grpo.LossConfig()
        self.group_size = group_size
        if cfg.micro_batch_size and cfg.micro_batch_size % group_size:
            raise ValueError(f"micro_batch_size={cfg.micro_batch_size} must be a multiple of the "
                             f"group size {group_size} (groups are never split)")
        self.tx = make_optimizer(cfg)
        self.graphdef, _, self.rest = nnx.split(model, nnx.Param, ...)
        self._opt_state = None  # created on first use: analysis-only users never pay for Adam

    @property
    def opt_state(self):
        if self._opt_state is None:
            params = self.params
            self._opt_state = jax.jit(self.tx.init,
                                      out_shardings=_opt_state_shardings(self.tx, params))(params)
        return self._opt_state

    @opt_state.setter
    def opt_state(self, value) -> None:
        self._opt_state = value

    @property
    def params(self) -> nnx.State:
        return nnx.state(self.model, nnx.Param)

    def analyze(self, traj: Trajectories, budgets=None,
                replay: SparseReplay | None = None) -> dict[str, jax.Array]:
        """Dense logprobs of the sampled tokens (the PPO anchor) and per-token alpha."""
        graphdef, state = nnx.split(self.model)
        budgets = jnp.zeros((1,), jnp.int32) if budgets is None else jnp.asarray(budgets, jnp.int32)
        return _analyze_jit(graphdef, state, traj, budgets, replay=replay, cfg=self.cfg,
                            **self._micro_batching(traj.tokens))

    def _micro_batching(self, x: jax.Array) -> dict[str, int]:
        """Static micro-batch layout for a batch whose rows are `x`'s rows."""
        rows = x.shape[0]
        mb = self.cfg.micro_batch_size or rows
        if rows % mb:
            raise ValueError(f"batch of {rows} rows is not a multiple of micro_batch_size={mb}")
        num_micro = rows // mb
        shards = data_row_shards(x, num_micro, self.group_size) if num_micro > 1 else 1
        return {"num_micro": num_micro, "row_shards": shards}

    def advantages(self, rewards) -> jax.Array:
        return grpo.group_advantages(jnp.asarray(rewards, jnp.float32), self.group_size,
                                     normalize_std=self.loss_cfg.normalize_std,
                                     eps=self.loss_cfg.advantage_eps)

    def grads(self, batch: LearnerBatch) -> tuple[Any, dict[str, jax.Array], jax.Array]:
        """Exact full-batch gradient over micro-batches. Returns (grads, metrics, loss).

        One jitted program per call (not one per micro-batch and per parameter): a burst of
        small multi-device programs can starve XLA:CPU's launch threads when devices span
        processes (observed as a 2-process deadlock), and each dispatch costs latency anyway.
        """
        return _batch_grads(self.params, self.rest, batch, graphdef=self.graphdef, cfg=self.cfg,
                            loss_cfg=self.loss_cfg, **self._micro_batching(batch.traj.tokens))

    def update(self, batch: LearnerBatch) -> dict[str, float]:
        grads, metrics, loss = self.grads(batch)
        params, self.opt_state, gnorm = _apply(self.params, self.opt_state, grads, tx=self.tx)
        nnx.update(self.model, params)
        out = {f"loss/{k}": float(v) for k, v in metrics.items()}
        out.update({"loss/policy": float(loss), "loss/grad_norm": float(gnorm)})
        return out
