"""Multi-host data movement: per-process rows <-> global arrays sharded over the `data` axis.

In a multi-process run (TPU pod slice, several GPU nodes) every process reads its own shard of
prompts (`data.prompts` shards by `jax.process_index()`), but jitted programs take *global*
arrays. The contract used by the rollout engine, the learner and the train loop:

  * a batch is a stack of per-process row blocks in process order: process p owns rows
    [p * b_local, (p + 1) * b_local) of the global `[b_local * num_processes, ...]` array;
  * that block lives on p's own devices, because the mesh's `data` axis is laid out
    process-major and the `model` axis stays inside one process (`check_mesh` enforces both);
  * host-side work (decoding text, scoring rewards) runs on each process's own rows
    (`local_rows`), scalar metrics are reduced over every process (`all_rows`).

With one process every function here is the obvious single-host operation, so the single-host
path of the callers does not change.
"""

from __future__ import annotations

import collections
import functools
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from sparrow_jax.runtime.sharding import ShardingSpec

__all__ = ["is_multiprocess", "check_mesh", "sync_max", "rows_to_global", "local_rows",
           "all_rows", "host_to_global", "replicate", "to_host", "host_allgather", "PeerTimeout"]

# How long a host exchange waits for the slowest process (`host_allgather`). Long: a peer may be
# compiling a program the others found in their compile caches. A dead peer is noticed sooner,
# by jax.distributed's heartbeats. SPARROW_PEER_TIMEOUT_S overrides it.
PEER_TIMEOUT_S = 3600.0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def _data_axis(spec: ShardingSpec) -> str:
    axis = spec.rules.get("batch") or "data"
    if axis not in spec.mesh.shape:
        raise ValueError(f"batch rule maps to {axis!r}, not an axis of mesh {dict(spec.mesh.shape)}")
    return axis


def check_mesh(spec: ShardingSpec) -> None:
    """Raises unless each process owns a contiguous, disjoint block of the data axis.

    That is what makes "process p's prompts are rows of block p" true: if the model axis spanned
    two processes, both would hold the same rows and their different prompts could not both be
    placed there.
    """
    axis = _data_axis(spec)
    mesh = spec.mesh
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    owners = [{d.process_index for d in np.ravel(devices[i])} for i in range(devices.shape[0])]
    if any(len(o) != 1 for o in owners):
        raise ValueError(f"mesh {dict(mesh.shape)}: a slice of the {axis!r} axis spans several "
                         "processes; keep the model axis within one host (lower mesh_model)")
    order = [o.pop() for o in owners]
    if order != sorted(order):
        raise ValueError(f"mesh {dict(mesh.shape)}: the {axis!r} axis is not process-major "
                         f"(process of each slice: {order}); build it with sharding.make_mesh")


def sync_max(value: int) -> int:
    """The largest `value` over all processes (e.g. a padded prompt width, so that every process
    compiles the same shapes)."""
    if not is_multiprocess():
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def rows_to_global(local: np.ndarray, spec: ShardingSpec) -> jax.Array:
    """[b_local, ...] rows of this process -> global [b_local * num_processes, ...] array,
    rows sharded over the data axis, everything else replicated. Every process must pass the
    same b_local and trailing shape (make shapes equal with `sync_max` first)."""
    local = np.asarray(local)
    sharding = NamedSharding(spec.mesh, PartitionSpec(_data_axis(spec),
                                                      *([None] * (local.ndim - 1))))
    if not is_multiprocess():
        return jax.device_put(local, sharding)
    check_mesh(spec)
    return jax.make_array_from_process_local_data(sharding, local)


def local_rows(x: jax.Array | np.ndarray) -> np.ndarray:
    """This process's rows of a global array whose rows are sharded over the data axis (the
    inverse of `rows_to_global`); the whole array with one process."""
    if not is_multiprocess() or not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    blocks: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:      # replicas along the model axis repeat a block
        rows = shard.index[0] if shard.index else slice(None)
        start = rows.start or 0
        if rows != slice(None) and start not in blocks:
            blocks[start] = np.asarray(shard.data)
    if not blocks:
        raise ValueError(f"array {x.shape} with sharding {x.sharding} is not row-sharded; "
                         "cannot tell which rows belong to this process")
    return np.concatenate([blocks[k] for k in sorted(blocks)], axis=0)


