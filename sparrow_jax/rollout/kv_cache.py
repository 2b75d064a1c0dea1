"""KV cache for rollout: per-layer K/V, block centroids and per-row lengths, sharded as data.

Per layer K and V are separate `[B, Hkv, S_max, D]` buffers (not one stacked `[L, ...]` array:
updating a stacked cache with `.at[l].set` inside the decode loop copies all of it every layer and
step). Centroids `[B, Hkv, S_max / block_size, D]` exist for every layer so the pytree is uniform;
dense layers never read them.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.runtime.sharding import ShardingSpec

log = logging.getLogger(__name__)

CACHE_AXES = ("batch", "kv_heads", "sequence", "head_dim")     # K, V and centroids


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: tuple[jax.Array, ...]          # L x [B, Hkv, S_max, D]
    v: tuple[jax.Array, ...]          # L x [B, Hkv, S_max, D]
    centroids: tuple[jax.Array, ...]  # L x [B, Hkv, S_max / block_size, D]
    lengths: jax.Array                # [B] int32: tokens written per row

    @property
    def max_length(self) -> int:
        return self.k[0].shape[2]


def cache_bytes(cfg: Qwen3Config, batch: int, max_length: int, dtype, block_size: int = 16) -> int:
    """Total bytes of K, V and centroids for the whole batch (all devices together)."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    centroid = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim / block_size
    return int(batch * max_length * (per_token + centroid) * jnp.dtype(dtype).itemsize)


def cache_bytes_per_device(cfg: Qwen3Config, batch: int, max_length: int, dtype,
                           spec: ShardingSpec | None = None, block_size: int = 16) -> int:
    total = cache_bytes(cfg, batch, max_length, dtype, block_size)
    if spec is None:
        return total
    sharding = spec.sharding(CACHE_AXES, (batch, cfg.num_key_value_heads, max_length, cfg.head_dim))
    shards = np.prod([spec.mesh.shape[a] for a in sharding.spec if a is not None] or [1])
    return int(total // shards)


def device_memory_limit() -> int | None:
    """Bytes the first device may allocate (None where the backend does not say, e.g. CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU backends may not implement memory_stats
        stats = {}
    return stats.get("bytes_limit")


def check_cache_fits(cfg: Qwen3Config, batch: int, max_length: int, dtype,
                     spec: ShardingSpec | None = None, *, block_size: int = 16,
                     fraction: float = 0.9, limit_bytes: int | None = None) -> int:
    """Raises a clear error (instead of an OOM crash mid-run) if the cache cannot fit."""
    need = cache_bytes_per_device(cfg, batch, max_length, dtype, spec, block_size)
    limit = limit_bytes if limit_bytes is not None else device_memory_limit()
    if limit is not None and need > fraction * limit:
        raise MemoryError(
            f"KV cache needs {need / 2**30:.2f} GiB per device (batch={batch}, max_length="
            f"{max_length}, {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x "
            f"{cfg.head_dim}, {jnp.dtype(dtype).name}) but the device has {limit / 2**30:.2f} GiB; "
            "lower the batch or max length, or shard over more devices")
    return need


def write_token(buf: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """buf [B, H, S, D], new [B, H, D], index [B] -> buf with row b's token written at index[b]."""
    def one(row, x, i):
        return jax.lax.dynamic_update_slice(row, x[:, None, :].astype(row.dtype), (0, i, 0))
    return jax.vmap(one)(buf, new, index)
