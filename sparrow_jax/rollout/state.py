"""What every rollout engine shares: the trajectories it returns, the decode state, budgets per
length, per-token sampling and recording, prompt validation. The engines (static.py,
continuous.py + paged.py paged, compress.py KV eviction) import this module, never each other."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.kv_cache import KVCache
from sparrow_jax.rollout.sampling import sample_rows, topk_logprobs
from sparrow_jax.runtime import multihost
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity.schedule import DENSE_BUDGET


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Trajectories:
    """What the learner needs from a rollout. B rows = prompts x group size (consecutive groups)."""
    prompt_tokens: jax.Array    # [B, P] int32, right-padded
    prompt_lengths: jax.Array   # [B] int32
    tokens: jax.Array           # [B, T] int32 generated ids (pad after the end)
    logprobs: jax.Array         # [B, T] f32 sparse actor's logprob of each token (as sampled)
    topk_logprobs: jax.Array    # [B, T, k] f32 sparse actor's top-k (temperature, untruncated)
    topk_ids: jax.Array         # [B, T, k] int32
    budgets: jax.Array          # [B, T] int32 token budget used (0 = dense: prefill or dense mode;
                                # compress mode: the tokens the token's attention saw, kept + new)
    cached_lengths: jax.Array   # [B, T] int32 total cached length when the token was produced
    mask: jax.Array             # [B, T] bool: generated token (including the stop token)
    response_lengths: jax.Array  # [B] int32
    # compress mode only, [B, L, P + T] int32: per row, layer and sequence position, the first
    # query position that no longer sees that key (evicted; int32 max = never); replay input.
    evicted_at: jax.Array | None = None
    # exact_sparse mode only (rollout/exact.py), [B, T]: whether the token is a draft token the
    # dense verify accepted (False: sampled by the verify pass, as correction or bonus), and
    # alpha = sum min(p, q) of the dense and draft distributions at the token's position (NaN
    # where no draft was made: the first token and bonus tokens).
    accepted: jax.Array | None = None
    alpha: jax.Array | None = None
    # exact_sparse mode with re-planning (`RolloutConfig.replans`) only, [B, R] int32: the
    # rounds of each of the decode program's R round branches (`RolloutConfig.round_branches`)
    # that the rollout call which produced the row ran - the same in every row of one call
    # (a round is the batch's; a row cannot tell which it shared). What the run's round costs
    # are fitted on (train/exact_replan.py).
    round_counts: jax.Array | None = None


def budget_for_lengths(budgets: jax.Array, lengths: jax.Array, bin_size: int) -> jax.Array:
    """budgets [num_bins] tokens, lengths [B] -> [B]: the budget of each row's length bin."""
    bins = jnp.minimum(lengths // bin_size, budgets.shape[0] - 1)
    return budgets[bins]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the decode loop carries; the prefill program's output. B = prompts x group."""
    step: jax.Array              # [] int32 next position to record (1 after prefill)
    cache: KVCache
    token: jax.Array             # [B] int32 last sampled token (fed next)
    tokens: jax.Array            # [B, T] int32 recorded buffers, as in Trajectories
    logprobs: jax.Array          # [B, T] f32
    topk_logprobs: jax.Array     # [B, T, k] f32
    topk_ids: jax.Array          # [B, T, k] int32
    budgets: jax.Array           # [B, T] int32
    done: jax.Array              # [B] bool
    response_lengths: jax.Array  # [B] int32
    rng: jax.Array
    prompt_tokens: jax.Array     # [B, P] int32 (repeated per sample)
    prompt_lengths: jax.Array    # [B] int32
    sample_ids: jax.Array        # [B] int32 sampling key of each row (see sampling.sample_rows)


def constrain(x, axes, spec: ShardingSpec | None):
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec.sharding(axes, x.shape))


def sample_tokens(rng, logits, sample_ids, index, cfg: RolloutConfig):
    """What both engines record per token: logits [R, V], sample_ids/index [R] -> (tokens [R],
    logprobs [R], top-k values/ids [R, k]); keys per (sample, index), see `sample_rows`."""
    tok, lp = sample_rows(rng, logits, sample_ids, index, temperature=cfg.temperature,
                          top_k=cfg.top_k, top_p=cfg.top_p)
    top_v, top_i = topk_logprobs(logits, cfg.record_topk, temperature=cfg.temperature)
    return tok, lp, top_v, top_i


