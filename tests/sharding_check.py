"""Declared parameter axes vs the old path table, on 8 host CPU devices (run by test_sharding.py).

XLA_FLAGS must be set before jax is imported, so this runs as its own process:
    python tests/sharding_check.py
It prints one JSON line per tiny Qwen3 (tied and untied embeddings, with biases, KV heads that do
not divide the model axis) with the PartitionSpec of every parameter on a data=2 x model=4 mesh:
from the axes each parameter declares, and from the table `runtime/sharding.py` kept before the
axes moved into the model (issue 54, frozen below as the reference), plus the specs of the Adam
moments and the DistillSparse adapter.
"""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from sparrow_jax.rl import distill  # noqa: E402
from sparrow_jax.rl.learner_programs import opt_state_shardings  # noqa: E402
from sparrow_jax.runtime.sharding import (logical_to_spec, make_mesh, param_path_names,  # noqa: E402
                                          path_name, shard_model, state_shardings)

# The table the axes were looked up in before they were declared with the parameters: the last
# two path names -> logical axes; anything else (the norms) replicated.
LEGACY_TABLE = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_proj", "kernel"): ("embed", "q_heads"), ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"), ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"), ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("q_heads", "embed"), ("o_proj", "bias"): ("embed",),
    ("gate_proj", "kernel"): ("embed", "mlp"), ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"), ("lm_head", "kernel"): ("embed", "vocab"),
}


def specs(tree) -> dict[str, str]:
    return {path_name(p): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(tree)}


# (tied embeddings, vocab, query heads, KV heads, head dim). Tied: vocab 98 and the 6 columns of
# one KV head do not divide the 4-way model axis and are replicated by rule; untied: everything
# that has a model-axis rule splits 4 ways.
CASES = ((True, 98, 2, 1, 6), (False, 96, 4, 2, 16))


def check(tie: bool, vocab: int, heads: int, kv_heads: int, head_dim: int, mesh) -> dict:
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      tie_word_embeddings=tie, attention_bias=True)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    declared = specs(state_shardings(params, mesh))
    legacy = {}
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        names = param_path_names(p)
        axes = LEGACY_TABLE.get(names[-2:], (None,) * x.ndim)
        legacy["/".join(names)] = str(logical_to_spec(axes, x.shape, mesh))
    shard_model(model, mesh)
    params = nnx.state(model, nnx.Param)
    placed = specs(jax.tree.map(lambda x: x.sharding, params))
    tx = optax.adamw(1e-3)
    moments = specs(state_shardings(jax.eval_shape(tx.init, params), mesh))
    from_params = specs(opt_state_shardings(tx, params))
    lora = distill.init_lora(params, 2, key=jax.random.key(0))
    return {"tie": tie, "declared": declared, "legacy": legacy, "placed": placed,
            "moments": moments, "moments_from_params": from_params,
            "adapter": sorted({str(x.sharding.spec) for x in jax.tree.leaves(lora)}),
            "adapter_mesh": str(dict(jax.tree.leaves(lora)[0].sharding.mesh.shape)),
            "logits": list(model(jnp.ones((2, 3), jnp.int32)).shape)}


def main() -> None:
    assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.device_count()}"
    mesh = make_mesh(2, 4)
    for case in CASES:
        print(json.dumps(check(*case, mesh)), flush=True)


if __name__ == "__main__":
    main()
