"""A step's rollout in sub-batches, and trajectories trimmed to the learner's length buckets.

At real scale one RL step's rollouts (e.g. 64 prompts x 8 samples of up to 32K tokens) do not fit
one rollout program's KV cache, so the step runs `rollout_batch_prompts` prompts per program call
and joins the trajectories. The learner then works on the batch's longest sequence rounded up to
a bucket, not on prompt + max_new_tokens.

Row layout (see `sparrow_jax.runtime.multihost`): process p owns a contiguous block of rows. Each
sub-batch is such a global array; `join_trajectories` keeps that true for the joined batch (block
p = process p's rows of sub-batch 0, then of sub-batch 1, ...), the order in which each process
lists its own prompts on the host.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol, Sequence, TypeVar

import jax
import jax.numpy as jnp

from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.runtime.shapes import bucket_length


class Rows(Protocol):
    """A batch that splits by rows (`data.prompts.PromptBatch`)."""
    def __len__(self) -> int: ...
    def rows(self, start: int, stop: int) -> "Rows": ...


B = TypeVar("B", bound=Rows)


def split_prompts(batch: B, per_call: int) -> list[B]:
    """A prompt batch -> sub-batches of `per_call` prompts (0 = one)."""
    n = len(batch)
    per_call = per_call or n
    if n % per_call:
        raise ValueError(f"{n} prompts per step is not a multiple of rollout_batch_prompts="
                         f"{per_call} (every rollout program call must have the same shape)")
    return [batch.rows(i, i + per_call) for i in range(0, n, per_call)]


@functools.partial(jax.jit, static_argnames=("num_processes", "rows"))
def join_program(trajs: Sequence[Trajectories], *, num_processes: int,
          rows: jax.sharding.NamedSharding | None) -> Trajectories:
    def join(*xs):
        blocks = [x.reshape(num_processes, x.shape[0] // num_processes, *x.shape[1:]) for x in xs]
        out = jnp.concatenate(blocks, axis=1)
        # Explicit sizes: a -1 cannot be inferred for an empty top-k record ([B, T, 0]).
        out = out.reshape(out.shape[0] * out.shape[1], *out.shape[2:])
        if rows is None:
            return out
        # Keep rows where the sub-batches had them (sharded over the data axis).
        spec = jax.sharding.PartitionSpec(rows.spec[0], *([None] * (out.ndim - 1)))
        return jax.lax.with_sharding_constraint(out, jax.sharding.NamedSharding(rows.mesh, spec))
    return jax.tree.map(join, *trajs)


def join_trajectories(trajs: Sequence[Trajectories]) -> Trajectories:
    """Sub-batch trajectories -> one batch (row blocks per process kept contiguous). One program."""
    if len(trajs) == 1:
        return trajs[0]
    sharding = trajs[0].tokens.sharding
    rows = sharding if isinstance(sharding, jax.sharding.NamedSharding) and sharding.spec else None
    return join_program(tuple(trajs), num_processes=jax.process_count(), rows=rows)


@functools.partial(jax.jit, static_argnames=("length",))
def _trim(traj: Trajectories, *, length: int) -> Trajectories:
    def cut(x):
        return x[:, :length] if x.ndim >= 2 else x
    per_token = {"tokens", "logprobs", "topk_logprobs", "topk_ids", "budgets", "cached_lengths",
                 "mask", "accepted", "alpha"}     # the last two: exact_sparse mode only
    return Trajectories(**{k: cut(v) if k in per_token and v is not None else v
                           for k, v in vars(traj).items()})


def trim_to_bucket(traj: Trajectories, buckets: Sequence[int], *, multiple: int = 16
                   ) -> Trajectories:
    """Per-token arrays cut to the longest response of the batch rounded up to a bucket (never
    beyond the generated width). One compiled program per bucket; every process agrees on the
    length (it is read from the global array)."""
    width = traj.tokens.shape[1]
    longest = int(jax.device_get(jnp.max(traj.response_lengths)))
    length = min(bucket_length(max(longest, 1), buckets, multiple=multiple), width)
    return traj if length == width else _trim(traj, length=length)


def rollout_in_sub_batches(generate_fn: Callable[[B, int], tuple[Trajectories, float]],
                           batch: B, per_call: int) -> tuple[Trajectories, float]:
    """Runs `generate_fn(sub_batch, index) -> (traj, seconds)` per sub-batch; joined result and
    total seconds."""
    trajs, seconds = [], 0.0
    for i, sub in enumerate(split_prompts(batch, per_call)):
        traj, s = generate_fn(sub, i)
        trajs.append(traj)
        seconds += s
    return join_trajectories(trajs), seconds
