"""Qwen3 dense decoder in Flax NNX with a pluggable attention function.

Dense training forwards, teacher-forced sparse forwards and the rollout engine's cached decode all
run the same layers; they differ only in the `attend` callback each layer calls with its
post-RoPE q/k/v, so the block-sparse path can never drift from the dense model.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax.model.config import Qwen3Config

Array = jax.Array
# attend(layer_idx, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D]) -> [B, T, Hq, D]
AttendFn = Callable[[int, Array, Array, Array], Array]


class FullAttentionFn(Protocol):
    def __call__(self, layer_idx: int, q: Array, k: Array, v: Array, positions: Array,
                 attention_mask: Array) -> Array: ...


_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free

# Per-layer rematerialisation in the gradient forward: what each layer keeps for the backward pass.
#   "none": everything (fastest, most memory); "full": only the layer's input (recompute the
#   layer); "dots": the outputs of the weight matmuls (dots without batch dimensions), recompute
#   attention scores, norms and activations - the usual LLM trade-off.
REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_MODES = ("none", *REMAT_POLICIES)


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


def masked_gqa_attention(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """GQA attention of C queries over S keys under an explicit visibility mask (f32 softmax).

    q [B, C, Hq, D], k/v [B, S, Hkv, D], visible [B, Hkv or 1, C, S] bool -> [B, C, Hq, D].
    """
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, c, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, :, None], scores * (d ** -0.5), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, c, hq, d).astype(q.dtype)


def _causal_attention_rows(q: Array, k: Array, v: Array, key_mask: Array, *,
                           q_offset) -> Array:
    """Queries at absolute indices q_offset.. against keys 0..S-1: key j is visible to query i
    iff j <= i and key_mask[j]. q [B, C, Hq, D], k/v [B, S, Hkv, D], key_mask [B, S] bool."""
    c, s_len = q.shape[1], k.shape[1]
    causal = jnp.arange(s_len)[None, :] <= (q_offset + jnp.arange(c))[:, None]      # [C, S]
    return masked_gqa_attention(q, k, v, (causal[None] & key_mask[:, None, :])[:, None])


def map_query_chunks(rows: Callable[[Array, Array, Array], Array], query_chunk: int, q: Array,
                     positions: Array) -> Array:
    """Whole-sequence attention `query_chunk` queries at a time.

    rows(q_chunk [B, C, Hq, D], positions_chunk [B, C], offset []) -> [B, C, Hq, D] computes the
    chunk whose first query has index `offset`. Runs as a `lax.scan` (so XLA cannot schedule
    the chunks side by side) whose body is rematerialised in the backward pass: forward and
    gradient hold one chunk's [B, H, C, S] scores at a time. q [B, T, Hq, D] -> [B, T, Hq, D].
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")
    b, t, hq, d = q.shape
    n = -(-t // query_chunk)
    pad = n * query_chunk - t          # padded queries (beyond T) are dropped at the end
    q_chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
        b, n, query_chunk, hq, d).swapaxes(0, 1)                          # [n, B, C, Hq, D]
    pos_chunks = jnp.pad(positions, ((0, 0), (0, pad)), mode="edge").reshape(
        b, n, query_chunk).swapaxes(0, 1)                                   # [n, B, C]
    offsets = jnp.arange(n, dtype=jnp.int32) * query_chunk
    body = jax.checkpoint(lambda xs: rows(*xs))
    _, out = jax.lax.scan(lambda carry, xs: (carry, body(xs)), None,
                          (q_chunks, pos_chunks, offsets))
    return out.swapaxes(0, 1).reshape(b, n * query_chunk, hq, d)[:, :t]


# Query chunks are scanned in at most this many groups, each against the keys its last query can
# see, so causal attention computes ~(1 + 1/groups)/2 of the full T x T scores instead of all of
# them, while the program unrolls only `groups` scans per layer (compile time stays flat at 32K).
CAUSAL_GROUPS = 8


