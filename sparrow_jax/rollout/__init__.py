"""Rollout: dense prefill, block-sparse decode (static or paged engine), teacher-forced replay.

Entry points (rollout/api.py): `start`, `decode`, `generate`; shared types (rollout/state.py).
"""

from sparrow_jax.rollout.api import decode, generate, start
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.rollout.state import DecodeState, Trajectories

__all__ = ["DecodeState", "RolloutConfig", "Trajectories", "decode", "generate", "start"]
