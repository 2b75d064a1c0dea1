"""DistillSparse: a LoRA adapter that exists only in the sparse actor (docs/method.md).

The adapter is trained to make the block-sparse actor agree with the dense policy, so a cheaper
KV budget meets the same tail acceptance rate. It lives beside the base weights, never inside the
NNX model:

  rollout        sparse actor = base + adapter, merged (`merge_lora`) into a copy of the weights
  analysis       dense logprobs from the base; alpha's sparse replay from the merged copy
                 (the actor that actually sampled)
  base update    PPO + TIS on the dense forward of the base alone (the adapter is absent)
  adapter update (after each base optimizer step, base frozen) a forward of the *updated* base +
                 adapter with training-time block-sparse attention (`sparse_attention_fn`:
                 layers 0 and 1 dense, mean-key blocks of 16, sink + last 2 blocks + top-k);
                 loss = pg_coef x PPO(logp_sparse vs the rollout's logprobs, the base's
                 advantages) + kl_coef x k3 KL(sparse || dense logprobs from before the update)

Layout of the adapter pytree (plain nested dicts, f32, replicated: `ADAPTER_AXES`):
`lora["layers"]["<i>"]["<q|k|v|o|gate|up|down>_proj"] = {"a": [in, r], "b": [r, out]}`. NNX
kernels are stored [in, out] (y = x @ W), so the adapted kernel is `W + a @ b x alpha / rank`
(the torch form W + B @ A x alpha / r with W [out, in], A = a^T, B = b^T). `a` starts small
normal, `b` at zero: a fresh adapter changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax.model.qwen3 import Qwen3ForCausalLM, compute_copy
from sparrow_jax.rl import grpo
from sparrow_jax.rl.learner_programs import (LearnerBatch, ProgramOptions, SparseReplay,
                                             opt_state_shardings, split_micro_batches)
from sparrow_jax.rollout.teacher_forced import (map_time_chunks, sparse_attention_fn,
                                                trajectory_hidden)
from sparrow_jax.runtime.checkpoint import tree_path_names
from sparrow_jax.runtime.sharding import LogicalAxes, tree_shardings
from sparrow_jax.runtime.shapes import COMPILES

# The adapted linear layers: name -> the sub-module of a decoder layer holding it.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Logical axes of the adapter's factors, a [in, r] and b [r, out]: replicated - rank-r factors
# are small next to the weights they adapt, and a replica spares the merge any communication.
ADAPTER_AXES: dict[str, LogicalAxes] = {"a": (None, None), "b": (None, None)}
_K3_CLAMP = 10.0
LoRA = dict[str, Any]

__all__ = ["ADAPTER_AXES", "DistillConfig", "Distiller", "TARGETS", "adapter_axes", "init_lora",
           "merge_lora", "merge_lora_model", "distill_program"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DistillConfig:
    rank: int = 0                  # LoRA rank; 0 = no adapter (the default)
    alpha: float = 16.0            # LoRA alpha: the update is a @ b x alpha / rank
    lr_scale: float = 5.0          # adapter learning rate = LearnerConfig.learning_rate x this
    warmup_steps: int = 0          # linear warm-up of the adapter's learning rate (its own steps)
    grad_clip: float = 1.0         # global-norm clip of the adapter's gradient
    weight_decay: float = 0.0
    kl_coef: float = 1e-3          # x k3 KL(sparse || dense) on the sampled tokens
    pg_coef: float = 1.0           # x PPO on the sparse logprobs (0: distill by KL alone)
    budget_blocks: int = 32        # blocks (of the rollout's block size) kept per query in the
                                   # adapter's training forward, at every length (official: 32)
    use_schedule: bool = False     # True: the rollout's current per-bin schedule instead
    init_std: float = 0.0          # std of a's normal init; 0 = 1 / rank
    seed: int = 0

    def __post_init__(self):
        if self.rank < 0 or self.budget_blocks < 3 or self.lr_scale <= 0 or self.alpha <= 0:
            raise ValueError(f"bad DistillConfig {self} (rank >= 0, budget_blocks >= 3: the sink "
                             "and the last 2 blocks; lr_scale, alpha > 0)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


# -- the adapter as a pytree -----------------------------------------------------------------------
def _kernel_paths(params) -> dict[tuple[str, str], tuple[tuple[Any, ...], Any]]:
    """{(layer index, target name): (jax key path, kernel)} of every adapted kernel in `params`
    (an NNX Param state of Qwen3ForCausalLM)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = tree_path_names(path)
        if (len(names) >= 5 and names[0] == "layers" and names[4] == "kernel"
                and TARGETS.get(names[3]) == names[2]):
            out[(names[1], names[3])] = (path, leaf)
    return out


