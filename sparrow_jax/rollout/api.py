"""The rollout entry points: `start`, `decode`, `generate` pick the engine from `RolloutConfig`.

- static engine (static.py): a cache row per sample, one decode `while_loop` per call;
- paged engine (continuous.py over paged.py): page pools and continuous batching,
  `RolloutConfig.engine = "paged"`;
- compress mode (compress.py): KV eviction on the static engine's prefill, `mode = "compress"`;
- exact sparse mode: sparse drafts verified densely, `mode = "exact_sparse"` (static engine:
  exact.py; paged engine: paged_exact.py, dispatched by the scheduler; shared: verify.py).
The engines share rollout/state.py and never import each other; only this module knows them all.
Each engine is a `Generator` (`ENGINES`), each decode mode of the static engine a `Decoder`
(`DECODERS`): one contract each, so a new engine or mode is one entry.
"""

from __future__ import annotations

import time
from typing import Mapping, Protocol

import jax

from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import compress, continuous, exact, static
from sparrow_jax.rollout.config import Engine, RolloutConfig, RolloutMode
from sparrow_jax.rollout.static import start
from sparrow_jax.rollout.state import DecodeState, Trajectories, check_budgets
from sparrow_jax.runtime.sharding import ShardingSpec

__all__ = ["decode", "generate", "generate_timed", "start", "Generator", "Decoder", "ENGINES",
           "DECODERS"]


class Generator(Protocol):
    """A rollout engine: `group_size` samples per prompt, as `generate` documents."""
    def __call__(self, model: Qwen3ForCausalLM, prompt_tokens, prompt_lengths, *,
                 cfg: RolloutConfig, budgets, bin_size: int = 2000, group_size: int = 1,
                 rng: jax.Array | None = None, spec: ShardingSpec | None = None,
                 first_sample: int = 0) -> Trajectories: ...


class Decoder(Protocol):
    """A decode mode of the static engine: runs a prefilled `DecodeState` (consumed) to the
    end, as `decode` documents."""
    def __call__(self, model: Qwen3ForCausalLM, state: DecodeState, *, cfg: RolloutConfig,
                 budgets, bin_size: int = 2000,
                 spec: ShardingSpec | None = None) -> Trajectories: ...


def generate(model: Qwen3ForCausalLM, prompt_tokens, prompt_lengths, *, cfg: RolloutConfig,
             budgets, bin_size: int = 2000, group_size: int = 1, rng: jax.Array | None = None,
             spec: ShardingSpec | None = None, first_sample: int = 0) -> Trajectories:
    """Samples `group_size` completions per prompt (static engine: `start` then `decode`; paged
    engine: its scheduler).

    prompt_tokens [Bp, P] int32 right-padded (P is padded up to a block multiple here),
    prompt_lengths [Bp] (each >= 1), budgets [num_bins] int32 tokens per length bin (ignored in
    dense mode). Rows of the result are grouped: rows g*n .. g*n+n-1 belong to prompt g.

    Multi-process runs (`jax.process_count() > 1`): each process passes its own Bp prompts (the
    same Bp everywhere) and a `spec`; the result is global (process p's prompts are its row block
    p, see `sparrow_jax.runtime.multihost`), read a process's rows back with
    `multihost.local_rows`. Row b's tokens are drawn with sampling key (rng, first_sample + b,
    token index), so a batch split over several calls (first_sample = rows before it) draws the
    same samples as one call, on either engine.
    """
    check_budgets(cfg, budgets)          # before the (long) prefill
    return ENGINES[cfg.engine](model, prompt_tokens, prompt_lengths, cfg=cfg, budgets=budgets,
                               bin_size=bin_size, group_size=group_size, rng=rng, spec=spec,
                               first_sample=first_sample)


def generate_static(model: Qwen3ForCausalLM, prompt_tokens, prompt_lengths, *,
                    cfg: RolloutConfig, budgets, bin_size: int = 2000, group_size: int = 1,
                    rng: jax.Array | None = None, spec: ShardingSpec | None = None,
                    first_sample: int = 0) -> Trajectories:
    """The static engine's `Generator`: `start` (the prefill), then `decode` in cfg.mode."""
    state = start(model, prompt_tokens, prompt_lengths, cfg=cfg, group_size=group_size, rng=rng,
                  spec=spec, first_sample=first_sample)
    return decode(model, state, cfg=cfg, budgets=budgets, bin_size=bin_size, spec=spec)


def decode(model: Qwen3ForCausalLM, state: DecodeState, *, cfg: RolloutConfig, budgets,
           bin_size: int = 2000, spec: ShardingSpec | None = None) -> Trajectories:
    """Decodes `state` (from `start`, consumed: its buffers are donated) until every row stopped
    or reached cfg.max_new_tokens. budgets [num_bins] int32 as in `generate`; the decode `cfg`
    may differ from the prefill's in mode, dense layers and max_budget only."""
    budgets = check_budgets(cfg, budgets)
    return DECODERS[cfg.mode](model, state, cfg=cfg, budgets=budgets, bin_size=bin_size,
                              spec=spec)


ENGINES: Mapping[Engine, Generator] = {Engine.STATIC: generate_static,
                                       Engine.PAGED: continuous.generate}
DECODERS: Mapping[RolloutMode, Decoder] = {
    RolloutMode.SPARSE: static.decode, RolloutMode.DENSE: static.decode,
    RolloutMode.COMPRESS: compress.decode, RolloutMode.EXACT_SPARSE: exact.decode}


def generate_timed(model: Qwen3ForCausalLM, prompt_tokens, prompt_lengths, *, cfg: RolloutConfig,
                   budgets, bin_size: int = 2000, group_size: int = 1,
                   rng: jax.Array | None = None, spec: ShardingSpec | None = None
                   ) -> tuple[Trajectories, float]:
    """`generate` and its wall time in seconds, blocked until the result is ready (the rollout
    speed a training step or an evaluation reports)."""
    start_s = time.perf_counter()
    traj = generate(model, prompt_tokens, prompt_lengths, cfg=cfg, budgets=budgets,
                    bin_size=bin_size, group_size=group_size, rng=rng, spec=spec)
    traj = jax.block_until_ready(traj)
    return traj, time.perf_counter() - start_s
