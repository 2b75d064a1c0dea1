"""A decode layer as the fewest GPU kernels, for both engines (issue 55; the census:
docs/benchmarks.md "Kernels per decode step").

Where the decode kernels run on Pallas Triton (`fewest_kernels`), a layer hands its attention
the raw projected heads, and the kernels do what XLA would otherwise launch a kernel for,
each: they RMSNorm and rotate q and k as they read them (`pallas_kernels.reference.HeadFinish`),
one kernel writes K, V and the filled page's centroid (`pallas_triton_write`), one scores,
selects and looks up the pages (`pallas_triton_select.select_pages_triton`), and one attends
for every row of a sparse layer, whether its budget covers its length or not (no `lax.cond`).
The engines' per-layer functions (`paged._layer_attention`, `static._decode_attention`) take
these arguments on every backend; elsewhere the model finishes the heads itself and they go
unused.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM, rope_cos_sin
from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.runtime.sharding import ShardingSpec

# layer(i, q, k, v, cos, sin, q_norm, k_norm) -> out [S, Hq, D]: one layer's attention, with
# q/k/v [S, H, D] (raw or finished heads; one [S, Hq + 2 Hkv, D] array for all three when
# `combined_heads`), cos/sin [S, D] f32 at the fed tokens' positions, the layer's per-head norm
# weights [D].
LayerFn = Callable[..., jax.Array]


def fewest_kernels(backend: str) -> bool:
    """Whether the decode layers run as the fewest kernels: where the attention runs on Pallas
    Triton (the GPU backend). Elsewhere XLA scatters write the caches and a `lax.cond` picks
    dense / mixed / sparse per sparse layer: on CPU and TPU a branch costs no launch, and their
    covered rows would otherwise run the dense and the sparse attention both."""
    return pallas_kernels.resolve_backend(backend) == "pallas_triton"


def combined_heads(cfg: RolloutConfig, spec: ShardingSpec | None) -> bool:
    """Whether a layer hands its kernels q, k and v as one [S, Hq + 2 Hkv, D] array (the
    kernels read their heads from it by offset): the projections come out of one split-K gemm
    whose partial sums XLA adds in one kernel for one consumer array, and in one per head kind
    for three (2 launches per layer more). Only with `fewest_kernels` and the heads not split
    over a model axis (its shards would each hold a mix of kinds)."""
    return fewest_kernels(cfg.backend) and (spec is None
                                            or spec.mesh.shape.get("model", 1) == 1)


def decode_layers(model: Qwen3ForCausalLM, layer: LayerFn, tokens: jax.Array,
                  positions: jax.Array, *, cfg: RolloutConfig,
                  spec: ShardingSpec | None) -> jax.Array:
    """One decode step through the model's layers: tokens [S] fed at positions [S] (their
    cache index) -> final-normed hidden [S, 1, H]. `layer` attends (and writes its cache);
    with `fewest_kernels` it gets the raw heads (`run_layers(raw_qk=True)`), the RoPE table of
    this step computed once for all layers, and with `combined_heads` the three projections as
    one array."""
    mcfg = model.config
    combined = combined_heads(cfg, spec)
    cos, sin = (x[:, 0] for x in rope_cos_sin(positions[:, None], mcfg.head_dim,
                                              mcfg.rope_theta))

    def attend(i, q, k, v):
        heads = model.layers[i].self_attn
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        if combined:
            with jax.named_scope("qkv_proj"):       # [S, Hq + 2 Hkv, D], from the flat rows
                flat = jnp.concatenate([x.reshape(x.shape[0], -1) for x in (q, k, v)], axis=1)
                q = k = v = flat.reshape(q.shape[0], -1, q.shape[2])
        return layer(i, q, k, v, cos, sin, heads.q_norm.weight[...],
                     heads.k_norm.weight[...])[:, None]

    return model.run_layers(model.embed(tokens[:, None]), positions[:, None], attend,
                            raw_qk=fewest_kernels(cfg.backend))
