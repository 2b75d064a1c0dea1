"""Sharding declared with the parameter: every weight names its logical axes where the model
creates it, the rules are a typed table, and a parameter or axis the rules cannot place is an
error naming it (never a silent replica).

The comparison with the old path table runs on a data=2 x model=4 mesh of 8 CPU devices in a
subprocess (tests/sharding_check.py): the devices come from XLA_FLAGS, which must be set before
jax is first imported.
"""

import os

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from hf_fixtures import run_on_cpu_devices
from sparrow_jax.rl import distill
from sparrow_jax.runtime.sharding import (DEFAULT_RULES, ShardingRules, ShardingSpec,
                                          declare_axes, make_mesh, path_name, residual_spec,
                                          shard_model, state_shardings)

HERE = os.path.dirname(os.path.abspath(__file__))


class _Block(nnx.Module):
    def __init__(self, w_axes: dict):
        self.proj = nnx.Linear(4, 8, rngs=nnx.Rngs(0), kernel_metadata=declare_axes("embed", "mlp"),
                               bias_metadata=declare_axes("mlp"))
        self.scale = nnx.Param(jnp.ones((8,)), **w_axes)


def test_parameter_without_declared_axes_is_an_error_naming_it():
    block = _Block({})
    with pytest.raises(ValueError, match="parameter 'scale' declares no logical axes"):
        state_shardings(nnx.state(block), make_mesh())
    with pytest.raises(ValueError, match="'scale' declares no logical axes"):
        shard_model(block, make_mesh())


def test_misspelt_logical_axis_is_an_error_naming_it_and_the_parameter():
    block = _Block(declare_axes("mpl"))
    with pytest.raises(ValueError, match="parameter 'scale'.*logical axis 'mpl' has no sharding rule"):
        state_shardings(nnx.state(block), make_mesh())
    spec = ShardingSpec.create(make_mesh())
    with pytest.raises(ValueError, match="logical axis 'bacth' has no sharding rule"):
        spec.sharding(("bacth", None), (4, 2))
    with pytest.raises(ValueError, match="'cache/k'.*'kv_head'"):
        spec.sharding(("batch", "kv_head"), (4, 2), of="'cache/k'")


def test_declared_axes_and_the_rule_for_sizes_that_do_not_divide():
    block = _Block(declare_axes(None))
    specs = {path_name(p): s.spec for p, s in
             jax.tree_util.tree_leaves_with_path(state_shardings(nnx.state(block), make_mesh()))}
    # One device: every model-axis rule divides; a declared None is replicated.
    assert specs == {"proj/kernel": jax.sharding.PartitionSpec(None, "model"),
                     "proj/bias": jax.sharding.PartitionSpec("model"),
                     "scale": jax.sharding.PartitionSpec(None)}


def test_optimizer_state_mirrors_declared_axes():
    block = _Block(declare_axes("mlp"))
    params = nnx.state(block, nnx.Param)
    opt = optax.adamw(1e-3).init(params)
    shardings = state_shardings(opt, make_mesh())
    assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(opt)
    counts = [s for p, s in jax.tree_util.tree_leaves_with_path(shardings)
              if "count" in jax.tree_util.keystr(p)]
    assert counts and all(s.spec == jax.sharding.PartitionSpec() for s in counts)
    # An array that is neither a parameter nor a scalar has no axes to read.
    with pytest.raises(ValueError, match="'mu/w'.*no declared logical axes"):
        state_shardings({"mu": {"w": jnp.zeros((3,))}}, make_mesh())


def test_rules_are_a_typed_hashable_table():
    assert dict(DEFAULT_RULES) == {
        "batch": "data", "vocab": "model", "embed": None, "q_heads": "model",
        "kv_heads": "model", "mlp": "model", "sequence": None, "residual_sequence": "model",
        "head_dim": None, "blocks": None}
    mesh = make_mesh()
    spec = ShardingSpec.create(mesh)
    assert spec.rules is DEFAULT_RULES and spec.mesh is mesh
    assert ShardingSpec.create(mesh, dict(DEFAULT_RULES)) == spec
    assert hash(ShardingSpec.create(mesh, dict(DEFAULT_RULES))) == hash(spec)
    assert spec.rules.get("batch") == "data" and spec.rules.mesh_axis("embed") is None
    with pytest.raises(ValueError, match="maps to a mesh axis name or None"):
        ShardingRules.of({"batch": 1})
    with pytest.raises(ValueError, match="'residual_sequence' has no sharding rule"):
        residual_spec(mesh, {"batch": "data"})


def test_adapter_declares_its_axes():
    assert distill.adapter_axes((jax.tree_util.DictKey("a"),), None) == (None, None)
    with pytest.raises(ValueError, match="adapter leaf 'layers/0/q_proj/c'"):
        distill.adapter_axes(tuple(jax.tree_util.DictKey(k) for k in
                                   ("layers", "0", "q_proj", "c")), None)


@pytest.fixture(scope="module")
def on_mesh():
    return {r["tie"]: r for r in run_on_cpu_devices([os.path.join(HERE, "sharding_check.py")])}


@pytest.mark.parametrize("tie", [True, False])
def test_declared_axes_give_the_old_tables_shardings(on_mesh, tie):
    """Every parameter of a tiny Qwen3 (tied / untied, with biases) declares axes, and on a
    2 x 4 mesh they give exactly the PartitionSpecs of the old path table; shard_model places
    them there; Adam moments follow their parameter and the adapter is replicated."""
    r = on_mesh[tie]
    assert ("lm_head/kernel" in r["declared"]) is not tie
    assert r["declared"] == r["legacy"], r
    assert r["placed"] == r["declared"]
    assert "P(None, 'model')" in r["declared"].values()     # the mesh really splits weights
    assert r["moments"] == r["moments_from_params"]
    moments = [(k.split("/", 2)[2], v) for k, v in r["moments"].items() if k.count("/") >= 2]
    assert len(moments) == 2 * len(r["declared"])                       # mu and nu
    assert all(r["declared"][name] == spec for name, spec in moments), moments
    assert r["adapter"] == ["P(None, None)"] and r["adapter_mesh"] == "{'data': 2, 'model': 4}"
    assert r["logits"][:2] == [2, 3]
