"""Rewards for tests/test_eval_command.py: `eval_worker_rewards:slow_exact`, the synthetic
task's exact match at 0.15 s per response (the kill -9 test kills `sparrow eval` between two
chunks), and `eval_worker_rewards:parity`."""

from __future__ import annotations

import time

from sparrow_jax.data.synthetic import synthetic_exact_reward
from sparrow_jax.rewards.registry import register_reward


@register_reward("slow_exact")
def slow_exact(completion_text: str, ground_truth: str, *, prompt: str = "",
               meta: dict | None = None) -> float:
    time.sleep(0.15)
    return synthetic_exact_reward(completion_text, ground_truth, prompt=prompt, meta=meta)


@register_reward("parity")
def parity(completion_text: str, ground_truth: str, *, prompt: str = "",
           meta: dict | None = None) -> float:
    """1 for an even number of words: about half of a random model's samples are 'correct', so
    avg@n and pass@k are not trivially 0 or 1."""
    return float(len(completion_text.split()) % 2 == 0)
