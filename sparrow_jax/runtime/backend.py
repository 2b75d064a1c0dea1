"""Whether JAX can start the platform it is asked for, said in one line.

`JAX_PLATFORMS=cuda` on a machine without a GPU (or without jax's CUDA plugin) fails deep inside
jax with an `AssertionError` or `RuntimeError` and a page of traceback, in whatever command
touched a device first (issue 58: `sparrow doctor`, `rollout`, `eval`). Every command that runs
on a device asks `backend_problem()` before it loads anything; `sparrow train` asks once its
processes have found each other (jax.distributed must start before the backend does).
"""

from __future__ import annotations

import os

__all__ = ["backend_problem"]


def backend_problem() -> str | None:
    """None when jax's backend starts; else why not and what to do, in one line (it starts the
    backend: call it where the command would start it next)."""
    wanted = os.environ.get("JAX_PLATFORMS")
    import jax
    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 - jax fails here with RuntimeError or AssertionError
        text = str(e).splitlines()[0][:200] if str(e) else ""
        return (f"JAX cannot start its backend{f' (JAX_PLATFORMS={wanted!r})' if wanted else ''}"
                f": {type(e).__name__}{': ' + text if text else ''}. Is the accelerator there, "
                f"and jax's plugin for it installed? Unset JAX_PLATFORMS or set it to cpu to "
                f"run on the CPU")
    return None
