"""Sparsity schedules: a KV budget (tokens) per bin of total cached length, and their controller.

A ``Schedule`` holds one budget per ``bin_size``-token bin of total cached length (prompt +
generated so far); the last bin is open-ended. Budgets count the 3 always-kept blocks (first
block + last 2), so each budget is a multiple of ``block_size`` and at least
``3 * block_size``. The rollout looks up the budget per sequence every decode step with
``Schedule.budget_for_length`` (jittable; the table is a compile-time constant).

Dense rollout is expressed as the budget ``DENSE_BUDGET`` (2**30 tokens) in every bin: a
sequence with no more blocks than its budget is attended exactly densely, so a huge budget is
dense by construction. The rollout should still check ``Schedule.is_dense`` to skip block
scoring entirely, and must size its static block-index buffer with ``max_blocks(capacity)``
(capped at the KV-cache capacity), never with ``max_budget`` directly.

``sparrow_jax.sparsity.controller`` adapts a schedule online from the per-bin tail measured by the
learner every step (``sparrow_jax.sparsity.mismatch.tail_by_bin``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DENSE_BUDGET", "NUM_RESERVED_BLOCKS", "PAPER_SCHEDULES", "Schedule", "load_schedule",
    "make_schedule",
]

NUM_RESERVED_BLOCKS = 3  # first block (attention sink) + last 2 blocks (local window)
DENSE_BUDGET = 1 << 30  # "no sparsity": larger than any context, a multiple of every block size

# Published per-bin budgets (tokens) meeting a 5th-percentile alpha >= 0.86 (Sparrow paper).
PAPER_SCHEDULES: dict[str, tuple[int, ...]] = {
    "qwen3-1.7b-0.86": (512, 1024, 1536, 1536, 2048, 2560, 3072, 3584, 3584, 4096) + (4096,) * 10,
    "qwen3-4b-0.86": (512, 768, 1024, 1280, 1536, 2048, 2560, 3584, 4096, 4096, 5120, 5120,
                      5120, 5120, 6144, 6144, 6144, 6144, 8192, 8192),
    "qwen3-8b-0.86": (512, 768, 1024, 1280, 2048, 2560, 3072, 4096, 4096, 4096, 4096, 5120,
                      5120, 5120, 5120, 5120, 5120, 6144, 7168, 7168),
    "qwen3-14b-0.86": (512, 768, 1280, 2048, 4096) + (6144,) * 10
                      + (8192, 10240, 10240, 14336, 14336),
}


def _as_int(value: Any, what: str) -> int:
    # bool is an int subclass; a budget of True is a bug, not 1 token.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, float, np.floating)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if float(value) != math.floor(float(value)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-bin KV budgets in tokens.

    Attributes:
      budgets: one budget per bin (multiples of ``block_size``, >= 3 blocks).
      bin_size: tokens of total cached length per bin; the last bin is open-ended.
      block_size: KV block size the budgets are expressed in.
      name: label for logs (a paper name, a file, "controller", ...).
    """

    budgets: tuple[int, ...]
    bin_size: int = 2000
    block_size: int = 16
    name: str = ""

    def __post_init__(self):
        block, bin_size = (_as_int(getattr(self, f), f) for f in ("block_size", "bin_size"))
        for field, value in (("block_size", block), ("bin_size", bin_size)):
            if value <= 0:
                raise ValueError(f"{field} must be positive, got {value}")
        if isinstance(self.budgets, (str, bytes)) or not isinstance(self.budgets, Sequence | np.ndarray):
            raise ValueError(f"budgets must be a sequence of integers, got {self.budgets!r}")
        budgets = tuple(_as_int(b, f"budgets[{i}]") for i, b in enumerate(self.budgets))
        if not budgets:
            raise ValueError("budgets must hold at least one bin")
        floor = NUM_RESERVED_BLOCKS * block
        for i, b in enumerate(budgets):
            if b % block:
                raise ValueError(f"budgets[{i}] = {b} is not a multiple of block_size {block}")
            if b < floor:
                raise ValueError(f"budgets[{i}] = {b} is below the {NUM_RESERVED_BLOCKS} reserved "
                                 f"blocks ({floor} tokens at block_size {block})")
            if b > DENSE_BUDGET:
                raise ValueError(f"budgets[{i}] = {b} exceeds DENSE_BUDGET = {DENSE_BUDGET}")
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "block_size", block)
        object.__setattr__(self, "bin_size", bin_size)

    @classmethod
    def dense(cls, num_bins: int = 20, *, bin_size: int = 2000, block_size: int = 16) -> "Schedule":
        """No sparsity: every bin's budget is ``DENSE_BUDGET``."""
        return cls((DENSE_BUDGET,) * num_bins, bin_size, block_size, "dense")

    @classmethod
    def constant(cls, budget: int, num_bins: int = 20, *, bin_size: int = 2000,
                 block_size: int = 16) -> "Schedule":
        """The same budget in every bin (the paper's fixed-budget baseline)."""
        return cls((budget,) * num_bins, bin_size, block_size, f"constant-{budget}")

    @classmethod
    def named(cls, name: str) -> "Schedule":
        """A published schedule by name (e.g. ``"qwen3-1.7b-0.86"``) or ``"dense"``."""
        key = name.strip().lower()
        if key == "dense":
            return cls.dense()
        if key not in PAPER_SCHEDULES:
            known = ", ".join(["dense", *sorted(PAPER_SCHEDULES)])
            raise ValueError(f"unknown schedule name {name!r}; known names: {known}")
        return cls(PAPER_SCHEDULES[key], 2000, 16, key)

    @property
    def num_bins(self) -> int:
        return len(self.budgets)

    @property
    def max_budget(self) -> int:
        return max(self.budgets)

    @property
    def is_dense(self) -> bool:
        return all(b >= DENSE_BUDGET for b in self.budgets)

    def max_blocks(self, cache_capacity: int) -> int:
        """Static number of selected blocks K for a cache of ``cache_capacity`` tokens."""
        cap_blocks = -(-int(cache_capacity) // self.block_size)
        return min(self.max_budget // self.block_size, cap_blocks)

    def bin_index(self, cached_lengths: jax.Array) -> jax.Array:
        """``[B]`` int lengths -> ``[B]`` int32 bin = min(len // bin_size, num_bins - 1)."""
        lengths = jnp.asarray(cached_lengths).astype(jnp.int32)
        return jnp.clip(lengths // self.bin_size, 0, self.num_bins - 1)

    def budget_for_length(self, cached_lengths: jax.Array) -> jax.Array:
        """``[B]`` total cached lengths -> ``[B]`` int32 budget in tokens."""
        table = jnp.asarray(self.budgets, jnp.int32)
        return table[self.bin_index(cached_lengths)]

    def budget_blocks(self, cached_lengths: jax.Array) -> jax.Array:
        """``[B]`` total cached lengths -> ``[B]`` int32 budget in blocks (incl. reserved)."""
        return self.budget_for_length(cached_lengths) // self.block_size

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bin_size": self.bin_size, "block_size": self.block_size,
                "budgets": list(self.budgets)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | Sequence[int]) -> "Schedule":
        """From ``to_dict`` output, or a bare list of budgets (defaults for the rest)."""
        if isinstance(data, dict):
            unknown = set(data) - {"name", "bin_size", "block_size", "budgets"}
            if unknown:
                raise ValueError(f"unknown schedule fields {sorted(unknown)}")
            if "budgets" not in data:
                raise ValueError("schedule JSON lacks 'budgets'")
            return cls(tuple(data["budgets"]), data.get("bin_size", 2000),
                       data.get("block_size", 16), data.get("name", ""))
        return cls(tuple(data))

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "Schedule":
        """From JSON text or from a file holding it."""
        text = str(text_or_path)
        if not text.lstrip().startswith(("{", "[")):
            with open(text_or_path) as f:
                text = f.read()
        return cls.from_dict(json.loads(text))


def load_schedule(name_or_path: str | os.PathLike) -> Schedule:
    """A JSON file path if it exists, else a published name; errors list the known names."""
    if os.path.isfile(name_or_path):
        sched = Schedule.from_json(name_or_path)
        return sched if sched.name else dataclasses.replace(sched, name=os.fspath(name_or_path))
    try:
        return Schedule.named(os.fspath(name_or_path))
    except ValueError as e:
        raise ValueError(f"{name_or_path!r} is neither a schedule file nor a known name: {e}")


@gin.configurable
def make_schedule(
    name: str | None = None,
    path: str | None = None,
    budgets: Sequence[int] | None = None,
    bin_size: int = 2000,
    block_size: int = 16,
) -> Schedule:
    """gin factory: exactly one of ``name`` / ``path`` / ``budgets``; none of them = dense.

    ``bin_size`` / ``block_size`` apply to explicit ``budgets`` and to dense; named and file
    schedules carry their own.
    """
    given = [k for k, v in (("name", name), ("path", path), ("budgets", budgets)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"make_schedule takes one of name/path/budgets, got {given}")
    if name is not None:
        return Schedule.named(name)
    if path is not None:
        return load_schedule(path)
    if budgets is not None:
        return Schedule(tuple(budgets), bin_size, block_size, "custom")
    return Schedule.dense(bin_size=bin_size, block_size=block_size)


def resolve_schedule(name: str | None) -> Schedule:
    """A `--schedule` argument: a name, a JSON file, or inline JSON (a budget list or a Schedule
    dict); None: gin `make_schedule`. ValueError / OSError on a bad one."""
    if name is None:
        return make_schedule()
    if name.lstrip().startswith(("[", "{")):
        return Schedule.from_json(name)
    return load_schedule(name)
