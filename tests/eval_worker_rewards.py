"""A slow reward for tests/test_eval_command.py's kill -9 test, named
`eval_worker_rewards:slow_exact`: the synthetic task's exact match, 0.15 s per response, so the
test can kill `sparrow eval` between two chunks."""

from __future__ import annotations

import time

from sparrow_jax.data.synthetic import synthetic_exact_reward
from sparrow_jax.rl.rewards import register_reward


@register_reward("slow_exact")
def slow_exact(completion_text: str, ground_truth: str, *, prompt: str = "",
               meta: dict | None = None) -> float:
    time.sleep(0.15)
    return synthetic_exact_reward(completion_text, ground_truth, prompt=prompt, meta=meta)
