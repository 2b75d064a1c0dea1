"""Explicit sharding as data: logical axis names -> mesh axes.

Every array that is sharded (parameters, optimizer state, KV cache, batches) names its dimensions
with logical axes; a rules table maps them to mesh axes. A logical axis whose size does not divide
the mesh axis is replicated (e.g. 2 KV heads on a 4-way `model` axis) rather than failing.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import gin
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

# Logical axes used across the project.
DEFAULT_RULES: Mapping[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "embed": None,
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "sequence": None,
    # The residual stream between layers in the learner's forward: tokens over `model`
    # (sequence parallelism, see `residual_spec`).
    "residual_sequence": "model",
    "head_dim": None,
    "blocks": None,
}


@gin.configurable
def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh in Auto mode (optax/NNX expect auto sharding). data=-1: the rest."""
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        if len(devices) % model:
            raise ValueError(f"model={model} does not divide the {len(devices)} devices")
        data = len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, "
                         f"found {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"),
                axis_types=(jax.sharding.AxisType.Auto,) * 2)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, str | None] = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims are named by `logical_axes`."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    spec, used = [], set()
    for name, size in zip(logical_axes, shape):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is not None and mesh_axis not in mesh.shape:
            raise ValueError(f"rule {name!r} -> {mesh_axis!r}: no such mesh axis in {dict(mesh.shape)}")
        if mesh_axis is None or mesh_axis in used or size % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return PartitionSpec(*spec)


def named_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: Mapping[str, str | None] = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


# Parameter name (last two path entries) -> logical axes of the stored array.
_PARAM_AXES: Mapping[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_proj", "kernel"): ("embed", "q_heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("q_heads", "embed"),
    ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("lora_a", "kernel"): ("embed", None),
}


def param_path_names(path: Sequence[object]) -> tuple[str, ...]:
    """('layers', '0', 'mlp', 'up_proj', 'kernel') from a jax tree path of an NNX state."""
    return tuple(str(p.key if hasattr(p, "key") else getattr(p, "idx", p)) for p in path
                 if not isinstance(p, jax.tree_util.GetAttrKey))


def param_logical_axes(path: Sequence[object], ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a model parameter from its state path (norm weights are replicated)."""
    names = param_path_names(path)
    axes = _PARAM_AXES.get(names[-2:]) if len(names) >= 2 else None
    return axes if axes is not None and len(axes) == ndim else (None,) * ndim


def state_shardings(state: nnx.State, mesh: Mesh,
                    rules: Mapping[str, str | None] = DEFAULT_RULES):
    """A pytree of NamedShardings matching an NNX state (params or optimizer state)."""
    def one(path, x):
        return named_sharding(param_logical_axes(path, np.ndim(x)), np.shape(x), mesh, rules)
    return jax.tree_util.tree_map_with_path(one, state)


def shard_model(model: nnx.Module, mesh: Mesh,
                rules: Mapping[str, str | None] = DEFAULT_RULES) -> nnx.Module:
    """Places every parameter of `model` on `mesh` according to the rules (in place)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
    return model


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """Mesh + rules bundle handed to the rollout engine and learner (hashable: a jit static arg)."""
    mesh: Mesh
    rule_items: tuple[tuple[str, str | None], ...] = tuple(DEFAULT_RULES.items())

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, str | None] | None = None) -> "ShardingSpec":
        return cls(mesh, tuple((rules or DEFAULT_RULES).items()))

    @property
    def rules(self) -> dict[str, str | None]:
        return dict(self.rule_items)

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return named_sharding(logical_axes, shape, self.mesh, self.rules)


# Logical axes of the residual stream [B, T, H] between layers of a gradient forward.
RESIDUAL_AXES = ("batch", "residual_sequence", "embed")


def residual_spec(mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
                  ) -> ShardingSpec | None:
    """Where the residual stream [B, T, H] between layers of a gradient forward lives
    (`RESIDUAL_AXES`): rows over the batch axis, tokens over `residual_sequence`'s axis, so the
    per-layer activations a backward pass keeps are split over the devices of a tensor-parallel
    group instead of replicated on each of them. None when that axis has one device."""
    seq_axis = rules.get("residual_sequence")
    if seq_axis is None or mesh.shape.get(seq_axis, 1) == 1:
        return None
    return ShardingSpec.create(mesh, rules)
