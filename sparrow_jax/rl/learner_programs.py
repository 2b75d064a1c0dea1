"""The learner's compiled programs: analysis (dense logprobs + alpha), gradients, the update.

Each is one jitted program per call (never one per micro-batch or per parameter: a burst of
small multi-device programs starved XLA:CPU's launch threads in 2-process runs, and every
dispatch costs latency anyway). Row layout: a batch `[B, ...]` whose rows may be sharded D ways
over the data axis is split into mini-batches (one optimizer step each) and those into
micro-batches (gradient accumulation) by `split_micro_batches`, which takes an equal run of
whole groups from every data shard, so slicing never moves rows between devices.

The analysis the programs hand back is a `TokenAnalysis` (a pytree of per-token arrays); the
learner's modes are `AlphaMode` and `RematMode` (strings in gin files, checked at config time).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparrow_jax.model.attention import chunked_causal_attention
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM, RematMode
from sparrow_jax.rl import grpo
from sparrow_jax.rollout.config import RolloutMode
from sparrow_jax.rollout.sampling import SamplingParams
from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.rollout.teacher_forced import (map_time_chunks, sparse_attention_fn,
                                                trajectory_hidden)
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import mismatch
from sparrow_jax.sparsity.mismatch import AlphaMode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenAnalysis:
    """The learner's per-token analysis of a batch; each field [B, T] float32, 0 at padding.

    logp_old: log pi_old of the sampled tokens (the dense policy before the update; the PPO
        anchor), under the rollout's sampling distribution.
    alpha: the sparse actor's acceptance rate per token (`AlphaMode.FULL`: exact, from the
        replay; `TOPK`: the top-k lower bound); None with `NONE`, or "full" without a replay.
    logp_sparse_replay: log-prob of the sampled tokens under the teacher-forced replay of the
        sparse actor (`FULL` with a replay only), else None.
    """
    logp_old: jax.Array
    alpha: jax.Array | None = None
    logp_sparse_replay: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LearnerBatch:
    """Per-row learner inputs; rows of a GRPO group are consecutive."""
    traj: Trajectories
    logp_old: jax.Array | None   # [B, T] dense policy before the update; None = computed by the
                                 # gradient program itself (one mini-batch, one epoch: pi = pi_old)
    advantages: jax.Array        # [B]


@dataclasses.dataclass(frozen=True)
class SparseReplay:
    """How the rollout selected blocks, to replay it teacher-forced (for alpha_mode='full')."""
    bin_size: int
    max_selected: int
    block_size: int = 16
    dense_layers: tuple[int, ...] = (0, 1)
    # The rollout mode replayed: "sparse" (block top-k), or "compress" (a KV-compressed
    # rollout: traj.evicted_at)
    mode: RolloutMode = RolloutMode.SPARSE


@dataclasses.dataclass(frozen=True)
class ProgramOptions:
    """The static settings the programs need (hashable: a jit static argument)."""
    logit_chunk: int
    attention_chunk: int
    remat: RematMode
    alpha_mode: AlphaMode
    sampling: SamplingParams
    # The gradient forward's residual stream [B, T, H] between layers (sequence parallelism over
    # the model axis, `sharding.residual_spec`); None = XLA's choice.
    residual_spec: ShardingSpec | None = None
    # The parameters' shardings (flattened): gradients are pinned to them. Without the pin,
    # sequence-parallel residuals let XLA return the gradients replicated over the model axis
    # (measured with `sparrow dryrun`, Qwen3-8B on v5p-32: 9.4 -> 28.8 GiB of outputs per chip).
    param_shardings: tuple[jax.sharding.Sharding, ...] | None = None


def _like_params(tree, opts: ProgramOptions):
    """`tree` (a parameter-shaped pytree, e.g. gradients) constrained to the parameters'
    shardings (`opts.param_shardings`; unchanged when None)."""
    if opts.param_shardings is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(x, s) for x, s
                                        in zip(leaves, opts.param_shardings, strict=True)])


def _dense_attention(opts: ProgramOptions):
    """The training forward's attention: one-shot, or query-chunked for long sequences."""
    return chunked_causal_attention(opts.attention_chunk) if opts.attention_chunk else None


