"""Block top-k selection for sparse decode (docs/method.md), in plain jit-friendly JAX.

The KV cache is split into blocks of ``block_size`` (16) tokens. Each full block has a centroid
(mean of its post-RoPE keys, accumulated in f32, stored in the cache dtype). Per KV head, a block's
score is the mean of the GQA group's query heads dotted with the centroid (the centroids and
scores: ``sparrow_jax.sparsity.block_scores``). We always keep block 0
(attention sink) and the last two blocks (local window incl. the partial current block), and fill
the rest of the budget with the top-scoring full blocks in between. If the sequence has no more
blocks than the budget, every block is selected (exactly dense).

Outputs feed ``pallas_kernels.block_sparse_decode``: indices ascending, valid entries first,
padding repeats the last valid id (so kernels re-read nothing for padding).

Selection is sort-free and linear in the number of blocks (a radix select of the k-th score and
bit-packed prefix counts; no sort, no top-k, no scatter), with exactly the ids of the former
`lax.top_k` + sort, which stays as `select_from_scores_reference` for tests and benchmarks.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import dispatch, pallas_triton_select
from pallas_kernels.reference import SelectedPages, physical_pages
from sparrow_jax.sparsity.block_scores import centroid_scores, quest_scores

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()

__all__ = ["select_from_scores", "select_blocks", "select_pages", "selected_blocks",
           "selected_keys", "order_key", "kth_largest_key", "prefix_count", "compact_ids",
           "select_from_scores_reference"]

# Blocks always kept in the sparse regime: the sink (block 0) and the two most recent blocks.
NUM_RESERVED = 3
# Bits per radix-select pass (kth_largest_key) by platform: 32 / bits passes over the row, each
# counting 2**bits - 1 thresholds. Accelerators are bound by the passes (each re-reads the row's
# keys: H100 compile of 512 rows x 2176 blocks, XLA's count: 169 / 102 / 67 MB at 1 / 2 / 4 bits);
# XLA:CPU by the compares (one count per pass is fastest there, bench/kernels.py --selection).
RADIX_BITS = {"cpu": 1, "gpu": 4, "tpu": 4}
# The one-kernel GPU selection's digits per pass (pallas_kernels.pallas_triton_select): one bit was the
# fastest on an H200 (0.019 ms vs 0.028 / 0.039 for 2 / 4 bits, 2026-11-28, docs/devices/).
TRITON_RADIX_BITS = 1


def _min_if_concrete(x: jax.Array) -> int | None:
    """min(x) when x is a concrete array, None under tracing (jit/vmap)."""
    try:
        return int(jnp.min(x)) if x.size else None
    except jax.errors.ConcretizationTypeError:
        return None


def order_key(x: jax.Array) -> jax.Array:
    """[...] f32 -> [...] uint32 whose unsigned order is IEEE total order on the floats
    (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN): the order `lax.top_k` ranks by on XLA:CPU,
    so ranking by this key reproduces it bit for bit, ties included."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _radix_bits(radix_bits: int | None) -> int:
    """radix_bits, or the platform's default (the dryrun's target platform when compiling for
    one: pallas_kernels.dispatch.current_platform)."""
    return radix_bits or RADIX_BITS.get(dispatch.current_platform(), 4)


def kth_largest_key(key: jax.Array, valid: jax.Array, k: jax.Array, *,
                    radix_bits: int | None = None) -> jax.Array:
    """The k-th largest of the valid keys per row, by radix select: key [..., NB] uint32,
    valid [..., NB] bool, k [...] int32 -> [...] uint32.

    Builds the answer from the top digit down: at each digit, the largest digit value whose
    probe (prefix | digit) still has >= k valid keys at or above it. 32 / radix_bits passes of
    (2**radix_bits - 1) counts over the row: linear in NB, no sort, no top-k. k <= 0 gives
    0xFFFFFFFF; k > (number of valid keys) gives 0 (callers only read rows with 1 <= k <= valid).
    """
    radix_bits = _radix_bits(radix_bits)
    if 32 % radix_bits:
        raise ValueError(f"radix_bits must divide 32, got {radix_bits}")
    digits = jnp.arange(1, 1 << radix_bits, dtype=jnp.uint32)                 # [V]
    kth = jnp.zeros(k.shape, jnp.uint32)
    # A Python loop, not fori_loop: XLA:GPU reads a while loop's predicate back to the host
    # every iteration (one round trip per pass, per sparse layer and decode step).
    for shift in range(32 - radix_bits, -1, -radix_bits):
        probe = kth[..., None] | (digits << shift)                                # [..., V]
        at_least = valid[..., None, :] & (key[..., None, :] >= probe[..., None])  # [..., V, NB]
        counts = jnp.sum(at_least, axis=-1, dtype=jnp.int32)                      # [..., V]
        digit = jnp.sum(counts >= k[..., None], axis=-1, dtype=jnp.uint32)       # monotone in V
        kth = kth | (digit << shift)
    return kth


