"""Token sampling with temperature / top-k / top-p, and the log-probabilities recorded per token."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -jnp.inf


def sampling_logprobs(logits: jax.Array, *, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> jax.Array:
    """logits [B, V] -> log-probs [B, V] of the distribution actually sampled from.

    Temperature first, then top-k and top-p truncation, renormalised; truncated tokens get -inf.
    temperature == 0 means greedy: the returned log-probs are those of temperature 1 (untruncated),
    which is what the learner compares against.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, _NEG, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, _NEG, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def sample(rng: jax.Array, logits: jax.Array, *, temperature: float, top_k: int = 0,
           top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> (tokens [B] int32, logprob of each sampled token [B] f32)."""
    logp = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        tokens = jax.random.categorical(rng, logp, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def topk_logprobs(logits: jax.Array, k: int, *, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Top-k of the temperature-scaled, untruncated distribution: ([B, k] logprobs, [B, k] ids).

    Untruncated so that the paper's top-k mismatch estimator compares like with like.
    """
    scaled = logits.astype(jnp.float32) / (temperature if temperature > 0 else 1.0)
    values, ids = jax.lax.top_k(jax.nn.log_softmax(scaled, axis=-1), k)
    return values, ids.astype(jnp.int32)