def _sparse_hidden(model, traj: Trajectories, budgets, replay: SparseReplay | None,
                   opts: ProgramOptions):
    """The teacher-forced replay of the sparse actor, [B, T, H], or None (no alpha replay)."""
    if opts.alpha_mode != AlphaMode.FULL or replay is None:
        return None
    if replay.mode == RolloutMode.COMPRESS:
        from sparrow_jax.rollout.compress import replay_attention_fn
        fn = replay_attention_fn(traj.evicted_at, query_chunk=opts.attention_chunk)
        return jax.lax.stop_gradient(trajectory_hidden(model, traj, attention_fn=fn))
    fn = sparse_attention_fn(budgets=budgets, bin_size=replay.bin_size,
                             prompt_lengths=traj.prompt_lengths, max_selected=replay.max_selected,
                             block_size=replay.block_size, dense_layers=replay.dense_layers,
                             query_chunk=opts.attention_chunk)
    return jax.lax.stop_gradient(trajectory_hidden(model, traj, attention_fn=fn))


def _token_outputs(model, opts: ProgramOptions, hidden_d, traj: Trajectories, hidden_s=None,
                   model_s=None) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Per-token outputs from hidden states, `logit_chunk` steps at a time (each chunk
    rematerialised, see map_time_chunks): (logp, alpha, logp_sparse_replay), each [B, T] or None.
    logp: the sampled tokens under the dense policy (differentiable); from the same logits,
    alpha per `opts.alpha_mode`, and the replay's logp (the replay's logits from `model_s`, the
    sparse actor's weights; default `model`) when `hidden_s` is given."""
    k = traj.topk_ids.shape[-1]
    if opts.alpha_mode == AlphaMode.TOPK and k == 0:
        raise ValueError("alpha_mode='topk' reads the rollout's recorded top-k, but these "
                         "trajectories recorded none (RolloutConfig.record_topk = 0, see "
                         "RolloutConfig.for_alpha_mode)")
    model_s = model if model_s is None else model_s

    def chunk(h_d, tokens, top_v, top_i, h_s=None):
        logits_d = model.logits(h_d)
        lp_d = opts.sampling.logprobs(logits_d)
        logp = jnp.take_along_axis(lp_d, tokens[..., None], -1)[..., 0]
        lp_d = jax.lax.stop_gradient(lp_d)
        alpha = logp_replay = None
        if opts.alpha_mode == AlphaMode.TOPK:
            # The paper's lower bound compares the untruncated top-k on both sides (the rollout
            # records its top-k at the sampling temperature, untruncated).
            t = opts.sampling.temperature or 1.0
            dv, di = jax.lax.top_k(jax.nn.log_softmax(
                jax.lax.stop_gradient(logits_d) / t, axis=-1), k)
            alpha = mismatch.acceptance_rate_topk(top_v, top_i, dv, di)
        if h_s is not None:
            lp_s = opts.sampling.logprobs(model_s.logits(h_s))
            alpha = mismatch.acceptance_rate_from_logprobs(lp_s, lp_d)
            logp_replay = jnp.take_along_axis(lp_s, tokens[..., None], -1)[..., 0]
        return logp, alpha, logp_replay

    arrays = [hidden_d, traj.tokens, traj.topk_logprobs, traj.topk_ids]
    if hidden_s is not None:
        arrays.append(hidden_s)
    return map_time_chunks(chunk, opts.logit_chunk, *arrays)


def _token_analysis(logp_old, alpha, logp_sparse_replay, mask) -> TokenAnalysis:
    """The outputs as a TokenAnalysis, padding zeroed (`mask` [B, T])."""
    return jax.tree.map(lambda x: jnp.where(mask, x, 0.0),
                        TokenAnalysis(logp_old, alpha, logp_sparse_replay))