def adapter_axes(path: tuple[Any, ...], leaf: Any) -> LogicalAxes:
    """The declared logical axes (`ADAPTER_AXES`) of the adapter leaf at jax tree `path`; an
    error naming the path for a leaf that is no adapter factor."""
    names = tree_path_names(path)
    if not names or names[-1] not in ADAPTER_AXES:
        raise ValueError(f"adapter leaf {'/'.join(names)!r} declares no logical axes (the "
                         f"adapter holds only {sorted(ADAPTER_AXES)} factors)")
    return ADAPTER_AXES[names[-1]]


def init_lora(params, rank: int, *, key: jax.Array, std: float = 0.0) -> LoRA:
    """A fresh adapter for `params`: a ~ N(0, std^2) (std 0 = 1 / rank), b = 0, f32, placed per
    `ADAPTER_AXES` (replicated) on the parameters' mesh."""
    kernels = _kernel_paths(params)
    if not kernels:
        raise ValueError("no q/k/v/o/gate/up/down_proj kernels found in the parameters")
    lora = _init_from_shapes({k: leaf.shape for k, (_, leaf) in kernels.items()}, rank, key, std)
    sharding = getattr(next(iter(kernels.values()))[1], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        lora = jax.device_put(lora, tree_shardings(lora, adapter_axes, sharding.mesh))
    return lora


def _init_from_shapes(shapes, rank: int, key, std: float) -> LoRA:
    std = std or 1.0 / rank
    layers: dict[str, dict[str, dict[str, jax.Array]]] = {}
    for n, ((layer, name), (din, dout)) in enumerate(
            sorted(shapes.items(), key=lambda kv: (int(kv[0][0]), kv[0][1]))):
        a = std * jax.random.normal(jax.random.fold_in(key, n), (din, rank), jnp.float32)
        layers.setdefault(layer, {})[name] = {"a": a, "b": jnp.zeros((rank, dout), jnp.float32)}
    return {"layers": layers}


def abstract_state(params, rank: int, *, sharding=None) -> dict[str, Any]:
    """The abstract {"lora", "opt_state"} pytree `Distiller.state()` saves for `params` (arrays or
    ShapeDtypeStructs) at `rank`, every leaf placed on `sharding` (a restore target)."""
    shapes = {key: leaf.shape for key, (_, leaf) in _kernel_paths(params).items()}
    tx, _ = make_optimizer(DistillConfig(rank=rank), 1.0)

    def build():
        lora = _init_from_shapes(shapes, rank, jax.random.key(0), 0.0)
        return {"lora": lora, "opt_state": tx.init(lora)}
    tree = jax.eval_shape(build)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def lora_rank(lora: LoRA) -> int:
    first = next(iter(next(iter(lora["layers"].values())).values()))
    return int(first["a"].shape[1])


def merge_lora(base_params, lora: LoRA, *, alpha: float, rank: int):
    """Pure: `base_params` (a Param state or any pytree with the model's paths) with every adapted
    kernel W [in, out] replaced by W + a @ b x alpha / rank (in W's dtype); other leaves as they
    are. Differentiable in both arguments; jittable."""
    scale = alpha / rank

    def merge(path, w):
        names = tree_path_names(path)
        if len(names) < 5 or names[0] != "layers" or names[4] != "kernel":
            return w
        ab = lora["layers"].get(names[1], {}).get(names[3])
        if ab is None or TARGETS.get(names[3]) != names[2]:
            return w
        delta = jnp.dot(ab["a"], ab["b"], preferred_element_type=jnp.float32) * scale
        return w + delta.astype(w.dtype)

    return jax.tree_util.tree_map_with_path(merge, base_params)


def merge_lora_model(model: Qwen3ForCausalLM, lora: LoRA, *, alpha: float) -> Qwen3ForCausalLM:
    """A new model whose weights are `model`'s merged with the adapter (`model` is untouched)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    merged = _merge_jit(params, lora, alpha=alpha, rank=lora_rank(lora))
    return nnx.merge(graphdef, merged, rest)


@functools.partial(jax.jit, static_argnames=("alpha", "rank"))
def _merge_jit(params, lora, *, alpha, rank):
    return merge_lora(params, lora, alpha=alpha, rank=rank)


# -- the adapter's loss and update ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """Static settings of the adapter program (hashable)."""
    alpha: float
    rank: int
    kl_coef: float
    pg_coef: float
    selection: SparseReplay        # block selection of the adapter's training forward


def sparse_logprobs(model: Qwen3ForCausalLM, traj, budgets, selection: SparseReplay,
                    opts: ProgramOptions) -> jax.Array:
    """log p of the sampled tokens [B, T] under the teacher-forced block-sparse forward (the
    rollout's selection rule with `budgets` per length bin, at most `selection.max_selected`
    blocks), in the rollout's sampling distribution."""
    fn = sparse_attention_fn(budgets=budgets, bin_size=selection.bin_size,
                             prompt_lengths=traj.prompt_lengths,
                             max_selected=selection.max_selected,
                             block_size=selection.block_size,
                             dense_layers=selection.dense_layers,
                             query_chunk=opts.attention_chunk)
    hidden = trajectory_hidden(model, traj, attention_fn=fn, block_size=selection.block_size,
                               remat=opts.remat, residual_spec=opts.residual_spec)

    def chunk(h, tokens):
        lp = opts.sampling.logprobs(model.logits(h))
        return jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0]
    return map_time_chunks(chunk, opts.logit_chunk, hidden, traj.tokens)


