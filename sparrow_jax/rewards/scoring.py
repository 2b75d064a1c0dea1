"""A rollout's responses as text, scored by a `RewardPool`: the reward stage of an RL step and
of every evaluation."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import jax

from sparrow_jax.rewards.pool import RewardPool, RewardReport
from sparrow_jax.runtime import multihost


class Responses(Protocol):
    """What is read of a rollout's `Trajectories` (sparrow_jax.rollout.state)."""
    tokens: jax.Array             # [B, T] int32 generated ids (pad after the end)
    response_lengths: jax.Array   # [B] int32


def decode_responses(tokenizer: Any, traj: Responses) -> list[str]:
    """Texts of this process's rows (all rows with one process)."""
    tokens, lens = multihost.local_rows(traj.tokens), multihost.local_rows(traj.response_lengths)
    return [tokenizer.decode(tokens[i, :lens[i]].tolist(), skip_special_tokens=True)
            for i in range(tokens.shape[0])]


def score(pool: RewardPool, texts: Sequence[str], answers: Sequence[str],
          prompts: Sequence[str], metas: Sequence[dict | None]) -> RewardReport:
    """Rewards of completions `texts` against their ground truths `answers` (one per text)."""
    return pool.score(list(zip(texts, answers, prompts, metas)))