def _analyze(model, traj: Trajectories, budgets, replay, opts: ProgramOptions,
             model_s=None) -> TokenAnalysis:
    """model: the dense policy; model_s: the sparse actor's weights for the replay (default
    `model`; e.g. base + a DistillSparse adapter, sparrow_jax.rl.distill)."""
    model_s = model if model_s is None else model_s
    hidden_d = trajectory_hidden(model, traj, attention_fn=_dense_attention(opts))
    outputs = _token_outputs(model, opts, hidden_d, traj,
                             _sparse_hidden(model_s, traj, budgets, replay, opts), model_s)
    return _token_analysis(*outputs, traj.mask)


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


def data_row_shards(x: jax.Array, num_parts: int) -> int:
    """How many data shards the rows of `x` are split over, when `num_parts` parts (mini x
    micro-batches) can each take an equal run of rows from every shard (see
    `split_micro_batches`); otherwise 1. Runs need not hold whole GRPO groups: advantages are
    per-row inputs by then, and the loss has no cross-row terms besides its global denominator."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return 1
    axes = sharding.spec[0]
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    return shards if x.shape[0] % (shards * num_parts) == 0 else 1


@functools.partial(jax.jit, static_argnames=("graphdef", "replay", "opts", "num_micro",
                                             "row_shards"))
def analyze_program(graphdef, state, traj, budgets, *, replay, opts: ProgramOptions,
                    num_micro: int, row_shards: int, sparse_state=None) -> TokenAnalysis:
    """All micro-batches of `_analyze` in one program (`lax.map`), rows back in batch order.
    `sparse_state` (a state for `graphdef`, e.g. the merged rollout copy): the weights of the
    sparse actor the alpha replay runs; None = `state`'s."""
    model = nnx.merge(graphdef, state)
    model_s = None if sparse_state is None else nnx.merge(graphdef, sparse_state)
    if num_micro == 1:
        return _analyze(model, traj, budgets, replay, opts, model_s)
    parts = split_micro_batches(traj, num_micro, row_shards)
    out = jax.lax.map(lambda part: _analyze(model, part, budgets, replay, opts, model_s), parts)
    return merge_micro_batches(out, row_shards)


def loss_terms(params, rest, graphdef, batch: LearnerBatch, budgets, denominator, tis_mean,
                opts: ProgramOptions, loss_cfg: grpo.LossConfig, replay: SparseReplay | None,
                sparse_params=None):
    """(loss_sum / denominator, (metric sums, analysis)) of one micro-batch; the analysis (a
    TokenAnalysis) only when fused (`batch.logp_old` None), else None.
    `sparse_params` (not differentiated): the sparse actor's weights for the fused alpha replay;
    None = `params`."""
    model = nnx.merge(graphdef, params, rest)
    model_s = model if sparse_params is None else nnx.merge(graphdef, sparse_params, rest)
    traj = batch.traj
    hidden = trajectory_hidden(model, traj, attention_fn=_dense_attention(opts),
                               remat=opts.remat, residual_spec=opts.residual_spec)
    fused = batch.logp_old is None
    hidden_s = _sparse_hidden(model_s, traj, budgets, replay, opts) if fused else None
    logp, alpha, logp_sparse_replay = _token_outputs(model, opts, hidden, traj, hidden_s, model_s)
    # Fused (one mini-batch, one epoch): the parameters are still pi_old's, so pi_old's logprobs
    # are this forward's, not a second forward's.
    logp_old = jax.lax.stop_gradient(logp) if fused else batch.logp_old
    # No reference policy here (logp_ref None): LossConfig.kl_coef adds nothing.
    loss_sum, _, sums = grpo.policy_loss_terms(logp, logp_old, traj.logprobs, batch.advantages,
                                               traj.mask, loss_cfg, tis_mean=tis_mean)
    analysis = (_token_analysis(logp_old, alpha, logp_sparse_replay, traj.mask) if fused
                else None)
    return loss_sum / denominator, (sums, analysis)


def fusable(loss_cfg: grpo.LossConfig) -> bool:
    """Whether pi_old's logprobs may come from the gradient forward itself: the loss's global
    denominator and TIS mean must not depend on them (no rejection, veto or renormalisation)."""
    return (loss_cfg.token_rejection is None and loss_cfg.sequence_veto is None
            and not loss_cfg.tis_renormalize)