def _adapter_ppo_config(loss_cfg: grpo.LossConfig) -> grpo.LossConfig:
    """The adapter's PPO loss: the base's clipping and aggregation, none of the rollout
    corrections (no TIS, rejection, veto or renormalisation: its anchor is the rollout itself)."""
    return dataclasses.replace(loss_cfg, tis_cap=None, kl_coef=0.0, token_rejection=None,
                               sequence_veto=None, tis_renormalize=False)


def _adapter_loss(lora, params, rest, graphdef, batch: LearnerBatch, budgets, denominator,
                  num_tokens, opts: ProgramOptions, dopts: DistillOptions,
                  loss_cfg: grpo.LossConfig):
    """(loss of one micro-batch against the mini-batch's global normalisers, metric sums)."""
    merged = merge_lora(jax.lax.stop_gradient(params), lora, alpha=dopts.alpha, rank=dopts.rank)
    model = nnx.merge(graphdef, merged, rest)
    traj = batch.traj
    logp = sparse_logprobs(model, traj, budgets, dopts.selection, opts)
    # PPO against the rollout's own logprobs (the sparse actor that sampled): ratio = pi_s /
    # pi_rollout, so logp_old = logp_rollout and the TIS weight is 1.
    pg_sum, _, sums = grpo.policy_loss_terms(logp, traj.logprobs, traj.logprobs,
                                             batch.advantages, traj.mask,
                                             _adapter_ppo_config(loss_cfg))
    valid = traj.mask > 0
    # k3 estimator of KL(sparse || dense) from tokens the sparse actor sampled.
    log_r = jnp.where(valid, batch.logp_old, 0.0) - jnp.where(valid, logp, 0.0)
    k3 = jnp.where(valid, jnp.clip(jnp.exp(log_r) - log_r - 1.0, -_K3_CLAMP, _K3_CLAMP), 0.0)
    kl_sum = jnp.sum(k3)
    loss = dopts.pg_coef * pg_sum / denominator + dopts.kl_coef * kl_sum / num_tokens
    n = jnp.sum(valid, dtype=jnp.float32)
    sums = {k: sums[k] for k in ("ratio_mean", "ratio_max", "ratio_min", "clipfrac_high",
                                 "clipfrac_low")}
    sums["kl"] = (kl_sum, n)
    return loss, (sums, pg_sum / denominator)


