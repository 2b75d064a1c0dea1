"""Qwen3 dense decoder in Flax NNX with a pluggable attention function.

Dense training forwards, teacher-forced sparse forwards and the rollout engine's cached decode all
run the same layers; they differ only in the `attend` callback each layer calls with its
post-RoPE q/k/v, so the block-sparse path can never drift from the dense model.

Every weight declares the logical axes of its dims where it is created (`declare_axes`);
`runtime/sharding.py`'s rules map them to mesh axes (`state_shardings`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax.model.attention import (FullAttentionFn, dense_causal_attention,
                                         layer_splits_of)
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.runtime.choices import Choice
from sparrow_jax.runtime.sharding import RESIDUAL_AXES, ShardingSpec, declare_axes

Array = jax.Array
# attend(layer_idx, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D]) -> [B, T, Hq, D]
AttendFn = Callable[[int, Array, Array, Array], Array]


# Per-layer rematerialisation in the gradient forward: what each layer keeps for the backward pass.
#   "none": everything (fastest, most memory); "full": only the layer's input (recompute the
#   layer); "dots": the outputs of the weight matmuls (dots without batch dimensions), recompute
#   attention scores, norms and activations - the usual LLM trade-off.
class RematMode(Choice):
    """Per-layer rematerialisation of the gradient forward (`LearnerConfig.remat`)."""
    NONE = "none"
    FULL = "full"
    DOTS = "dots"


REMAT_POLICIES = {
    RematMode.FULL: None,
    RematMode.DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_MODES = RematMode.values()


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """positions [B, T] int -> cos, sin [B, T, head_dim] f32 (HF 'default' RoPE, rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, H, D]; cos/sin [B, T, D]. Same op order as HF so f32 results match bit-closely."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str, *, param_dtype=jnp.float32):
        """axis: the logical axis of the normalised dim ("embed", or "head_dim" per head)."""
        self.weight = nnx.Param(jnp.ones((dim,), dtype=param_dtype), **declare_axes(axis))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        # As in HF: normalise in f32, cast back, then scale (bf16 rounding happens before the scale).
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