@functools.partial(jax.jit, static_argnames=("graphdef", "opts", "loss_cfg", "replay",
                                             "num_mini", "num_micro", "row_shards"))
def grads_program(params, rest, batch: LearnerBatch, budgets, mini_index, *, graphdef,
                  opts: ProgramOptions, loss_cfg: grpo.LossConfig,
                  replay: SparseReplay | None, num_mini: int, num_micro: int, row_shards: int,
                  sparse_params=None):
    """Gradient of mini-batch `mini_index` (traced: one program for all of them) of `batch`.

    Returns (grads, metrics, loss, analysis): the mini-batch's exact gradient, accumulated over
    `num_micro` micro-batches by a `lax.scan` against one global denominator (only one
    micro-batch's activations alive at a time; the carry is the gradient sum); analysis: the
    mini-batch's TokenAnalysis in its row order when `batch.logp_old` is None, else None.
    `sparse_params`: the sparse actor's Param state for that fused alpha replay (None: `params`).
    """
    if num_mini > 1:
        batch = jax.tree.map(lambda x: x[mini_index],
                             split_micro_batches(batch, num_mini, row_shards))
    traj = batch.traj
    if batch.logp_old is None:
        eff = traj.mask > 0
    else:
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
    grad_fn = jax.value_and_grad(loss_terms, has_aux=True)

    def micro(part):
        (loss, (sums, analysis)), grads = grad_fn(params, rest, graphdef, part, budgets,
                                                  denominator, tis_mean, opts, loss_cfg, replay,
                                                  sparse_params)
        return _like_params(grads, opts), sums, loss, analysis

    if num_micro == 1:
        grads, sums, loss, analysis = micro(batch)
        return grads, grpo.finalize_metrics(sums), loss, analysis
    parts = split_micro_batches(batch, num_micro, row_shards)

    def step(carry, part):
        grads, sums, loss, analysis = micro(part)
        acc_grads, acc_sums, acc_loss = carry
        return (jax.tree.map(jnp.add, acc_grads, grads),
                grpo.merge_metric_sums(acc_sums, sums), acc_loss + loss), analysis

    shapes = jax.eval_shape(micro, jax.tree.map(lambda x: x[0], parts))
    init = (_like_params(jax.tree.map(jnp.zeros_like, params), opts),
            grpo.empty_metric_sums(shapes[1]), jnp.zeros((), shapes[2].dtype))
    (grads, sums, loss), analysis = jax.lax.scan(step, init, parts)
    return grads, grpo.finalize_metrics(sums), loss, merge_micro_batches(analysis, row_shards)


@functools.partial(jax.jit, static_argnames=("tx",), donate_argnums=(0, 1))
def apply_program(params, opt_state, grads, loss=None, *, tx):
    """One optimizer step on the (f32 master) parameters; params and state are donated.

    Returns (params, opt_state, grad norm, applied): a non-finite gradient, update or `loss`
    skips the step - parameters and optimizer state come back bit-identical (applied False)."""
    gnorm = optax.tree.norm(grads)
    updates, new_state = tx.update(grads, opt_state, params)
    applied = jnp.isfinite(gnorm) & jnp.isfinite(optax.tree.norm(updates))
    if loss is not None:
        applied &= jnp.isfinite(loss)
    keep = lambda new, old: jnp.where(applied, new, old)  # noqa: E731
    return (jax.tree.map(keep, optax.apply_updates(params, updates), params),
            jax.tree.map(keep, new_state, opt_state), gnorm, applied)


def opt_state_shardings(tx: optax.GradientTransformation, params: nnx.State):
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


def check_model(model: Qwen3ForCausalLM) -> None:
    """Master parameters must be able to hold an lr-1e-6 update."""
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    if any(jnp.dtype(d).itemsize < 4 for d in dtypes):
        logging.getLogger(__name__).warning(
            "the learner's parameters are %s: AdamW updates at small learning rates "
            "round to nothing in 16-bit floats (bf16 spacing near 0.03 is ~1.2e-4). Keep master "
            "weights in float32 (TrainConfig.param_dtype = 'float32'); the compute dtype is "
            "TrainConfig.dtype.", sorted(jnp.dtype(d).name for d in dtypes))