def _bit_words(mask: jax.Array) -> jax.Array:
    """[..., N] bool -> [..., ceil(N/32)] uint32, bit t of word w = mask[32 w + t]."""
    n = mask.shape[-1]
    w = -(-n // 32)
    pad = [(0, 0)] * (mask.ndim - 1) + [(0, 32 * w - n)]
    bits = jnp.pad(mask, pad).reshape(mask.shape[:-1] + (w, 32)).astype(jnp.uint32)
    # Distinct bits: their sum is their OR.
    return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def _popcount(x: jax.Array) -> jax.Array:
    return lax.population_count(x).astype(jnp.int32)


def prefix_count(mask: jax.Array) -> jax.Array:
    """Inclusive prefix count of a bool mask along the last axis, [..., N] -> [..., N] int32.

    Bit-packed: a prefix sum over the N/32 words' popcounts (small), then each element adds the
    popcount of its word's bits up to itself. Elementwise apart from the small scan: on TPU,
    jnp.cumsum over N is a reduce-window and a scatter / gather by position costs far more."""
    n = mask.shape[-1]
    words = _bit_words(mask)                                                    # [..., W]
    counts = _popcount(words)
    before = jnp.cumsum(counts, axis=-1) - counts                              # [..., W]
    w = words.shape[-1]
    t = jnp.arange(32, dtype=jnp.uint32)
    upto = (jnp.uint32(2) << t) - 1                       # bits 0..t (t = 31: 0 - 1 = all ones)
    within = _popcount(words[..., None] & upto)                                 # [..., W, 32]
    out = (before[..., None] + within).reshape(mask.shape[:-1] + (w * 32,))
    return out[..., :n]


def compact_ids(keep: jax.Array, num: jax.Array, fill: jax.Array, width: int) -> jax.Array:
    """The indices of the set entries of keep [R, N] in ascending order, padded with fill [R]
    after the first num [R] (num <= the set count): [R, width] int32. No scatter, no sort.

    Slot j holds the (j+1)-th set bit: its 32-bit word is the number of words whose inclusive
    popcount ends at or before j (a compare over the N/32 words), its place in the word a 5-step
    bisection on popcounts of the word's low bits. Every step is elementwise or a reduction over
    the N/32 words, so it costs the same on every backend (a scatter by position is cheap on
    GPU, but on TPU XLA counts 19 GB for one layer of 1024 rows x 2176 blocks)."""
    words = _bit_words(keep)                                                    # [R, W]
    nw = words.shape[-1]
    counts = _popcount(words)
    ends = jnp.cumsum(counts, axis=-1)                                          # [R, W]
    slot = jnp.arange(width, dtype=jnp.int32)
    which = jnp.sum(ends[:, None, :] <= slot[:, None], axis=-1, dtype=jnp.int32)   # [R, K]
    hit = which[..., None] == jnp.arange(nw, dtype=jnp.int32)                   # [R, K, W]
    word = jnp.sum(jnp.where(hit, words[:, None, :], 0), axis=-1, dtype=jnp.uint32)
    rank = slot - jnp.sum(jnp.where(hit, (ends - counts)[:, None, :], 0), axis=-1)
    # The largest p with popcount(word below bit p) <= rank is the (rank+1)-th set bit.
    pos = jnp.zeros_like(rank)
    for step in (16, 8, 4, 2, 1):
        below = word & ((jnp.uint32(1) << (pos + step).astype(jnp.uint32)) - 1)
        pos = jnp.where(_popcount(below) <= rank, pos + step, pos)
    return jnp.where(slot < num[:, None], 32 * which + pos, fill[:, None]).astype(jnp.int32)


def _budget_and_total(scores: jax.Array, lengths: jax.Array, budget_blocks: jax.Array, *,
                      max_selected: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Validated inputs of both selection rules: (budget [...] int32 clamped to
    [3, max_selected], total [...] int32 blocks in the row, at most NB)."""
    if max_selected < NUM_RESERVED:
        raise ValueError(f"max_selected must be >= {NUM_RESERVED}, got {max_selected}")
    nb = scores.shape[-1]
    lead = scores.shape[:-1]
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), lead)
    budget_in = jnp.broadcast_to(jnp.asarray(budget_blocks, jnp.int32), lead)
    smallest = _min_if_concrete(budget_in)
    if smallest is not None and smallest < NUM_RESERVED:
        raise ValueError(f"budget_blocks must be >= {NUM_RESERVED} (sink + 2 local blocks), "
                         f"got min {smallest}")
    budget = jnp.clip(budget_in, NUM_RESERVED, max_selected)
    total = jnp.clip((lengths + block_size - 1) // block_size, 0, nb)
    return budget, total


def _kept_blocks(scores: jax.Array, lengths: jax.Array, budget_blocks: jax.Array, *,
                 max_selected: int, block_size: int, radix_bits: int | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The selected set as a mask: scores [..., NB] -> (keep [..., NB] bool, num [...] int32,
    total [...] int32 blocks in the row). See `select_from_scores` for the rule."""
    nb = scores.shape[-1]
    budget, total = _budget_and_total(scores, lengths, budget_blocks, max_selected=max_selected,
                                      block_size=block_size)
    blk = jnp.arange(nb, dtype=jnp.int32)
    last = total[..., None]
    dense = total <= budget
    # Sparse regime (total > budget >= 3, so the 3 reserved blocks are distinct and there are
    # total - 3 >= budget - 2 candidates for the budget - 3 top slots).
    cand = (blk >= 1) & (blk <= last - 3)                                      # [..., NB]
    k_top = budget - NUM_RESERVED
    key = order_key(scores)
    kth = kth_largest_key(key, cand, k_top, radix_bits=radix_bits)
    above = cand & (key > kth[..., None])
    # Ties at the k-th key: the lowest indices fill the remaining slots (as lax.top_k).
    tied = cand & (key == kth[..., None])
    room = k_top - jnp.sum(above, axis=-1, dtype=jnp.int32)
    tie_rank = prefix_count(tied)                                              # 1-based
    top = above | (tied & (tie_rank <= room[..., None]))
    reserved = (blk == 0) | (blk >= last - 2)
    keep = jnp.where(dense[..., None], blk < last, top | (reserved & (blk < last)))
    num = jnp.where(dense, total, budget)
    return keep, num.astype(jnp.int32), total


def selection_backend(backend: str, *, interpret: bool = False) -> str:
    """Where block selection runs for a decode kernel backend: "pallas_triton" (one fused
    kernel, `pallas_kernels.pallas_triton_select`) when the attention runs on Pallas Triton, else "xla"
    (the sort-free form below). Logged once per choice."""
    if backend == "xla" and not interpret:
        return "xla"
    chosen = dispatch.resolve_backend(backend, interpret=interpret)
    chosen = "pallas_triton" if chosen == "pallas_triton" else "xla"
    if (backend, chosen) not in _logged:
        _logged.add((backend, chosen))
        log.info("block selection: %s (kernel backend %r)", "one Pallas Triton kernel"
                 if chosen == "pallas_triton" else "XLA, sort-free", backend)
    return chosen


def select_from_scores(scores: jax.Array, lengths: jax.Array, budget_blocks: jax.Array, *,
                       max_selected: int, block_size: int = 16,
                       radix_bits: int | None = None, backend: str = "xla",
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Chooses the blocks to attend from per-block scores.

    Args:
      scores: [..., NB] f32 block scores (only full middle blocks' scores are used).
      lengths: [...] int32 tokens in the cache INCLUDING the current token.
      budget_blocks: [...] int32 blocks allowed (>= 3; clamped to [3, max_selected]; under jit a
        value < 3 cannot be rejected and is clamped to 3).
      max_selected: static K of the output (the largest budget in blocks).
      block_size: tokens per block.
      radix_bits: bits per radix-select pass (1, 2, 4 or 8; None: the platform's RADIX_BITS);
        the result does not depend on it.
      backend: the decode kernel backend ("xla" default; "auto" and "pallas_triton" select
        with one Pallas Triton kernel where attention runs on it, `selection_backend`);
        interpret: Pallas interpret mode (CPU tests). Same ids on every path.

    Returns:
      block_indices [..., max_selected] int32 ascending, valid first, padding repeats the last
      valid id; num_blocks [...] int32. With total = ceil(length / bs): if total <= budget, all
      blocks 0..total-1; else block 0, blocks total-2 and total-1, and the top (budget - 3)
      blocks among 1..total-3 by score (ties: lowest index wins; scores ranked in IEEE total
      order, as lax.top_k on CPU).

    Cost linear in NB, no sort and no top-k (a large-k top-k is a full sort on GPU): a radix
    select finds the (budget - 3)-th largest score, a mask keeps the blocks above it plus the
    lowest-index ties (a bit-packed prefix count), and `compact_ids` lists the kept ids in
    ascending order (bit-packed: no scatter, no gather).
    Identical output to `select_from_scores_reference` (the former top_k + sort) whenever the
    candidate scores are above -inf (a -inf or -NaN candidate made that one pick masked blocks).
    """
    nb = scores.shape[-1]
    lead = scores.shape[:-1]
    rows = math.prod(lead)
    if selection_backend(backend, interpret=interpret) == "pallas_triton":
        budget, total = _budget_and_total(scores, lengths, budget_blocks,
                                          max_selected=max_selected, block_size=block_size)
        ids, num = pallas_triton_select.select_ids_triton(
            scores.reshape(rows, nb), total.reshape(rows), budget.reshape(rows),
            width=max_selected, radix_bits=radix_bits or TRITON_RADIX_BITS, interpret=interpret)
        return ids.reshape(lead + (max_selected,)), num.reshape(lead)
    keep, num, total = _kept_blocks(scores, lengths, budget_blocks, max_selected=max_selected,
                                    block_size=block_size, radix_bits=radix_bits)
    # Padding repeats the last valid id, which is total - 1 in both regimes (0 for empty rows).
    fill = jnp.maximum(total - 1, 0).reshape(rows)
    ids = compact_ids(keep.reshape(rows, nb), num.reshape(rows), fill, max_selected)
    return ids.reshape(lead + (max_selected,)), num


def select_from_scores_reference(scores: jax.Array, lengths: jax.Array,
                                 budget_blocks: jax.Array, *, max_selected: int,
                                 block_size: int = 16) -> tuple[jax.Array, jax.Array]:
    """The former `select_from_scores` (lax.top_k over all blocks + a sort of the ids): the
    reference the tests and `sparrow_jax.bench.kernels --selection` compare against. Not for
    rollout use: on GPU its large-k top-k and its sort are full sorts."""
    nb = scores.shape[-1]
    budget, total = _budget_and_total(scores, lengths, budget_blocks, max_selected=max_selected,
                                      block_size=block_size)
    slots = jnp.arange(max_selected, dtype=jnp.int32)

    # Dense regime: 0..total-1, padded with total-1 (or 0 for an empty row).
    dense_ids = jnp.minimum(slots, jnp.maximum(total - 1, 0)[..., None])

    # Sparse regime: sink + top-(budget-3) middle blocks + the last two blocks.
    k_top = min(max_selected - NUM_RESERVED, nb)
    blk = jnp.arange(nb, dtype=jnp.int32)
    cand = (blk >= 1) & (blk <= (total - 3)[..., None])                    # [..., NB]
    masked = jnp.where(cand, scores.astype(jnp.float32), -jnp.inf)
    big = jnp.int32(nb + max_selected)                                       # sorts last
    if k_top > 0:
        _, top_ids = lax.top_k(masked, k_top)            # score-descending, lowest index on ties
        rank = jnp.arange(k_top, dtype=jnp.int32)
        top_ids = jnp.where(rank < (budget - NUM_RESERVED)[..., None], top_ids.astype(jnp.int32),
                            big)
    else:
        top_ids = jnp.zeros(scores.shape[:-1] + (0,), jnp.int32)
    reserved = jnp.stack([jnp.zeros_like(total), total - 2, total - 1], axis=-1)
    parts = [reserved, top_ids]
    pad = max_selected - NUM_RESERVED - k_top
    if pad > 0:
        parts.append(jnp.full(scores.shape[:-1] + (pad,), big, jnp.int32))
    sparse_ids = jnp.sort(jnp.concatenate(parts, axis=-1), axis=-1)         # valid ones first
    last_valid = jnp.take_along_axis(sparse_ids, (budget - 1)[..., None], axis=-1)
    sparse_ids = jnp.where(slots < budget[..., None], sparse_ids, last_valid)

    is_dense = (total <= budget)[..., None]
    block_indices = jnp.where(is_dense, dense_ids, sparse_ids)
    num_blocks = jnp.where(total <= budget, total, budget)
    return block_indices.astype(jnp.int32), num_blocks.astype(jnp.int32)


def select_blocks(q: jax.Array, centroids: jax.Array, lengths: jax.Array,
                  budget_blocks: jax.Array, *, max_selected: int, block_size: int = 16,
                  scorer: str = "centroid", key_min: jax.Array | None = None,
                  key_max: jax.Array | None = None, backend: str = "xla"
                  ) -> tuple[jax.Array, jax.Array]:
    """Scores + selection for one decode step.

    q [B, Hq, D], centroids [B, Hkv, NB, D], lengths [B], budget_blocks [B] (or scalar) ->
    block_indices [B, Hkv, max_selected] int32, num_blocks [B, Hkv] int32.
    scorer: "centroid" (the paper's rule) or "quest" (needs key_min/key_max from block_minmax).
    backend: the decode kernel backend (the rollout passes RolloutConfig.backend): where it is
    Pallas Triton, the selection is one kernel too (`selection_backend`).
    """
    if scorer == "centroid":
        scores = centroid_scores(q, centroids)
    elif scorer == "quest":
        if key_min is None or key_max is None:
            raise ValueError("scorer='quest' needs key_min and key_max (see block_minmax)")
        scores = quest_scores(q, key_min, key_max)
    else:
        raise ValueError(f"unknown scorer {scorer!r}; expected 'centroid' or 'quest'")
    b, hkv = scores.shape[:2]
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32)[..., None], (b, hkv))
    budget = jnp.asarray(budget_blocks, jnp.int32)
    budget = jnp.broadcast_to(budget[:, None] if budget.ndim == 1 else budget, (b, hkv))
    return select_from_scores(scores, lengths, budget, max_selected=max_selected,
                              block_size=block_size, backend=backend)


def select_pages(q: jax.Array, centroid_pool: jax.Array, page_table: jax.Array,
                 lengths: jax.Array, budget_blocks: jax.Array, *, max_selected: int,
                 block_size: int = 16, backend: str = "xla", interpret: bool = False
                 ) -> SelectedPages:
    """`select_blocks` on a paged cache, up to the pages the attention reads: q [B, Hq, D],
    centroid_pool [G, Hkv, N, D] (row b's centroids in pool b // (B // G), at its pages),
    page_table [B, P], lengths [B], budget_blocks [B] -> SelectedPages [B, Hkv, max_selected]
    (the kernels' own form: `pallas_kernels.paged_covered_decode`).

    Where selection runs on Pallas Triton (`selection_backend`) this is one kernel
    (`pallas_triton_select.select_pages_triton`: it reads each row's centroids through its page
    table, scores, selects and looks the pages up); elsewhere the XLA form: the centroids
    gathered [B, Hkv, P, D], `select_blocks`, `physical_pages`. The same ids wherever the
    scores are equal (the kernel sums each score's D products in its own order)."""
    if selection_backend(backend, interpret=interpret) == "pallas_triton":
        budget = jnp.broadcast_to(jnp.asarray(budget_blocks, jnp.int32), lengths.shape)
        return pallas_triton_select.select_pages_triton(
            q, centroid_pool, page_table, lengths, budget, width=max_selected,
            block_size=block_size, radix_bits=TRITON_RADIX_BITS, interpret=interpret)[0]
    b, n_pages = q.shape[0], centroid_pool.shape[2]
    pool = jnp.arange(b) // (b // centroid_pool.shape[0])
    cents = centroid_pool[pool[:, None], :, jnp.clip(page_table, 0, n_pages - 1)]  # [B, P, Hkv, D]
    idx, num = select_blocks(q, cents.swapaxes(1, 2), lengths, budget_blocks,
                             max_selected=max_selected, block_size=block_size)
    return SelectedPages(physical_pages(page_table, idx), idx, num)


def selected_blocks(scores: jax.Array, positions: jax.Array, budget_blocks: jax.Array, *,
                    max_selected: int, block_size: int = 16) -> jax.Array:
    """The blocks decode-time selection lets each query see, for a whole-sequence
    (teacher-forced) replay: scores [B, C, Hkv, NB] (over whole blocks), positions [B, C] of the
    queries, budget_blocks [B, C] -> [B, C, Hkv, NB] bool (causality not applied: a query at
    position p decoded with length p + 1, so its selection never picks a later block)."""
    b, c, hkv, nb = scores.shape
    lengths = jnp.broadcast_to((positions + 1)[..., None], (b, c, hkv))
    budget = jnp.broadcast_to(budget_blocks[..., None], (b, c, hkv)).astype(jnp.int32)
    # The selected set as a mask directly: the same blocks as select_from_scores' ids, without
    # compacting them (rows here are never empty: lengths >= 1).
    chosen, _, _ = _kept_blocks(scores, lengths, budget, max_selected=max_selected,
                                block_size=block_size)
    return chosen


def selected_keys(scores: jax.Array, positions: jax.Array, budget_blocks: jax.Array, *,
                  max_selected: int, block_size: int = 16) -> jax.Array:
    """`selected_blocks` per key: [B, C, Hkv, NB * block_size] bool."""
    return jnp.repeat(selected_blocks(scores, positions, budget_blocks,
                                      max_selected=max_selected, block_size=block_size),
                      block_size, axis=-1)
