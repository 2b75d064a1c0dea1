"""What both engines' exact sparse mode shares (`RolloutConfig.mode = "exact_sparse"`).

One round per row: gamma sparse draft steps, one dense verify pass of the gamma + 1 tokens
[x_0, x_1..x_gamma], the speculative-sampling rule (rollout/speculative.py). The engines differ
only in where K/V live (exact.py: a cache row per sample; paged_exact.py: page pools), so the
pieces that do not touch the cache are here, once:
- `cascade_attention`: the verify pass's dense causal attention of the gamma + 1 queries, as the
  engine's dense decode kernel over the cached prefix merged with the attention among the new
  tokens;
- `draft_sample`: the draft's token and distribution at one step;
- `accept_round`: the rule applied to one round, and what the round records per token
  (`approximate_round`: a round of unverified drafts, the approximate bins of a mixed plan);
- `guide_scores`: the verify-guided drafts' block scores after a verify pass;
- `round_blocks`: the blocks a round can have filled (their centroids are recomputed from the
  dense keys the verify wrote: selection must score the policy's keys, not the draft's).
Random numbers are keyed per (sample, token index, purpose) (`speculative.token_keys`), so a
sample's tokens do not depend on its engine, slot, neighbours or preemption.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from sparrow_jax.rollout import fused, speculative
from sparrow_jax.rollout.config import DraftScorer, RolloutConfig
from sparrow_jax.rollout.sampling import first_argmax, sampling_logprobs, topk_logprobs


def cascade_attention(q: jax.Array, prefix: Callable, k_new: jax.Array, v_new: jax.Array
                      ) -> jax.Array:
    """Dense causal attention of C consecutive queries per row over a cached prefix and the C
    new tokens. q [B, C, Hq, D] at positions starts[b] + i; prefix(folded [B, Hkv*C*g, D]) ->
    (out [B, Hkv*C*g, D], lse [B, Hkv*C*g]): the engine's dense decode kernel over the keys
    < starts (the C queries folded into its query heads, so the prefix is read once for all of
    them; head h's KV head is h // (C g)); k/v_new [B, C, Hkv, D]. Query i sees the prefix and
    new tokens 0..i; the two parts merge by log-sum-exp. Returns [B, C, Hq, D]."""
    b, c, hq, d = q.shape
    hkv = k_new.shape[2]
    g = hq // hkv
    folded = q.reshape(b, c, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv * c * g, d)
    out_p, lse_p = prefix(folded)

    def unfold(x):
        return x.reshape(b, hkv, c, g, *x.shape[2:]).transpose(0, 2, 1, 3, *range(4, x.ndim + 2))
    lse_p = unfold(lse_p)                                                 # [B, C, Hkv, g]
    # An empty prefix (an idle paged slot) has lse -inf and an undefined output: weight 0.
    out_p = jnp.where(jnp.isfinite(lse_p)[..., None], unfold(out_p).astype(jnp.float32), 0.0)
    qg = q.reshape(b, c, hkv, g, d).astype(jnp.float32)
    s_loc = jnp.einsum("bikgd,bjkd->bikgj", qg, k_new.astype(jnp.float32)) * d ** -0.5
    causal = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]             # [C(q), C(k)]
    s_loc = jnp.where(causal[None, :, None, None, :], s_loc, -jnp.inf)
    lse_l = jax.nn.logsumexp(s_loc, axis=-1)
    out_l = jnp.einsum("bikgj,bjkd->bikgd", jnp.exp(s_loc - lse_l[..., None]),
                       v_new.astype(jnp.float32))
    lse = jnp.logaddexp(lse_p, lse_l)
    out = (jnp.exp(lse_p - lse)[..., None] * out_p + jnp.exp(lse_l - lse)[..., None] * out_l)
    return out.reshape(b, c, hq, d).astype(q.dtype)


def _gumbel_rows(keys: jax.Array, shape) -> jax.Array:
    return jax.vmap(lambda k: jax.random.gumbel(k, shape, jnp.float32))(keys)


def draft_sample(logits: jax.Array, *, rng: jax.Array, sample_ids: jax.Array,
                 index: jax.Array, cfg: RolloutConfig) -> tuple[jax.Array, jax.Array]:
    """One draft step: logits [B, V] of the sparse forward -> (token [B] int32, the draft's
    sampled log-probs q [B, V] f32). index [B]: the response index the token lands at.
    Greedy: the argmax (ties to the lowest id, as dense greedy)."""
    q_logp = sampling_logprobs(logits, temperature=cfg.temperature, top_k=cfg.top_k,
                               top_p=cfg.top_p)
    if cfg.temperature == 0:
        return first_argmax(logits.astype(jnp.float32)), q_logp
    keys = speculative.token_keys(rng, sample_ids, index, speculative.DRAFT)
    return first_argmax(q_logp + _gumbel_rows(keys, q_logp.shape[-1:])), q_logp


class Round(NamedTuple):
    """What one verify round gives a row; [B, G+1] per position j: response index
    generated + j; only j < n_new is kept."""
    tokens: jax.Array        # [B, G+1] int32: accepted drafts, then the verify's token, then pad
    logprobs: jax.Array      # [B, G+1] f32: the dense policy's sampled log-prob of each token
    topk_values: jax.Array   # [B, G+1, k] f32 (the dense policy's)
    topk_ids: jax.Array      # [B, G+1, k] int32
    accepted: jax.Array      # [B, G+1] bool: a draft token the verify accepted
    alpha: jax.Array         # [B, G+1] f32: sum min(p, q) at the position (NaN: no draft there)
    n_new: jax.Array         # [B] int32 tokens kept (0 for inactive rows)
    last: jax.Array          # [B] int32 the last kept token (fed next)
    stopped: jax.Array       # [B] bool: a stop token was kept


def accept_round(p_logits: jax.Array, q_logp: jax.Array, drafts: jax.Array, *,
                 rng: jax.Array, sample_ids: jax.Array, generated: jax.Array,
                 active: jax.Array, cfg: RolloutConfig, limit: jax.Array | None = None,
                 approximate: jax.Array | None = None) -> Round:
    """The speculative-sampling rule on one round. p_logits [B, G+1, V] of the verify pass (at
    x_0..x_G), q_logp [B, G, V] the draft's, drafts [B, G] (x_1..x_G); generated [B] tokens
    recorded before the round (x_1 lands at response index generated), active [B]; limit [B]
    (default G): the drafts a row offers (its bin's gamma, `RolloutConfig.gamma_by_bin`; 0: the
    round is one dense step). G = 0 is a dense step (the verify pass of x_0 alone). The round
    keeps the accepted drafts and one token sampled by the verify (correction or bonus), cut at
    the first stop token and at cfg.max_new_tokens. approximate [B] (default none): rows in an
    approximate bin (`RolloutConfig.approximate_from_bin`) keep their G drafts unverified, with
    the draft's log-probs (a dense step's verify token when G = 0)."""
    b, g = drafts.shape
    j = jnp.arange(g + 1)[None, :]
    idx = generated[:, None] + j                                              # [B, G+1]
    lim = jnp.full((b,), g, jnp.int32) if limit is None else jnp.minimum(limit, g)
    p_logp = sampling_logprobs(p_logits, temperature=cfg.temperature, top_k=cfg.top_k,
                               top_p=cfg.top_p)

    def keys(purpose, cols):
        return jax.vmap(lambda c: speculative.token_keys(rng, sample_ids, c, purpose),
                        in_axes=1, out_axes=1)(cols)
    if g == 0:          # no draft: the token at position 0 is sampled from p
        num = jnp.zeros((b,), jnp.int32)
        alpha = jnp.zeros((b, 0), jnp.float32)
        if cfg.temperature == 0:
            nxt = first_argmax(p_logits[:, 0].astype(jnp.float32))
        else:
            noise = _gumbel_rows(keys(speculative.CORRECT, idx)[:, 0], p_logp.shape[-1:])
            nxt = first_argmax(p_logp[:, 0] + noise)
    elif cfg.temperature == 0:
        num, nxt = speculative.greedy_accept(p_logits, drafts, lim)
        alpha = speculative.alpha(p_logp[:, :g], q_logp)
    else:
        uniforms = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, ())))(
            keys(speculative.ACCEPT, idx[:, :g]))
        gumbel = jax.vmap(lambda k: _gumbel_rows(k, p_logp.shape[-1:]))(
            keys(speculative.CORRECT, idx))
        num, nxt, alpha = speculative.speculative_accept(p_logp, q_logp, drafts, uniforms, gumbel,
                                                         limit=lim)
    # A position past the row's limit held no offered draft: no alpha there.
    alpha = jnp.where(j[:, :g] < lim[:, None], alpha, jnp.nan)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < num[:, None], padded,
                       jnp.where(j == num[:, None], nxt[:, None], cfg.pad_token_id))
    top = topk_logprobs(p_logits, cfg.record_topk, temperature=cfg.temperature)
    accepted = j < num[:, None]
    alpha = jnp.where(j <= num[:, None], jnp.concatenate(
        [alpha, jnp.full((b, 1), jnp.nan, jnp.float32)], axis=1), jnp.nan)
    kept = num + 1
    if approximate is not None and g > 0:     # the drafts, unverified: q's records
        tokens = jnp.where(approximate[:, None], jnp.where(j < g, padded, cfg.pad_token_id),
                           tokens)
        q_all = jnp.concatenate([q_logp, q_logp[:, -1:]], axis=1)           # [B, G+1, V]
        p_logp = jnp.where(approximate[:, None, None], q_all, p_logp)
        q_top = topk_logprobs(q_all, cfg.record_topk, temperature=1.0)     # q is scaled
        top = tuple(jnp.where(approximate[:, None, None], qt, pt) for qt, pt in zip(q_top, top))
        accepted = accepted & ~approximate[:, None]
        alpha = jnp.where(approximate[:, None], jnp.nan, alpha)
        kept = jnp.where(approximate, g, kept)
    return _kept(tokens, p_logp, top, accepted, alpha, kept, generated=generated, active=active,
                 cfg=cfg)


def approximate_round(q_logp: jax.Array, drafts: jax.Array, *, generated: jax.Array,
                      active: jax.Array, cfg: RolloutConfig) -> Round:
    """A round without a verify pass (every active row in an approximate bin,
    `RolloutConfig.approximate_from_bin`): each row keeps its G drafts, drafts [B, G] sampled
    from q_logp [B, G, V] (the draft's log-probs, recorded), cut at a stop and the length cap."""
    b, g = drafts.shape
    top = topk_logprobs(q_logp, cfg.record_topk, temperature=1.0)           # q is scaled
    return _kept(drafts, q_logp, top, jnp.zeros((b, g), bool),
                 jnp.full((b, g), jnp.nan, jnp.float32), jnp.full((b,), g, jnp.int32),
                 generated=generated, active=active, cfg=cfg)


def _kept(tokens, logp, top, accepted, alpha, kept, *, generated, active, cfg) -> Round:
    """The Round of tokens [B, W] whose first kept [B] are the row's, cut at the first stop
    token and at cfg.max_new_tokens; logp [B, W, V] the sampled distribution of each position
    (the recorded log-prob), top = (values, ids) [B, W, k]; accepted/alpha [B, W]."""
    w = tokens.shape[1]
    j = jnp.arange(w)[None, :]
    lp = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    stop_ids = jnp.asarray(cfg.stop_token_ids or (-1,), jnp.int32)
    stop = jnp.isin(tokens, stop_ids) & (j < kept[:, None])
    first_stop = jnp.min(jnp.where(stop, j, w), axis=1)
    n_new = jnp.minimum(jnp.minimum(kept, first_stop + 1), cfg.max_new_tokens - generated)
    n_new = jnp.where(active, n_new, 0).astype(jnp.int32)
    keep = j < n_new[:, None]
    last = jnp.take_along_axis(tokens, jnp.maximum(n_new - 1, 0)[:, None], axis=1)[:, 0]
    return Round(tokens=tokens, logprobs=lp, topk_values=top[0], topk_ids=top[1],
                 accepted=accepted, alpha=alpha, n_new=n_new, last=last,
                 stopped=jnp.any(stop & keep, axis=1))


# Verify-guided drafts (`RolloutConfig.draft_scorer = "verify"`): a block's score is the mass
# the last verify pass gave it plus this share of its score before (older passes' queries are
# further from the next drafts).
VERIFY_MASS_DECAY = 0.5


def verify_guided_layers(cfg: RolloutConfig, num_layers: int) -> tuple[int, ...]:
    """The layers whose drafts rank blocks by the verify passes' mass: the sparse ones, with
    `draft_scorer = "verify"`. Refused on the fused GPU decode (`fused.fewest_kernels`), whose
    layers get raw heads the guided attention cannot take yet."""
    layers = tuple(i for i in range(num_layers)
                   if cfg.sparse_layer(i) and cfg.draft_scorer == DraftScorer.VERIFY)
    if layers and fused.fewest_kernels(cfg.backend):
        raise ValueError("RolloutConfig.draft_scorer = 'verify' does not run on the fused GPU "
                         "decode (backend pallas_triton) yet; use draft_scorer = 'centroid'")
    return layers


def guide_scores(scores, masses, active: jax.Array) -> tuple[jax.Array, ...]:
    """The draft's block scores after a verify pass: per guided layer, scores [B, Hkv, NB]
    decayed by VERIFY_MASS_DECAY plus the pass's attention mass per block (masses, same
    shapes), in active [B] rows (others keep theirs)."""
    return tuple(jnp.where(active[:, None, None], VERIFY_MASS_DECAY * old + new, old)
                 for old, new in zip(scores, masses))


def round_blocks(starts: jax.Array, new_len: jax.Array, *, span: int, block_size: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The logical blocks a round over positions starts .. starts + span - 1 can touch, and
    whether each is full at new_len: starts/new_len [...] -> (blocks, full) [..., M]. A block
    not full keeps its centroid: selection never scores a block until it is full."""
    m = span // block_size + 2
    blk = starts[..., None] // block_size + jnp.arange(m)
    return blk, (blk + 1) * block_size <= new_len[..., None]


def run_one_branch(index: jax.Array, branches: list[Callable], carry):
    """branches[index](carry), each branch mapping carry to a value of its type - what
    `lax.switch` does, without its copies of the KV cache.

    A round updates the cache in place (the draft's and the verify's K/V writes). Inside a
    `lax.switch`, XLA copies every buffer a branch writes (each branch computation gets its
    own: 24 cache-sized copies in the tiny model's program of a 3-gamma plan, i.e. the whole KV
    cache copied per round, against none for a fixed gamma). A while loop aliases its carry, so
    here each branch is a loop that runs once when its index is picked and not at all
    otherwise (a scalar compare per branch, for one branch's work)."""
    which = jnp.asarray(index, jnp.int32)
    for i, branch in enumerate(branches):
        which, carry = jax.lax.while_loop(
            lambda c, i=i: c[0] == i,
            lambda c, branch=branch: (jnp.int32(-1), branch(c[1])), (which, carry))
    return carry