def all_rows(local: np.ndarray) -> np.ndarray:
    """Concatenation of every process's `local` rows in process order (for global metrics)."""
    local = np.asarray(local)
    if not is_multiprocess():
        return local
    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def host_to_global(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A NumPy array that every process holds whole, with the same values (a replicated host
    computation's result) -> a global array with `sharding`. Each process copies only the slices
    of its own devices: no collective (`jax.device_put` of a host array onto a multi-process
    sharding checks equality with an allgather per call; the paged scheduler checks one digest
    per program instead)."""
    x = np.asarray(x)
    if not is_multiprocess():
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


@functools.lru_cache(maxsize=None)
def _replicate(mesh: jax.sharding.Mesh):
    # One program per mesh (and input shapes): every output fully replicated.
    return jax.jit(lambda *xs: xs, out_shardings=NamedSharding(mesh, PartitionSpec()))


def replicate(tree, spec: ShardingSpec | None):
    """A pytree of global arrays -> the same, fully replicated over spec's mesh (one program for
    all leaves, dispatched, not waited for); `to_host` reads such a tree."""
    if spec is None:
        raise ValueError("replicate in a multi-process run needs the spec of the global mesh")
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(_replicate(spec.mesh)(*leaves)))


def to_host(tree, spec: ShardingSpec | None):
    """A pytree of device arrays -> NumPy arrays holding the *whole* (global) value on every
    process: one replicating program over spec's mesh for all leaves, then a local read. With
    one process, plain `np.asarray`. Every process must call it with the same shapes."""
    if not is_multiprocess():
        return jax.tree.map(np.asarray, tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), replicate(tree, spec))


class PeerTimeout(RuntimeError):
    """A host exchange in which some process did not take part within the timeout."""


# Exchanges made per channel by this process (every process makes the same ones, in order, so
# the counters agree and name the same keys), and the key this process last wrote per channel.
_EXCHANGES: collections.Counter = collections.Counter()
_LAST_KEY: dict[str, str] = {}


def _coordination_client():
    from jax._src import distributed       # no public API exposes the key-value store
    client = getattr(getattr(distributed, "global_state", None), "client", None)
    if client is None:
        raise RuntimeError(
            "host_allgather needs jax.distributed.initialize() in every process (and jax's "
            f"coordination client at jax._src.distributed.global_state.client; jax "
            f"{jax.__version__})")
    return client


def _peer_timeout() -> float:
    text = os.environ.get("SPARROW_PEER_TIMEOUT_S", "")
    try:
        value = float(text) if text else PEER_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"SPARROW_PEER_TIMEOUT_S must be a positive number of seconds, got "
                         f"{text!r}")
    return value


def host_allgather(channel: str, payload: bytes, *, timeout_s: float | None = None
                   ) -> list[bytes]:
    """Every process's `payload`, in process order, exchanged on the host through
    jax.distributed's coordination service (its key-value store and a barrier: three RPCs to the
    coordinator, whatever the number of processes) - no device program. So it never waits
    behind programs still running on the devices, and it never pairs with their collectives
    (a device allgather would do both). Every process must make the same exchanges on a
    `channel` in the same order. One process: [payload].

    Raises PeerTimeout if some process has not made the exchange within `timeout_s`
    (default PEER_TIMEOUT_S)."""
    if not is_multiprocess():
        return [payload]
    client = _coordination_client()
    seq = _EXCHANGES[channel]
    _EXCHANGES[channel] += 1
    prefix = f"sparrow/{channel}/{seq}"
    me, n = jax.process_index(), jax.process_count()
    client.key_value_set_bytes(f"{prefix}/{me}", payload)
    timeout = timeout_s if timeout_s is not None else _peer_timeout()
    try:
        client.wait_at_barrier(f"{prefix}/barrier", int(timeout * 1000))
    except Exception as e:         # jaxlib's error type moves between releases
        try:
            arrived = sorted(int(k.rsplit("/", 1)[-1]) for k, _ in
                             client.key_value_dir_get_bytes(prefix + "/"))
        except Exception:          # the coordination service itself is gone
            arrived = []
        missing = sorted(set(range(n)) - set(arrived))
        who = (f"process(es) {missing} did not arrive within {timeout:.0f} s"
               if arrived and missing else "its barrier failed (a peer timed out first, or the "
               "coordination service is gone)")
        raise PeerTimeout(
            f"host exchange {channel!r} #{seq}: {who} (arrived: {arrived}); a peer is stuck or "
            f"runs a different sequence of exchanges ({type(e).__name__}: {e})") from e
    values = dict(client.key_value_dir_get_bytes(prefix + "/"))
    # Every process wrote #seq, so every process has read #seq - 1: drop this process's old key
    # (the coordinator keeps the store in memory for the whole job).
    if channel in _LAST_KEY:
        client.key_value_delete(_LAST_KEY[channel])
    _LAST_KEY[channel] = f"{prefix}/{me}"
    return [values[f"{prefix}/{p}"] for p in range(n)]
