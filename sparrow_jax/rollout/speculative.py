"""The speculative-sampling rule of exact sparse rollout, as pure functions on arrays.

A draft (block-sparse attention) proposes gamma tokens x_1..x_gamma, each sampled from its own
distribution q_j; one dense pass gives the policy's distributions p_0..p_gamma at the same
positions (p_j predicts the token after x_j's prefix). The rule (Leviathan et al. 2023,
Chen et al. 2023): accept x_j with probability min(1, p(x_j) / q(x_j)); at the first rejection
sample from norm(max(0, p - q)); if all gamma are accepted, sample one bonus token from
p_gamma. The tokens that come out are distributed exactly as sampling from p token by token,
and the probability of accepting a drafted token is alpha = sum_x min(p(x), q(x)) (sampled
decoding only: under greedy decoding acceptance is whether the two argmaxes agree).

All distributions here are the *sampled* ones (`sampling.sampling_logprobs`: temperature,
top-k, top-p), so the rule is exact for truncated sampling too. Greedy decoding (temperature 0)
has its own, noise-free rule (`greedy_accept`): a draft is accepted iff it is the dense argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparrow_jax.rollout.sampling import first_argmax

# Purposes of the random numbers of one token index (folded into its key after the index), so
# the draft's sample, the acceptance uniform and the correction sample are independent.
DRAFT, ACCEPT, CORRECT = 1, 2, 3


def accept_probability(p_x: jax.Array, q_x: jax.Array) -> jax.Array:
    """min(1, p(x) / q(x)) for a token x drawn from q (q(x) > 0). Its own function so that the
    statistical test can plant the classic bug (min(1, q/p)) and show that the test catches it."""
    return jnp.minimum(1.0, p_x / jnp.maximum(q_x, 1e-30))


def alpha(p_logp: jax.Array, q_logp: jax.Array) -> jax.Array:
    """[..., V] log-probs of p and q -> [...] sum_x min(p(x), q(x)) (the acceptance rate)."""
    return jnp.sum(jnp.minimum(jnp.exp(p_logp), jnp.exp(q_logp)), axis=-1)


def speculative_accept(p_logp: jax.Array, q_logp: jax.Array, drafts: jax.Array,
                       uniforms: jax.Array, gumbel: jax.Array, limit: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One verify pass of the speculative-sampling rule, per row.

    p_logp [B, G+1, V] f32 the policy's sampled log-probs at the G drafted positions and the
    bonus position; q_logp [B, G, V] the draft's; drafts [B, G] int32 (x_j ~ q_j);
    uniforms [B, G] in [0, 1) (acceptance); gumbel [B, G+1, V] standard Gumbel noise per
    position (only the first non-accepted position's is used: the one token sampled there).
    Returns (num_accepted [B] int32 in [0, G], next_token [B] int32: the correction from
    norm(max(0, p - q)) at position num_accepted, or the bonus from p_G if all were accepted,
    alpha [B, G] f32 per drafted position).
    limit [B] int32 in [0, G] (default G): row b offers only its first limit[b] drafts (a
    round of gamma = limit[b]): if all of those are accepted, the token at position limit[b]
    is the bonus from p there (the drafts past it are never offered), so a row's tokens are
    exact whatever its limit.
    """
    g = drafts.shape[1]
    p_x = jnp.exp(jnp.take_along_axis(p_logp[:, :g], drafts[..., None], axis=-1)[..., 0])
    q_x = jnp.exp(jnp.take_along_axis(q_logp, drafts[..., None], axis=-1)[..., 0])
    ok = uniforms < accept_probability(p_x, q_x)                                  # [B, G]
    num = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    limit = jnp.full_like(num, g) if limit is None else limit.astype(jnp.int32)
    num = jnp.minimum(num, limit)
    p_at = jnp.take_along_axis(p_logp, num[:, None, None], axis=1)[:, 0]           # [B, V]
    # Past the last offered draft there is no q: the residual max(0, p - 0) is p (the bonus).
    q_at = jnp.take_along_axis(q_logp, jnp.minimum(num, g - 1)[:, None, None], axis=1)[:, 0]
    q_prob = jnp.where((num < limit)[:, None], jnp.exp(q_at), 0.0)
    residual = jnp.maximum(jnp.exp(p_at) - q_prob, 0.0)
    # A rejection implies p(x) < q(x) somewhere, hence mass where p > q; if rounding leaves
    # none (p == q to f32), p itself is the right distribution.
    has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
    log_r = jnp.where(has_mass, jnp.log(residual), p_at)
    noise = jnp.take_along_axis(gumbel, num[:, None, None], axis=1)[:, 0]
    next_token = first_argmax(log_r + noise)
    return num, next_token, alpha(p_logp[:, :g], q_logp)


def greedy_accept(p_logits: jax.Array, drafts: jax.Array, limit: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Greedy verify: p_logits [B, G+1, V], drafts [B, G] (the draft's argmaxes) ->
    (num_accepted [B]: drafts before the first that is not the dense argmax, at most limit [B]
    (default G: as `speculative_accept`), next_token [B]: the dense argmax at that position).
    Ties resolve to the lowest id, as dense greedy."""
    b, g1, v = p_logits.shape
    best = first_argmax(p_logits.reshape(b * g1, v).astype(jnp.float32)).reshape(b, g1)
    ok = drafts == best[:, :-1]
    num = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    if limit is not None:
        num = jnp.minimum(num, limit)
    return num, jnp.take_along_axis(best, num[:, None], axis=1)[:, 0]


def expected_tokens_per_pass(a: jax.Array | float, gamma: int) -> jax.Array:
    """(1 - a^(gamma+1)) / (1 - a): tokens gained per verify pass at a constant acceptance
    rate a (gamma + 1 at a = 1)."""
    a = jnp.asarray(a, jnp.float32)
    safe = jnp.where(a < 1.0, a, 0.5)
    return jnp.where(a < 1.0, (1.0 - safe ** (gamma + 1)) / (1.0 - safe), gamma + 1.0)


def token_keys(rng: jax.Array, sample_ids: jax.Array, index: jax.Array, purpose: int
               ) -> jax.Array:
    """[R] keys fold_in(fold_in(fold_in(rng, sample), index), purpose): a token index's random
    numbers depend on the sample and the index only. A key is reused when a later round drafts
    the same index again, but then the prefix differs (a rejection happened before it), and a
    token sampled under a prefix that is later discarded never reaches the output."""
    return jax.vmap(lambda s, i: jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(rng, s), i), purpose))(sample_ids, index)
