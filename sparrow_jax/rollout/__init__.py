"""Jitted rollout engine: dense prefill, block-sparse decode loop, teacher-forced sparse forward."""

from sparrow_jax.rollout.engine import RolloutConfig, Trajectories, generate

__all__ = ["RolloutConfig", "Trajectories", "generate"]
