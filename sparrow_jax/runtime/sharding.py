"""Explicit sharding as data: logical axis names -> mesh axes.

Every array that is sharded (parameters, optimizer state, KV cache, batches) names its dimensions
with logical axes; `ShardingRules` maps them to mesh axes. A parameter declares its axes where the
model creates it (`declare_axes`: metadata on its `nnx.Param`, kept by `nnx.state`, `nnx.split`,
`nnx.eval_shape` and by optax's moments, which mirror the parameter tree); `state_shardings` reads
them back. A logical axis the rules do not name, and a parameter that declares no axes, are errors
naming it - never a silent replica, which at 8B on a pod is a silent memory blow-up.

A logical axis whose size does not divide the mesh axis is replicated (e.g. 2 KV heads on a 4-way
`model` axis) rather than failing: that is a rule, not an accident.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import gin
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

LogicalAxes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class ShardingRules(Mapping[str, str | None]):
    """Logical axis -> mesh axis (None: replicated over the mesh). Hashable (a jit static arg).

    A read-only mapping (`rules.get("batch")`), plus `mesh_axis`, the strict lookup every
    sharding goes through: a logical axis it does not list is an error, never a replica."""
    pairs: tuple[tuple[str, str | None], ...]

    def __post_init__(self):
        names = [name for name, _ in self.pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"sharding rules name a logical axis twice: {names}")
        for name, mesh_axis in self.pairs:
            if not isinstance(name, str) or not (mesh_axis is None or isinstance(mesh_axis, str)):
                raise ValueError(f"sharding rule {name!r} -> {mesh_axis!r}: a logical axis name "
                                 "maps to a mesh axis name or None")

    @classmethod
    def of(cls, rules: Mapping[str, str | None]) -> "ShardingRules":
        """`rules` itself when it already is one, else the rules of a plain mapping."""
        return rules if isinstance(rules, cls) else cls(tuple(rules.items()))

    def __getitem__(self, name: str) -> str | None:
        for key, mesh_axis in self.pairs:
            if key == name:
                return mesh_axis
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def mesh_axis(self, name: str, *, of: str = "an array") -> str | None:
        """The mesh axis of logical axis `name` (None: replicated). `of` names the array in the
        error raised when the rules do not know `name`."""
        if name not in self:
            raise ValueError(f"{of}: logical axis {name!r} has no sharding rule (known: "
                             f"{sorted(self)}); add it to the rules or fix the name")
        return self[name]


# Logical axes used across the project.
DEFAULT_RULES = ShardingRules.of({
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
})


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
                    rules: Mapping[str, str | None] = DEFAULT_RULES, *,
                    of: str | None = None) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims are named by `logical_axes` (None: a
    replicated dim). `of` names the array in errors (default: its axes and shape)."""
    of = of or f"an array of shape {tuple(shape)} with logical axes {tuple(logical_axes)}"
    if len(logical_axes) != len(shape):
        raise ValueError(f"{of}: logical axes {tuple(logical_axes)} do not match shape "
                         f"{tuple(shape)}")
    rules = ShardingRules.of(rules)
    spec, used = [], set()
    for name, size in zip(logical_axes, shape):
        mesh_axis = None if name is None else rules.mesh_axis(name, of=of)
        if mesh_axis is not None and mesh_axis not in mesh.shape:
            raise ValueError(f"rule {name!r} -> {mesh_axis!r}: no such mesh axis in {dict(mesh.shape)}")
        # A dim that does not divide its mesh axis (or whose mesh axis an earlier dim took) is
        # replicated by rule: e.g. 2 KV heads on a 4-way `model` axis.
        if mesh_axis is None or mesh_axis in used or size % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return PartitionSpec(*spec)


def named_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: Mapping[str, str | None] = DEFAULT_RULES, *,
                   of: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules, of=of))


# -- axes declared with the parameter --------------------------------------------------------------
# The nnx.Variable metadata entry holding a parameter's logical axes. Not flax's own
# `out_sharding` (alias `sharding_names`): NNX would shard eagerly on creation, reading the names
# as mesh axes, and the rules would not be applied.
AXES_METADATA = "logical_axes"


