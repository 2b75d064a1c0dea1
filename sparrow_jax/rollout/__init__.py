"""Jitted rollout engine: dense prefill, block-sparse decode loop, teacher-forced sparse forward."""

from sparrow_jax.rollout.engine import (DecodeState, RolloutConfig, Trajectories, decode, generate,
                                        start)

__all__ = ["DecodeState", "RolloutConfig", "Trajectories", "decode", "generate", "start"]
