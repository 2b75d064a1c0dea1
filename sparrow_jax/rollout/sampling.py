"""Token sampling with temperature / top-k / top-p, and the log-probabilities recorded per token.

`SamplingParams` is the one description of the sampling distribution: the rollout samples from
it and records its log-probabilities, and the learner computes the dense policy's log-probs
(PPO ratio, TIS weight) and the acceptance rate alpha under the *same* temperature and
truncation (`sampling_logprobs`), so the two sides can never disagree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Temperature (0 = greedy), top-k (0 = off) and top-p (1 = off) of the sampled policy."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling settings temperature={self.temperature} "
                             f"top_k={self.top_k} top_p={self.top_p}")

    def logprobs(self, logits: jax.Array) -> jax.Array:
        """`sampling_logprobs` under these settings: logits [..., V] -> log-probs [..., V]."""
        return sampling_logprobs(logits, temperature=self.temperature, top_k=self.top_k,
                                 top_p=self.top_p)


def sampling_logprobs(logits: jax.Array, *, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> jax.Array:
    """logits [..., V] -> log-probs [..., V] of the distribution actually sampled from.

    Temperature first, then top-k and top-p truncation, renormalised; truncated tokens get -inf.
    temperature == 0 means greedy: the returned log-probs are those of temperature 1 (untruncated),
    which is what the learner compares against. The truncated set is a function of the logits
    (not differentiated through): the learner's policy is this renormalised distribution.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.stop_gradient(jax.lax.top_k(logits, top_k)[0][..., -1:])
        logits = jnp.where(logits < kth, _NEG, logits)
    if top_p < 1.0:
        sorted_logits = jax.lax.stop_gradient(jnp.sort(logits, axis=-1)[..., ::-1])
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, _NEG, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """x [B, V] f32 -> [B] int32: index of the first maximum (as jnp.argmax).

    A max and a min-of-indices instead of argmax's (value, index) pair reduction, which XLA:CPU
    runs ~5x slower at [16, 4096] (0.6 ms per decode step). A row of NaNs gives V - 1.
    """
    best = jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(x == best, idx, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def sample(rng: jax.Array, logits: jax.Array, *, temperature: float, top_k: int = 0,
           top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> (tokens [B] int32, logprob of each sampled token [B] f32)."""
    logp = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        tokens = first_argmax(logits.astype(jnp.float32))
    else:
        # Gumbel-max, exactly what jax.random.categorical(rng, logp) computes (same noise, same
        # token), with first_argmax for the argmax.
        tokens = first_argmax(logp + jax.random.gumbel(rng, logp.shape, jnp.float32))
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def sample_rows(rng: jax.Array, logits: jax.Array, sample_ids: jax.Array, index: jax.Array, *,
                temperature: float, top_k: int = 0, top_p: float = 1.0
                ) -> tuple[jax.Array, jax.Array]:
    """Like `sample`, with row r's noise from key fold_in(fold_in(rng, sample_ids[r]), index[r]):
    a sample's tokens depend only on (rng, its id, its token index), not on its row in a batch,
    its neighbours or when it ran (both rollout engines use it; the paged one moves samples
    between slots and recomputes preempted ones). logits [R, V], ids/index [R] -> [R], [R]."""
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(rng, s), i))(
        sample_ids, index)
    tok, lp = jax.vmap(lambda key, row: sample(key, row[None], temperature=temperature,
                                               top_k=top_k, top_p=top_p))(keys, logits)
    return tok[:, 0], lp[:, 0]


def topk_logprobs(logits: jax.Array, k: int, *, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Top-k of the temperature-scaled, untruncated distribution: ([B, k] logprobs, [B, k] ids).

    Untruncated so that the paper's top-k mismatch estimator compares like with like. k = 0
    (nothing reads the record, see `RolloutConfig.for_alpha_mode`): [B, 0] arrays and no work.
    """
    if k == 0:
        lead = logits.shape[:-1] + (0,)
        return jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.int32)
    scaled = logits.astype(jnp.float32) / (temperature if temperature > 0 else 1.0)
    values, ids = jax.lax.top_k(jax.nn.log_softmax(scaled, axis=-1), k)
    return values, ids.astype(jnp.int32)