@functools.partial(jax.jit, static_argnames=("graphdef", "opts", "dopts", "loss_cfg", "tx",
                                             "num_mini", "num_micro", "row_shards"),
                   donate_argnums=(0, 1))
def distill_program(lora, opt_state, params, rest, batch: LearnerBatch, budgets, mini_index, *,
                    graphdef, opts: ProgramOptions, dopts: DistillOptions,
                    loss_cfg: grpo.LossConfig, tx: optax.GradientTransformation, num_mini: int,
                    num_micro: int, row_shards: int):
    """One adapter optimizer step on mini-batch `mini_index` of `batch` (base `params` frozen).

    The gradient is the mini-batch's exact one, accumulated over `num_micro` micro-batches by a
    `lax.scan` against global normalisers (as `learner_programs.grads_program`). A step whose
    loss or gradient is not finite is skipped: adapter and optimizer state come back unchanged.
    Returns (lora, opt_state, metrics); lora and opt_state are donated.
    """
    if num_mini > 1:
        batch = jax.tree.map(lambda x: x[mini_index],
                             split_micro_batches(batch, num_mini, row_shards))
    valid = batch.traj.mask > 0
    denominator = jnp.maximum(grpo.loss_denominator(valid, loss_cfg.aggregation), 1.0)
    num_tokens = jnp.maximum(jnp.sum(valid, dtype=jnp.float32), 1.0)
    grad_fn = jax.value_and_grad(_adapter_loss, has_aux=True)

    def micro(part):
        (loss, (sums, pg)), grads = grad_fn(lora, params, rest, graphdef, part, budgets,
                                            denominator, num_tokens, opts, dopts, loss_cfg)
        return grads, sums, loss, pg

    if num_micro == 1:
        grads, sums, loss, pg = micro(batch)
    else:
        parts = split_micro_batches(batch, num_micro, row_shards)

        def step(carry, part):
            grads, sums, loss, pg = micro(part)
            acc_grads, acc_sums, acc_loss, acc_pg = carry
            return (jax.tree.map(jnp.add, acc_grads, grads),
                    grpo.merge_metric_sums(acc_sums, sums), acc_loss + loss, acc_pg + pg), None

        shapes = jax.eval_shape(micro, jax.tree.map(lambda x: x[0], parts))
        zero = jnp.zeros((), jnp.float32)
        init = (jax.tree.map(jnp.zeros_like, lora), grpo.empty_metric_sums(shapes[1]), zero, zero)
        (grads, sums, loss, pg), _ = jax.lax.scan(step, init, parts)
    gnorm = optax.tree.norm(grads)
    updates, new_state = tx.update(grads, opt_state, lora)
    new_lora = optax.apply_updates(lora, updates)
    ok = jnp.isfinite(gnorm) & jnp.isfinite(loss)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    metrics = {**grpo.finalize_metrics(sums), "loss": loss, "pg_loss": pg, "grad_norm": gnorm,
               "skipped": 1.0 - ok.astype(jnp.float32)}
    return keep(new_lora, lora), keep(new_state, opt_state), metrics


def make_optimizer(cfg: DistillConfig, base_lr: float, *, b1: float = 0.9,
                   b2: float = 0.999) -> tuple[optax.GradientTransformation, Callable]:
    """(AdamW with global-norm clipping at lr_scale x base_lr, its learning-rate schedule). The
    chain is clip, adam, decay, lr: state[1] is Adam's, whose count is the number of applied
    (non-skipped) adapter steps."""
    lr = base_lr * cfg.lr_scale
    schedule = (optax.linear_schedule(0.0, lr, cfg.warmup_steps) if cfg.warmup_steps
                else optax.constant_schedule(lr))
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.scale_by_adam(b1=b1, b2=b2),
                     optax.add_decayed_weights(cfg.weight_decay),
                     optax.scale_by_learning_rate(schedule))
    return tx, schedule


