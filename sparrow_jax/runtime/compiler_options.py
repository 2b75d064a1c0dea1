"""XLA compiler options for one program: a jitted program compiled again with extra options,
as the same function under a jit of its own (one per set of options, kept for the process).

Why not XLA_FLAGS: a flag there reaches every program of the process (the learner's too) and
must be set before jax starts; a setting such as `RolloutConfig.decode_command_buffers` is for
the decode programs only, and a run (or the device check) can compile both ways in one process.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

Options = tuple[tuple[str, str], ...]     # (XLA debug option, value) pairs


def with_options(program: Callable, jit_kwargs: dict[str, Any], options: Options) -> Callable:
    """`program` (a `jax.jit` function made with `jit_kwargs`) compiled with the XLA `options`:
    `program` itself when there are none, else a jit of the same function (same name, same
    static and donated arguments) carrying them, cached per options."""
    if not options:
        return program
    return _rejitted(program.__wrapped__, tuple(sorted(jit_kwargs.items())), options)


@functools.lru_cache(maxsize=None)
def _rejitted(fn: Callable, jit_kwargs: tuple, options: Options) -> Callable:
    return jax.jit(fn, **dict(jit_kwargs), compiler_options=dict(options))