def _linear(rngs: nnx.Rngs, din: int, dout: int, axes: tuple[str, str], *, bias: bool, dtype,
            param_dtype) -> nnx.Linear:
    """y = x @ kernel [din, dout] (+ bias [dout]); axes: the logical axes of (din, dout)."""
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs,
                      kernel_metadata=declare_axes(*axes), bias_metadata=declare_axes(axes[1]))


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        kw = dict(bias=cfg.attention_bias, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = _linear(rngs, h, cfg.num_attention_heads * d, ("embed", "q_heads"), **kw)
        self.k_proj = _linear(rngs, h, cfg.num_key_value_heads * d, ("embed", "kv_heads"), **kw)
        self.v_proj = _linear(rngs, h, cfg.num_key_value_heads * d, ("embed", "kv_heads"), **kw)
        self.o_proj = _linear(rngs, cfg.num_attention_heads * d, h, ("q_heads", "embed"), **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d)

    def project(self, x: Array, cos: Array, sin: Array, *, raw_qk: bool = False
                ) -> tuple[Array, Array, Array]:
        """x [B, T, H] -> q [B, T, Hq, D], k/v [B, T, Hkv, D]; q/k RMS-normed per head, then RoPE
        (raw_qk: q and k as projected, neither normed nor rotated - `run_layers`)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if raw_qk:
            return q, k, v
        return (apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v)

    def output(self, attn: Array) -> Array:
        b, t = attn.shape[:2]
        return self.o_proj(attn.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype)
        h, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(rngs, h, m, ("embed", "mlp"), **kw)
        self.up_proj = _linear(rngs, h, m, ("embed", "mlp"), **kw)
        self.down_proj = _linear(rngs, m, h, ("mlp", "embed"), **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed",
                                       param_dtype=param_dtype)
        self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed",
                                                param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, cos: Array, sin: Array,
                 attend: Callable[[Array, Array, Array], Array], *, raw_qk: bool = False
                 ) -> Array:
        # Named scopes: a profile (`sparrow bench rollout --profile`) attributes time to them.
        with jax.named_scope("qkv_proj"):
            q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin, raw_qk=raw_qk)
        a = attend(q, k, v)
        with jax.named_scope("o_proj"):
            x = x + self.self_attn.output(a)
        with jax.named_scope("mlp"):
            return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 dense decoder. `model(tokens [B, T])` -> logits [B, T, V] (f32)."""

    def __init__(self, config: Qwen3Config, *, dtype=jnp.float32, param_dtype=None,
                 rngs: nnx.Rngs | None = None, remat: bool = False):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        param_dtype = param_dtype or dtype
        self.config = config
        self.dtype = dtype
        self.remat = remat
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
                                      embedding_metadata=declare_axes("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, "embed",
                            param_dtype=param_dtype)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            rngs, config.hidden_size, config.vocab_size, ("embed", "vocab"), bias=False,
            dtype=dtype, param_dtype=param_dtype)

    # -- building blocks shared by every forward --------------------------------------------------
    def embed(self, tokens: Array) -> Array:
        return self.embed_tokens(tokens).astype(self.dtype)

    def run_layers(self, x: Array, positions: Array, attend: AttendFn, *,
                   remat: str | None = None,
                   layer_splits: tuple[int, ...] | None = None,
                   residual_spec: ShardingSpec | None = None,
                   layers: tuple[int, int] | None = None, raw_qk: bool = False) -> Array:
        """x [B, T, H] -> final-normed hidden [B, T, H]; `attend` sees every layer's q/k/v.

        remat: one of REMAT_MODES for this call (None: "full" if the model was built with
        remat=True, else "none").
        layer_splits: the layer indices at which `attend` changes behaviour (`layer_splits_of`),
        or None if unknown. With known splits each run of alike layers is one `lax.scan` over
        the layers' stacked weights (`_scan_layers`, its body rematerialised per `remat`);
        otherwise (the rollout's cached decode, whose KV cache is per layer) they are unrolled.
        residual_spec: where the residual stream [B, T, H] between layers lives (tokens over the
        `model` axis: `sharding.residual_spec`), so the activations a
        backward pass keeps per layer are split over the devices that share a row instead of
        replicated on each (sequence parallelism; XLA turns the layer's all-reduces into
        reduce-scatter + all-gather). None: XLA's choice.
        layers: (start, stop) runs only layers start..stop-1 on x (the residual stream after
        layer start - 1), and returns their output without the final norm when stop is not the
        last layer: two forwards that share their first layers (the sparsity-aware warm-up's
        dense and sparse ones) run those once. None: all layers.
        raw_qk: `attend` gets q and k as projected, before their per-head RMSNorms
        (`Attention.q_norm` / `k_norm`) and RoPE (`rope_cos_sin` at `positions`), and applies
        them itself: the GPU decode kernels do it as they read the heads, where XLA would spend
        kernels of its own on it (`pallas_kernels.reference.HeadFinish`). Unrolled layers only.
        """
        constrain = functools.partial(constrain_residual, spec=residual_spec)
        mode = remat or ("full" if self.remat else "none")
        if mode not in REMAT_MODES:
            raise ValueError(f"remat must be one of {REMAT_MODES}, got {mode!r}")
        n = len(self.layers)
        start, stop = layers or (0, n)
        if not 0 <= start < stop <= n:
            raise ValueError(f"layers = {layers} must be (start, stop) with "
                             f"0 <= start < stop <= {n} (the model's layers)")
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        finish = self.norm if stop == n else (lambda h: h)
        if layer_splits is not None:
            if raw_qk:
                raise ValueError("raw_qk needs unrolled layers (layer_splits=None)")
            bounds = sorted({start, stop, *(i for i in layer_splits if start < i < stop)})
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                x = self._scan_layers(lo, hi, constrain(x), cos, sin, attend, mode, constrain)
            return finish(x)

        def layer_call(i: int):
            # i is closed over, not a default argument: nnx.remat would trace that into an array.
            return lambda layer, x, cos, sin: layer(x, cos, sin, lambda q, k, v: attend(i, q, k, v),
                                                    raw_qk=raw_qk)

        for i in range(start, stop):
            layer_fn = layer_call(i)
            if mode != "none":
                layer_fn = nnx.remat(layer_fn, policy=REMAT_POLICIES[mode])
            x = constrain(layer_fn(self.layers[i], x, cos, sin))
        return finish(x)

    def _scan_layers(self, lo: int, hi: int, x: Array, cos: Array, sin: Array, attend: AttendFn,
                     remat: str, constrain: Callable[[Array], Array] = lambda x: x) -> Array:
        """Layers lo..hi-1 (which `attend` treats alike) as one `lax.scan`.

        Why: unrolled, XLA's GPU scheduler overlaps the layers' recomputations in the backward
        pass and keeps ~3.5x the activations alive (measured with `sparrow dryrun`'s compiler:
        Qwen3-1.7B, one 34.8K-token row, remat full: 1.4 GiB of temporaries per extra layer
        unrolled vs 0.4 scanned; the whole gradient program 75.7 -> 30.2 GiB); a scan runs the
        backward one layer at a time by construction, and compiles one layer instead of
        `hi - lo` (that program: minutes -> 16 s). The weight matrices are stacked in the compute
        dtype (their matmuls cast to it anyway, so values are unchanged; the stacked copy costs
        the compute-dtype weights once); norm weights keep their dtype.
        """
        graphdef = nnx.graphdef(self.layers[lo])
        states = [nnx.state(layer) for layer in self.layers[lo:hi]]
        compute = jnp.dtype(self.dtype)

        def stack(*leaves):
            if leaves[0].ndim >= 2 and jnp.issubdtype(leaves[0].dtype, jnp.floating):
                leaves = [a.astype(compute) for a in leaves]
            return jnp.stack(leaves)

        stacked = jax.tree.map(stack, *states)

        def body(x, state):
            layer = nnx.merge(graphdef, state)
            return constrain(layer(x, cos, sin, lambda q, k, v: attend(lo, q, k, v))), None

        if remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
        x, _ = jax.lax.scan(body, x, stacked)
        return x

    def logits(self, hidden: Array) -> Array:
        """hidden [..., H] -> logits [..., V] in f32 (accumulated in f32 even for bf16 weights)."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...].astype(self.dtype)
            return jnp.einsum("...h,vh->...v", hidden, w, preferred_element_type=jnp.float32)
        w = self.lm_head.kernel[...].astype(self.dtype)
        return jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)

    # -- whole-sequence forwards ---------------------------------------------------------------
    def hidden_states(self, tokens: Array, positions: Array | None = None,
                      attention_mask: Array | None = None, *,
                      attention_fn: FullAttentionFn | None = None,
                      remat: str | None = None,
                      residual_spec: ShardingSpec | None = None) -> Array:
        """tokens [B, T] -> final-normed hidden [B, T, H].

        attention_mask [B, T]: 1 for real tokens (default all ones). positions default to
        cumsum(mask) - 1, which is right for left padding as well as right padding.
        remat: per-layer rematerialisation for gradients (see `run_layers`).
        """
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, dtype=jnp.int32)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
        fn = attention_fn or dense_causal_attention
        return self.run_layers(
            self.embed(tokens), positions,
            lambda i, q, k, v: fn(i, q, k, v, positions, attention_mask), remat=remat,
            layer_splits=layer_splits_of(fn), residual_spec=residual_spec)

    def __call__(self, tokens: Array, positions: Array | None = None,
                 attention_mask: Array | None = None, *,
                 attention_fn: FullAttentionFn | None = None) -> Array:
        return self.logits(self.hidden_states(tokens, positions, attention_mask,
                                              attention_fn=attention_fn))


def constrain_residual(x: Array, spec: ShardingSpec | None) -> Array:
    """`x` [B, T, H] constrained to `spec`'s sharding of `RESIDUAL_AXES` (a dim that does not
    divide its mesh axis stays replicated, as everywhere); unchanged when `spec` is None."""
    if spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec.sharding(RESIDUAL_AXES, x.shape))


def compute_copy(model: Qwen3ForCausalLM, dtype=None) -> Qwen3ForCausalLM:
    """The model with its parameters cast to `dtype` (default: its compute dtype), for rollout
    from f32 master weights: the cast happens once here instead of inside every decode step's
    matmuls, and a bf16 copy halves the weight bytes each decode step reads. Shardings are kept.
    Returns `model` itself when every parameter already has that dtype."""
    dtype = jnp.dtype(dtype or model.dtype)
    graphdef, state = nnx.split(model)
    leaves = jax.tree.leaves(state)
    if all(not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype for x in leaves):
        return model
    return nnx.merge(graphdef, _cast_floats(state, dtype=dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast_floats(tree, *, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def default_dtype() -> jnp.dtype:
    """bf16 on accelerators, f32 on CPU (XLA:CPU bf16 matmuls are slow and imprecise)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
