"""The rollout actor: the policy as the rollout samples it."""

from __future__ import annotations

from sparrow_jax.model import compute_copy
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rl.distill import Distiller

__all__ = ["RolloutActor"]


class RolloutActor:
    """The policy in the compute dtype for rollout and evaluation: cast once per RL step (after
    the update), not per decode step; the policy itself when the dtypes already agree. With a
    DistillSparse adapter, the sparse actor: base + adapter merged, then cast."""

    def __init__(self, policy: Qwen3ForCausalLM, distiller: Distiller | None = None):
        self.policy, self.distiller = policy, distiller
        self._copy: Qwen3ForCausalLM | None = None

    def model(self) -> Qwen3ForCausalLM:
        if self._copy is None:
            self._copy = (self.distiller.sparse_model(self.policy) if self.distiller
                          else compute_copy(self.policy))
        return self._copy

    def policy_changed(self) -> None:
        """The policy's weights changed (an update, a restored checkpoint): recast next time."""
        self._copy = None