def map_causal_query_chunks(rows: Callable[[Array, Array, Array, int], Array], query_chunk: int,
                            q: Array, positions: Array, *, groups: int = CAUSAL_GROUPS) -> Array:
    """`map_query_chunks` for causal attention: skips keys no query of a chunk can see.

    The chunks are split into up to `groups` consecutive groups; rows(q_chunk, positions_chunk,
    offset, key_end) is called with the static number of keys the group's queries may need
    (keys >= key_end are in every query's future) and must attend to keys [0, key_end) only.
    q [B, T, Hq, D] -> [B, T, Hq, D].
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")
    t = q.shape[1]
    n = -(-t // query_chunk)
    g = max(1, min(groups, n))
    bounds = [round(i * n / g) * query_chunk for i in range(g + 1)]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        hi = min(hi, t)
        outs.append(map_query_chunks(
            lambda q_c, p_c, offset, lo=lo, hi=hi: rows(q_c, p_c, offset + lo, hi),
            query_chunk, q[:, lo:hi], positions[:, lo:hi]))
    return jnp.concatenate(outs, axis=1)


def dense_causal_attention(layer_idx: int, q: Array, k: Array, v: Array, positions: Array,
                           attention_mask: Array) -> Array:
    """Exact causal GQA attention over a whole sequence.

    q [B, T, Hq, D], k/v [B, T, Hkv, D], attention_mask [B, T] (1 = real token). Causality is by
    index (key j visible to query i iff j <= i), so left- and right-padded batches both work.
    Materialises [B, Hq, T, T] scores: see `chunked_causal_attention` for long sequences.
    """
    del layer_idx, positions
    return _causal_attention_rows(q, k, v, attention_mask.astype(bool), q_offset=0)


def chunked_causal_attention(query_chunk: int) -> FullAttentionFn:
    """`dense_causal_attention`, computed `query_chunk` queries at a time
    (`map_causal_query_chunks`): one [B, Hq, query_chunk, <=T] score block at a time instead of
    [B, Hq, T, T], in the forward and the gradient, and only against keys some query of the
    group can see (about half the score FLOPs and bytes of the one-shot form). Same values.
    """
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")

    def attention(layer_idx: int, q: Array, k: Array, v: Array, positions: Array,
                  attention_mask: Array) -> Array:
        del layer_idx
        key_mask = attention_mask.astype(bool)
        return map_causal_query_chunks(
            lambda q_c, _, offset, key_end: _causal_attention_rows(
                q_c, k[:, :key_end], v[:, :key_end], key_mask[:, :key_end], q_offset=offset),
            query_chunk, q, positions)

    return attention


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype=param_dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        # As in HF: normalise in f32, cast back, then scale (bf16 rounding happens before the scale).
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


def _linear(rngs: nnx.Rngs, din: int, dout: int, *, bias: bool, dtype, param_dtype) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        kw = dict(bias=cfg.attention_bias, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = _linear(rngs, h, cfg.num_attention_heads * d, **kw)
        self.k_proj = _linear(rngs, h, cfg.num_key_value_heads * d, **kw)
        self.v_proj = _linear(rngs, h, cfg.num_key_value_heads * d, **kw)
        self.o_proj = _linear(rngs, cfg.num_attention_heads * d, h, **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d)

    def project(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """x [B, T, H] -> q [B, T, Hq, D], k/v [B, T, Hkv, D]; q/k RMS-normed per head, then RoPE."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, attn: Array) -> Array:
        b, t = attn.shape[:2]
        return self.o_proj(attn.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = _linear(rngs, cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = _linear(rngs, cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = _linear(rngs, cfg.intermediate_size, cfg.hidden_size, **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, cos: Array, sin: Array,
                 attend: Callable[[Array, Array, Array], Array]) -> Array:
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.output(attend(q, k, v))
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
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            rngs, config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
            param_dtype=param_dtype)

    # -- building blocks shared by every forward --------------------------------------------------
    def embed(self, tokens: Array) -> Array:
        return self.embed_tokens(tokens).astype(self.dtype)

    def run_layers(self, x: Array, positions: Array, attend: AttendFn, *,
                   remat: str | None = None) -> Array:
        """x [B, T, H] -> final-normed hidden [B, T, H]; `attend` sees every layer's q/k/v.

        remat: one of REMAT_MODES for this call (None: "full" if the model was built with
        remat=True, else "none")."""
        mode = remat or ("full" if self.remat else "none")
        if mode not in REMAT_MODES:
            raise ValueError(f"remat must be one of {REMAT_MODES}, got {mode!r}")
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        for i, layer in enumerate(self.layers):
            def layer_fn(layer, x, cos, sin, i=i):
                return layer(x, cos, sin, lambda q, k, v: attend(i, q, k, v))
            if mode != "none":
                layer_fn = nnx.remat(layer_fn, policy=REMAT_POLICIES[mode])
            x = layer_fn(layer, x, cos, sin)
        return self.norm(x)

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
                      remat: str | None = None) -> Array:
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
            lambda i, q, k, v: fn(i, q, k, v, positions, attention_mask), remat=remat)

    def __call__(self, tokens: Array, positions: Array | None = None,
                 attention_mask: Array | None = None, *,
                 attention_fn: FullAttentionFn | None = None) -> Array:
        return self.logits(self.hidden_states(tokens, positions, attention_mask,
                                              attention_fn=attention_fn))


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