class Distiller:
    """The adapter, its AdamW state, and its update; reads the base from `learner` (frozen).

    `selection` is the rollout's block selection (bin size, block size, dense layers, widest
    selection); with `use_schedule` False the adapter's forward keeps `budget_blocks` blocks
    at every length instead of the schedule's per-bin budgets.
    """

    def __init__(self, cfg: DistillConfig, learner, selection: SparseReplay):
        if not cfg.enabled:
            raise ValueError("Distiller needs DistillConfig.rank > 0")
        self.cfg, self.learner = cfg, learner
        self.tx, self.schedule = make_optimizer(cfg, learner.cfg.learning_rate,
                                                b1=learner.cfg.b1, b2=learner.cfg.b2)
        if not cfg.use_schedule:
            selection = dataclasses.replace(selection, max_selected=cfg.budget_blocks)
        self.dopts = DistillOptions(alpha=cfg.alpha, rank=cfg.rank, kl_coef=cfg.kl_coef,
                                    pg_coef=cfg.pg_coef, selection=selection)
        self.lora = init_lora(learner.params, cfg.rank, key=jax.random.key(cfg.seed),
                              std=cfg.init_std)
        self.opt_state = jax.jit(self.tx.init, out_shardings=opt_state_shardings(
            self.tx, self.lora))(self.lora)

    def sparse_model(self, model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
        """The sparse actor for rollout: `model` + adapter merged, cast to the compute dtype."""
        return compute_copy(merge_lora_model(model, self.lora, alpha=self.cfg.alpha))

    def train_budgets(self, schedule_budgets) -> jax.Array:
        """Per-bin token budgets of the adapter's training forward."""
        schedule_budgets = np.asarray(schedule_budgets, np.int32)
        if self.cfg.use_schedule:
            return jnp.asarray(schedule_budgets)
        block = self.dopts.selection.block_size
        return jnp.full(schedule_budgets.shape, self.cfg.budget_blocks * block, jnp.int32)

    @property
    def num_steps(self) -> int:
        return int(self.opt_state[1].count)

    def update(self, batch: LearnerBatch, mini_index: int, num_mini: int,
               schedule_budgets) -> dict[str, float]:
        """One adapter step on mini-batch `mini_index` of `batch` (batch.logp_old = the dense
        logprobs before the base update). Returns `distill/*` metrics."""
        if batch.logp_old is None:
            raise ValueError("the adapter's KL needs the dense logprobs (batch.logp_old)")
        learner = self.learner
        layout = learner.micro_batch_layout(batch.traj.tokens, num_mini)
        COMPILES.note("distill/update", rows=batch.traj.tokens.shape[0],
                      prompt_width=batch.traj.prompt_tokens.shape[1],
                      response=batch.traj.tokens.shape[1], num_mini=num_mini, **layout)
        lr = float(self.schedule(self.num_steps))
        self.lora, self.opt_state, metrics = distill_program(
            self.lora, self.opt_state, learner.params, learner.rest, batch,
            self.train_budgets(schedule_budgets), jnp.int32(mini_index),
            graphdef=learner.graphdef, opts=learner.opts, dopts=self.dopts,
            loss_cfg=learner.loss_cfg, tx=self.tx, num_mini=num_mini, **layout)
        out = {f"distill/{k}": float(v) for k, v in metrics.items()}
        out["distill/lr"] = lr
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The adapter and its optimizer state as one pytree (a checkpoint item)."""
        return {"lora": self.lora, "opt_state": self.opt_state}

    def load_state(self, state: dict[str, Any]) -> None:
        self.lora, self.opt_state = state["lora"], state["opt_state"]