def declare_axes(*axes: str | None) -> dict[str, LogicalAxes]:
    """Variable metadata declaring a parameter's logical axes, one per dim (None: replicated):
    `nnx.Param(value, **declare_axes("embed"))`, `nnx.Linear(..., kernel_metadata=declare_axes(
    "embed", "mlp"))`."""
    return {AXES_METADATA: tuple(axes)}


def param_path_names(path: Sequence[object]) -> tuple[str, ...]:
    """('layers', '0', 'mlp', 'up_proj', 'kernel') from a jax tree path of an NNX state."""
    return tuple(str(p.key if hasattr(p, "key") else getattr(p, "idx", p)) for p in path
                 if not isinstance(p, jax.tree_util.GetAttrKey))


def path_name(path: Sequence[object]) -> str:
    """'layers/0/mlp/up_proj/kernel', '0/mu/lm_head/kernel': a jax tree path for messages (an
    NNX Variable's own 'value' attribute left out, named tuple fields kept)."""
    names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(n) for n, k in zip(names, path)
                    if not (isinstance(k, jax.tree_util.GetAttrKey) and n == "value"))


def declared_axes(variable: nnx.Variable, path: Sequence[object] = ()) -> LogicalAxes:
    """The logical axes `variable` was created with (`declare_axes`); an error naming its path
    (a tree path) when it declares none."""
    axes = variable.get_metadata().get(AXES_METADATA)
    if axes is None:
        name = path_name(path) or type(variable).__name__
        raise ValueError(f"parameter {name!r} declares no logical axes: create it with "
                         "sharding.declare_axes(...) metadata (replicated dims are None)")
    return tuple(axes)


def tree_shardings(tree: Any, axes_of: Callable[[tuple, Any], LogicalAxes], mesh: Mesh,
                   rules: Mapping[str, str | None] = DEFAULT_RULES):
    """NamedShardings for a pytree of arrays whose logical axes `axes_of(path, leaf)` gives."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: named_sharding(axes_of(path, x), np.shape(x), mesh, rules,
                                       of=repr(path_name(path))), tree)


def state_shardings(state: nnx.State, mesh: Mesh,
                    rules: Mapping[str, str | None] = DEFAULT_RULES):
    """A pytree of NamedShardings matching an NNX state (params, or an optimizer state whose
    moments keep their parameters' `nnx.Param` nodes), from each parameter's declared axes.

    Scalars outside parameters (an optimizer's step count) are replicated; any other array
    without declared axes is an error naming its path."""
    def one(path, node):
        if isinstance(node, nnx.Variable):
            axes = declared_axes(node, path)
            of = f"parameter {path_name(path)!r}"
            return jax.tree.map(lambda x: named_sharding(axes, np.shape(x), mesh, rules, of=of),
                                node)
        if np.ndim(node) == 0:
            return NamedSharding(mesh, PartitionSpec())
        raise ValueError(f"{path_name(path)!r}: an array of shape "
                         f"{np.shape(node)} outside any nnx.Param, so with no declared logical "
                         "axes")
    return jax.tree_util.tree_map_with_path(one, state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


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
    rules: ShardingRules = DEFAULT_RULES

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, str | None] | None = None) -> "ShardingSpec":
        return cls(mesh, ShardingRules.of(DEFAULT_RULES if rules is None else rules))

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int], *,
                 of: str | None = None) -> NamedSharding:
        return named_sharding(logical_axes, shape, self.mesh, self.rules, of=of)


# Logical axes of the residual stream [B, T, H] between layers of a gradient forward.
RESIDUAL_AXES = ("batch", "residual_sequence", "embed")


def residual_spec(mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
                  ) -> ShardingSpec | None:
    """Where the residual stream [B, T, H] between layers of a gradient forward lives
    (`RESIDUAL_AXES`): rows over the batch axis, tokens over `residual_sequence`'s axis, so the
    per-layer activations a backward pass keeps are split over the devices of a tensor-parallel
    group instead of replicated on each of them. None when that axis has one device."""
    seq_axis = ShardingRules.of(rules).mesh_axis("residual_sequence", of="the residual stream")
    if seq_axis is None or mesh.shape.get(seq_axis, 1) == 1:
        return None
    return ShardingSpec.create(mesh, rules)
