"""Dense chunked prefill of prompts into per-layer K/V (both rollout engines start here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparrow_jax.model.attention import MASK_VALUE
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM


def prefill_attention(q, k_cache, v_cache, start, lengths):
    """Queries of one prompt chunk against the cache prefix. q [B, C, Hq, D], k/v [B, Hkv, S, D].
    start: a Python int (keys sliced to the chunk's end) or traced (a scanned chunk: every key,
    the causal mask hides those past the chunk)."""
    b, c, hq, d = q.shape
    hkv = k_cache.shape[1]
    stop = start + c if isinstance(start, int) else k_cache.shape[2]
    k, v = k_cache[:, :, :stop], v_cache[:, :, :stop]
    qg = q.reshape(b, c, hkv, hq // hkv, d)
    s = jnp.einsum("bckgd,bksd->bkgcs", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    key_idx = jnp.arange(stop)
    visible = (key_idx[None, :] <= (start + jnp.arange(c))[:, None])[None] & (
        key_idx[None, None, :] < lengths[:, None, None])
    s = jnp.where(visible[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgcs,bksd->bckgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, c, hq, d).astype(q.dtype)


def prefill(model: Qwen3ForCausalLM, prompt_tokens: jax.Array, prompt_lengths: jax.Array, *,
            chunk: int, attention=None) -> tuple[list, list, jax.Array]:
    """Dense prefill in chunks. prompt_tokens [Bp, P] (P a multiple of the block size).

    Returns per-layer K/V `[Bp, Hkv, P, D]` and the last prompt token's logits `[Bp, V]`.
    attention(layer, q, k_cache, v_cache, start, lengths): a chunk's attention (default: dense,
    `prefill_attention`; the paged engine's resume replays sparse selection).
    Several chunks of equal size run as a `lax.scan` (one compiled chunk, whatever P: the paged
    engine prefills resumed 32K-token samples); otherwise chunks are unrolled, each attending
    only to the keys before its end.
    """
    cfg = model.config
    bp, plen = prompt_tokens.shape
    ks = [jnp.zeros((bp, cfg.num_key_value_heads, plen, cfg.head_dim), model.dtype)
          for _ in range(cfg.num_hidden_layers)]
    vs = [jnp.zeros_like(k) for k in ks]

    def run_chunk(ks, vs, start, tokens):
        """One chunk at `start` through every layer; writes its K/V. Returns hidden [Bp, C, H]."""
        positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1]), tokens.shape)

        def attend(i, q, k, v):
            ks[i] = jax.lax.dynamic_update_slice(ks[i], k.transpose(0, 2, 1, 3), (0, 0, start, 0))
            vs[i] = jax.lax.dynamic_update_slice(vs[i], v.transpose(0, 2, 1, 3), (0, 0, start, 0))
            if attention is None:
                return prefill_attention(q, ks[i], vs[i], start, prompt_lengths)
            return attention(i, q, ks[i], vs[i], start, prompt_lengths)

        return model.run_layers(model.embed(tokens), positions, attend)

    n_chunks = -(-plen // chunk)
    if n_chunks > 1 and plen % chunk == 0:
        def body(carry, start):
            ks_c, vs_c, last = list(carry[0]), list(carry[1]), carry[2]
            tokens = jax.lax.dynamic_slice_in_dim(prompt_tokens, start, chunk, axis=1)
            hidden = run_chunk(ks_c, vs_c, start, tokens)
            idx = prompt_lengths - 1 - start               # the last prompt token, if in here
            here = (idx >= 0) & (idx < chunk)
            h = jnp.take_along_axis(hidden, jnp.clip(idx, 0, chunk - 1)[:, None, None], axis=1)
            return (tuple(ks_c), tuple(vs_c), jnp.where(here[:, None], h[:, 0], last)), None

        last0 = jnp.zeros((bp, cfg.hidden_size), model.dtype)
        starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
        (ks, vs, last), _ = jax.lax.scan(body, (tuple(ks), tuple(vs), last0), starts)
        return list(ks), list(vs), model.logits(last)
    hiddens = [run_chunk(ks, vs, start, prompt_tokens[:, start:min(start + chunk, plen)])
               for start in range(0, plen, chunk)]
    hidden = jnp.concatenate(hiddens, axis=1)
    last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return ks, vs, model.logits(last)