def record(state: DecodeState, logits, cfg: RolloutConfig, active) -> DecodeState:
    """Samples the next token from logits [B, V] and records it at position state.step."""
    step = state.step
    tok, lp, top_v, top_i = sample_tokens(state.rng, logits, state.sample_ids,
                                          jnp.full_like(state.sample_ids, step), cfg)
    tok = jnp.where(active, tok, cfg.pad_token_id)
    return dataclasses.replace(
        state, token=tok, tokens=state.tokens.at[:, step].set(tok),
        logprobs=state.logprobs.at[:, step].set(jnp.where(active, lp, 0.0)),
        topk_logprobs=state.topk_logprobs.at[:, step].set(top_v),
        topk_ids=state.topk_ids.at[:, step].set(top_i),
        response_lengths=state.response_lengths + active)


def check_budgets(cfg: RolloutConfig, budgets) -> np.ndarray:
    budgets = np.asarray(budgets, np.int32)
    if budgets.ndim != 1 or budgets.size == 0:
        raise ValueError(f"budgets must be a non-empty [num_bins] array, got shape {budgets.shape}")
    # DENSE_BUDGET (the dense rung) is always allowed: rows whose budget covers their length
    # take the dense path whatever the selection width. A finite budget above the width
    # would be silently capped to it.
    finite = budgets[budgets < DENSE_BUDGET]
    if (cfg.mode in (RolloutMode.SPARSE, RolloutMode.EXACT_SPARSE) and finite.size
            and finite.max() > cfg.max_budget):
        raise ValueError(f"schedule budget {finite.max()} exceeds RolloutConfig.max_budget="
                         f"{cfg.max_budget} (the static selection width); raise max_budget "
                         f"(DENSE_BUDGET = {DENSE_BUDGET} is always allowed: dense)")
    return budgets


def prepare_prompts(prompt_tokens, prompt_lengths, *, cfg: RolloutConfig, group_size: int,
                    spec: ShardingSpec | None) -> tuple[np.ndarray, np.ndarray]:
    """Validates the prompts and pads them to a bucketed width (the same on every process).
    Returns (prompt_tokens [Bp, P], prompt_lengths [Bp]) as int32 NumPy arrays."""
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    prompt_lengths = np.asarray(prompt_lengths, np.int32)
    if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
        raise ValueError(f"prompt_tokens must be [Bp, P] and prompt_lengths [Bp]; got "
                         f"{prompt_tokens.shape} and {prompt_lengths.shape}")
    if prompt_lengths.min() < 1 or prompt_lengths.max() > prompt_tokens.shape[1]:
        raise ValueError(f"prompt_lengths must be in [1, {prompt_tokens.shape[1]}], "
                         f"got {prompt_lengths.tolist()}")
    multi = multihost.is_multiprocess()
    if multi and spec is None:
        raise ValueError(f"a {jax.process_count()}-process rollout needs spec= (a ShardingSpec "
                         "whose mesh spans every process's devices)")
    # Every process must compile the same shapes: pad to the widest prompt of any process,
    # rounded up to a bucket so that varying widths reuse a few programs.
    widest = int(prompt_lengths.max())
    plen = multihost.sync_max(cfg.prompt_width(widest))
    prompt_tokens = prompt_tokens[:, :min(prompt_tokens.shape[1], plen)]
    prompt_tokens = np.pad(prompt_tokens, ((0, 0), (0, plen - prompt_tokens.shape[1])),
                           constant_values=cfg.pad_token_id)
    b = prompt_tokens.shape[0] * group_size * jax.process_count()
    if spec is not None and b % spec.mesh.shape[spec.rules.get("batch") or "data"]:
        raise ValueError(f"rollout batch {b} is not divisible by the mesh's data axis "
                         f"{dict(spec.mesh.shape)}")
    return prompt_tokens, prompt_lengths
