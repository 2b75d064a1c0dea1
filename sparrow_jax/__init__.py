"""sparrow-jax: sparse-rollout RL for long chain-of-thought LLMs, in JAX.

Data flow of one RL step (one module per stage):
  data (grain prompts) -> rollout (sparse decode, budget per bin from schedule) -> rewards
  -> rl.learner (dense logprobs, mismatch.acceptance_rate, rl.grpo loss) -> mismatch.tail_by_bin
  -> schedule controller -> metrics (TensorBoard) / checkpoint (orbax)
"""

__version__ = "0.1.0"
