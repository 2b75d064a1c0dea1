"""Held-out evaluation under dense and sparse decoding, and response decoding/scoring shared with
the train loop."""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np

from sparrow_jax import multihost
from sparrow_jax.rl.rewards import RewardPool
from sparrow_jax.rollout.engine import RolloutConfig, Trajectories, generate


def decode_responses(tokenizer, traj: Trajectories) -> list[str]:
    """Texts of this process's rows (all rows with one process)."""
    tokens, lens = multihost.local_rows(traj.tokens), multihost.local_rows(traj.response_lengths)
    return [tokenizer.decode(tokens[i, :lens[i]].tolist(), skip_special_tokens=True)
            for i in range(tokens.shape[0])]


def score(pool: RewardPool, texts: Sequence[str], answers: Sequence[str],
          prompts: Sequence[str], metas: Sequence[dict | None]) -> tuple[np.ndarray, dict]:
    return pool.score(list(zip(texts, answers, prompts, metas)))


def batch_records(records: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Prompt records (data.prompts format) -> a right-padded batch like PromptIterator yields."""
    lengths = np.asarray([len(r["prompt_ids"]) for r in records], np.int32)
    ids = np.full((len(records), int(lengths.max())), pad_id, np.int32)
    for i, r in enumerate(records):
        ids[i, :lengths[i]] = r["prompt_ids"]
    return {"prompt_ids": ids, "prompt_lengths": lengths,
            "answers": [r["answer"] for r in records], "prompts": [r["prompt"] for r in records],
            "metas": [r.get("meta") for r in records]}


def timed_generate(model, batch, *, cfg: RolloutConfig, budgets, bin_size: int, group_size: int,
                   rng, spec=None) -> tuple[Trajectories, float]:
    """generate() + wall time in seconds (blocked until the result is on the host)."""
    start = time.perf_counter()
    traj = generate(model, batch["prompt_ids"], batch["prompt_lengths"], cfg=cfg, budgets=budgets,
                    bin_size=bin_size, group_size=group_size, rng=rng, spec=spec)
    traj = jax.block_until_ready(traj)
    return traj, time.perf_counter() - start


def evaluate(model, tokenizer, pool: RewardPool, batch: dict[str, Any], *, cfg: RolloutConfig,
             budgets, bin_size: int, rng, spec=None, diagnostics: dict[str, RewardPool] | None = None
             ) -> dict[str, float]:
    """One pass over held-out prompts (group size 1) in cfg.mode; reward, length and tokens/s.

    The program is compiled by a first call, so callers that compare speeds should evaluate
    each mode once before timing (the train loop's evaluations after the first do that).
    """
    traj, seconds = timed_generate(model, batch, cfg=cfg, budgets=budgets, bin_size=bin_size,
                                   group_size=1, rng=rng, spec=spec)
    texts = decode_responses(tokenizer, traj)
    rewards, _ = score(pool, texts, batch["answers"], batch["prompts"], batch["metas"])
    # Means over every process's prompts.
    rewards = multihost.all_rows(rewards)
    lengths = multihost.all_rows(multihost.local_rows(traj.response_lengths))
    out = {"reward": float(rewards.mean()), "response_length": float(lengths.mean()),
           "tokens_per_s": float(lengths.sum() / seconds), "seconds": seconds}
    for name, diag in (diagnostics or {}).items():
        diag_rewards = score(diag, texts, batch["answers"], batch["prompts"], batch["metas"])[0]
        out[f"reward_{name}"] = float(multihost.all_rows(diag_rewards).mean())
    return out
