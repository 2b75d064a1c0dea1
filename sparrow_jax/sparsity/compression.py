"""KV-cache compression scores (R-KV, SnapKV) and the kept-slot choice, as pure jittable functions.

Sparse-RL's rollout bounds each sample's KV cache: every `compress_every` decode steps a row whose
cache holds more than `kv_budget` tokens keeps `kv_budget` of them - the `window` most recent
tokens always, the rest chosen by a per-token score - and evicts the others
(`sparrow_jax.rollout.compress` runs it inside the decode loop).

Scores of the candidate tokens (every live slot but the last `window`), per KV head:

* importance (SnapKV's observation window): the post-RoPE queries of the last `window` tokens
  attend to the candidate keys - logits q.k / sqrt(D), max-pooled over the GQA group's query
  heads, softmax over the candidates, mean over the window's queries - then max-pooled along the
  tokens with a kernel of 7 (same-size output, so a token near an important one scores high too).
* redundancy (R-KV): cosine similarity between the live keys (window included), diagonal zeroed;
  per row, the entry of the row's most recent near-duplicate (similarity > 0.5) is zeroed too,
  so the newest copy of a repeated key is not counted against it; the column mean over the rows
  is softmaxed over the live tokens. As in R-KV's reference code, a row without any
  near-duplicate zeroes its column-0 entry instead (its "last index" defaults to 0), which
  slightly favours keeping the first token.
* R-KV: `lam * importance - (1 - lam) * redundancy` (Sparse-RL: lam = 0.1); SnapKV: importance.

The kept set is shared by the layer's KV heads (scores summed over heads, as Sparse-RL's engine
does): the top `budget - window` candidates in slot order, then the window.

Conventions: a row's live tokens are slots [0, length); its window is [length - window, length);
scores are f32, and -inf outside the candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sparrow_jax.runtime.choices import Choice

__all__ = ["window_attention", "pool_tokens", "redundancy", "rkv_scores", "snapkv_scores",
           "scores", "kept_slots", "SCORERS", "CompressScorer"]


class CompressScorer(Choice):
    """How compress mode scores the cached tokens it keeps (`RolloutConfig.compress_scorer`)."""
    RKV = "rkv"            # R-KV: importance minus redundancy
    SNAPKV = "snapkv"      # SnapKV: the observation window's attention


SCORERS = CompressScorer.values()
DUPLICATE_THRESHOLD = 0.5
POOL_KERNEL = 7


def _candidates(lengths: jax.Array, window: int, s: int) -> jax.Array:
    """[B, S] bool: slot j is a candidate (live and outside the window)."""
    return jnp.arange(s)[None, :] < (lengths - window)[:, None]


def window_attention(q_win: jax.Array, keys: jax.Array, lengths: jax.Array, *,
                     window: int) -> jax.Array:
    """The observation window's attention over the candidates.

    q_win [B, w, Hq, D]: post-RoPE queries of the row's last w = `window` tokens (any order: the
    result is a mean over them); keys [B, Hkv, S, D] post-RoPE; lengths [B] live slots.
    Returns [B, Hkv, S] f32: per KV head and candidate slot, the mean over the w queries of the
    softmax over candidates of max over the GQA group of q.k / sqrt(D); 0 at other slots.
    """
    b, w, hq, d = q_win.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = q_win.astype(jnp.float32).reshape(b, w, hkv, hq // hkv, d)
    logits = jnp.einsum("bwkgd,bksd->bkgws", qg, keys.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * d ** -0.5
    logits = jnp.max(logits, axis=2)                                       # [B, Hkv, w, S]
    cand = _candidates(lengths, window, s)[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(cand, logits, -jnp.inf), axis=-1)
    return jnp.where(cand[:, :, 0], jnp.mean(jnp.where(cand, probs, 0.0), axis=2), 0.0)


def pool_tokens(x: jax.Array, lengths: jax.Array, *, window: int,
                kernel: int = POOL_KERNEL) -> jax.Array:
    """Max-pool [B, H, S] along the tokens (kernel `kernel`, stride 1, same size) over the
    candidates only (as a max-pool over the candidate sub-sequence); 0 at other slots.
    Inputs must be >= 0 (attention weights), so the masked slots never win a max."""
    cand = _candidates(lengths, window, x.shape[-1])[:, None, :]
    x = jnp.where(cand, x, 0.0)
    pad = kernel // 2
    pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, kernel), (1, 1, 1),
                               [(0, 0), (0, 0), (pad, kernel - 1 - pad)])
    return jnp.where(cand, pooled, 0.0)


def redundancy(keys: jax.Array, lengths: jax.Array, *, window: int,
               threshold: float = DUPLICATE_THRESHOLD, row_chunk: int = 64) -> jax.Array:
    """R-KV's redundancy of every candidate token. keys [B, Hkv, S, D], lengths [B] ->
    [B, Hkv, S] f32 (softmax over the live tokens of the column-mean cosine similarity, see the
    module docstring), 0 at non-candidate slots.

    The [S, S] similarity is built `row_chunk` rows at a time (a `lax.scan` accumulating the
    column sums), so only [B, Hkv, row_chunk, S] exists at once.
    """
    b, h, s, d = keys.shape
    k = keys.astype(jnp.float32)
    kn = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    live = jnp.arange(s)[None, :] < lengths[:, None]                       # [B, S]
    chunk = min(row_chunk, s)
    n = -(-s // chunk)
    rows_all = jnp.pad(kn, ((0, 0), (0, 0), (0, n * chunk - s), (0, 0)))
    cols = jnp.arange(s)

    def step(acc, i):
        rows = lax.dynamic_slice_in_dim(rows_all, i * chunk, chunk, axis=2)  # [B, H, c, D]
        row_idx = i * chunk + jnp.arange(chunk)                              # [c]
        sim = jnp.einsum("bhcd,bhsd->bhcs", rows, kn, precision=lax.Precision.HIGHEST)
        sim = jnp.where(row_idx[:, None] == cols[None, :], 0.0, sim)
        row_live = row_idx[None, :] < lengths[:, None]                       # [B, c]
        sim = jnp.where(row_live[:, None, :, None], sim, 0.0)
        dup = (sim > threshold) & live[:, None, None, :]
        last = jnp.max(jnp.where(dup, cols, 0), axis=-1)                     # [B, H, c]
        # Column sums without the zeroed entries: subtract each row's entry at `last`.
        at_last = jnp.take_along_axis(sim, last[..., None], axis=-1)[..., 0]  # [B, H, c]
        fix = jnp.zeros_like(acc).at[
            jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], last].add(at_last)
        return acc + jnp.sum(sim, axis=2) - fix, None

    col_sum, _ = lax.scan(step, jnp.zeros((b, h, s), jnp.float32), jnp.arange(n))
    col_mean = col_sum / jnp.maximum(lengths, 1)[:, None, None].astype(jnp.float32)
    red = jax.nn.softmax(jnp.where(live[:, None, :], col_mean, -jnp.inf), axis=-1)
    return jnp.where(_candidates(lengths, window, s)[:, None, :], red, 0.0)


def snapkv_scores(q_win: jax.Array, keys: jax.Array, lengths: jax.Array, *, window: int,
                  kernel: int = POOL_KERNEL) -> jax.Array:
    """SnapKV: pooled observation-window attention. Shapes as `window_attention`; [B, Hkv, S]
    f32, -inf at non-candidate slots."""
    imp = pool_tokens(window_attention(q_win, keys, lengths, window=window), lengths,
                      window=window, kernel=kernel)
    return jnp.where(_candidates(lengths, window, keys.shape[2])[:, None, :], imp, -jnp.inf)


def rkv_scores(q_win: jax.Array, keys: jax.Array, lengths: jax.Array, *, window: int,
               lam: float = 0.1, kernel: int = POOL_KERNEL,
               threshold: float = DUPLICATE_THRESHOLD) -> jax.Array:
    """R-KV: lam * importance - (1 - lam) * redundancy. Shapes as `window_attention`;
    [B, Hkv, S] f32, -inf at non-candidate slots."""
    imp = pool_tokens(window_attention(q_win, keys, lengths, window=window), lengths,
                      window=window, kernel=kernel)
    red = redundancy(keys, lengths, window=window, threshold=threshold)
    score = lam * imp - (1.0 - lam) * red
    return jnp.where(_candidates(lengths, window, keys.shape[2])[:, None, :], score, -jnp.inf)


def scores(scorer: str, q_win: jax.Array, keys: jax.Array, lengths: jax.Array, *, window: int,
           lam: float = 0.1) -> jax.Array:
    """`rkv_scores` or `snapkv_scores` by name ("rkv" | "snapkv")."""
    if scorer == CompressScorer.RKV:
        return rkv_scores(q_win, keys, lengths, window=window, lam=lam)
    if scorer == CompressScorer.SNAPKV:
        return snapkv_scores(q_win, keys, lengths, window=window)
    raise ValueError(f"compression scorer must be one of {SCORERS}, got {scorer!r}")


def kept_slots(head_scores: jax.Array, lengths: jax.Array, *, budget: int,
               window: int) -> jax.Array:
    """The slots a compression keeps: head_scores [B, Hkv, S] (-inf at non-candidates),
    lengths [B] -> [B, budget] int32 = the top `budget - window` candidates by the score summed
    over KV heads, ascending, then the window [length - window, length).

    Meaningful for rows with length >= budget (at least budget - window candidates); ties go to
    the lower slot (`lax.top_k`).
    """
    total = jnp.sum(head_scores, axis=1)                                   # [B, S]
    total = jnp.where(_candidates(lengths, window, total.shape[-1]), total, -jnp.inf)
    _, top = lax.top_k(total, budget - window)
    win = lengths[:, None] - window + jnp.arange(window)[None, :]
    return jnp.concatenate([jnp.sort(top, axis=-1), win], axis=-1).astype(jnp.int32)
