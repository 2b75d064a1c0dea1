"""The reward registry: reward names -> functions.

A reward function has the signature
    fn(completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None)
        -> float
and is registered with `@register_reward("name")` by the module that defines it, when that
module is imported. Registered where:
  math_verify, math_verify_boxed, math_verify_answer_line, dapo
        sparrow_jax.rewards.math_rewards (the package imports it: always registered)
  synthetic_exact, synthetic_prefix, synthetic_answer
        sparrow_jax.data.synthetic (whoever scores the synthetic task imports it)
`reward_entry` also accepts "package.module:name": it imports the module first, so a user's
reward module is named from gin files without touching this package.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Sequence

import gin

RewardFn = Callable[..., float]


@dataclasses.dataclass(frozen=True)
class RewardEntry:
    fn: RewardFn
    preload: tuple[str, ...]  # heavy modules a pool worker imports before reporting ready


_REGISTRY: dict[str, RewardEntry] = {}


def register_reward(name: str, *, preload: Sequence[str] = ()) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`. `preload`: modules pool workers import at start
    (so the first item's timeout is not eaten by e.g. importing sympy)."""

    def decorator(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        # Re-importing the same module (spawned workers, pytest) re-registers the same function.
        same = old is not None and (old.fn.__module__, old.fn.__qualname__) == (
            fn.__module__,
            fn.__qualname__,
        )
        if old is not None and not same:
            owner = f"{old.fn.__module__}.{old.fn.__qualname__}"
            raise ValueError(f"reward {name!r} is already registered by {owner}")
        _REGISTRY[name] = RewardEntry(fn, tuple(preload))
        return fn

    return decorator


def reward_entry(name: str) -> RewardEntry:
    """The registry entry of `name` (or "module.path:name", which imports the module first)."""
    module = None
    if ":" in name:
        module, name = name.rsplit(":", 1)
        imported = importlib.import_module(module)   # a user's reward module, named in a config
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        if module is not None:       # it imports, but registers nothing by that name
            defined = callable(getattr(imported, name, None))
            raise KeyError(
                f"module {module!r} imports but registers no reward {name!r}"
                f"{f' (it defines {name}() without registering it)' if defined else ''}: "
                f"decorate the function with @register_reward({name!r}) from "
                f"sparrow_jax.rewards.registry in {module}, or name one it registers; "
                f"registered rewards: {known}")
        raise KeyError(f"unknown reward {name!r}; registered rewards: {known} (the synthetic "
                       f"task's register when sparrow_jax.data.synthetic is imported)")
    return _REGISTRY[name]


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name` (or "module.path:name")."""
    return reward_entry(name).fn


def reward_names() -> list[str]:
    """Names of all rewards registered so far."""
    return sorted(_REGISTRY)


@gin.configurable
def make_reward_fn(name: str = "math_verify") -> RewardFn:
    """gin factory: `make_reward_fn.name = "synthetic_exact"`."""
    return get_reward(name)
