"""Rewards: answer parsing, the reward registry, scoring pools. Below the stages that use them
(data, rl, evaluation, train); imports only sparrow_jax.runtime.

  answers.py       final-answer extraction (`\\boxed{}`, `Answer:` lines) and the DAPO-Math rule
  registry.py      reward names -> functions: `register_reward`, `get_reward`, `make_reward_fn`
  math_rewards.py  the built-in math rewards (math_verify*, dapo)
  pool.py          `RewardPool` (worker processes, hard timeouts) -> `RewardReport`
  workers.py       the pool's worker processes
  scoring.py       a rollout's responses decoded and scored (`decode_responses`, `score`)

The synthetic demo task registers its own rewards (sparrow_jax.data.synthetic).
"""

# The built-in rewards register on import: importing any module of this package loads them.
from sparrow_jax.rewards import math_rewards  # noqa: F401
