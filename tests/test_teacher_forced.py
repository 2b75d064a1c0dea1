"""The teacher-forced sparse replay's visibility mask (`rollout.teacher_forced.sparse_attention_fn`):
built per selection block, it equals the former per-key construction bit for bit, for the key
layouts `map_causal_query_chunks` asks for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rollout import teacher_forced
from sparrow_jax.rollout.state import budget_for_lengths
from sparrow_jax.sparsity import block_scores, selection

BS, T, HQ, HKV, D = 16, 192, 4, 2, 8


def _per_key_visible(q, k, key_mask, prompt_lengths, budgets, bin_size, max_selected):
    """The former `visible`: selected blocks repeated to keys, then gathered per key."""
    centroids = block_scores.block_centroids(k.transpose(0, 2, 1, 3), BS)

    def visible(q_c, pos_c, q_idx, k_idx):
        scores = block_scores.centroid_scores(q_c, centroids[:, None])
        budget = budget_for_lengths(budgets, pos_c + 1, bin_size)
        chosen = selection.selected_keys(scores, pos_c,
                                         jnp.minimum(budget // BS, max_selected),
                                         max_selected=max_selected, block_size=BS)
        chosen = chosen | (budget >= pos_c + 1)[..., None, None]
        is_decode = pos_c >= prompt_lengths[:, None]
        seen = jnp.where(is_decode[..., None, None, None], chosen[..., k_idx], True)
        seen = seen & key_mask[:, k_idx][:, None, None]
        return seen.transpose(0, 2, 3, 1, 4)
    return visible


def _layouts(c: int):
    """(q_idx [C], k_idx [M, C]) of every query chunk of `map_causal_query_chunks` at chunk c."""
    n = -(-T // c)
    n += n % 2
    blocks = np.arange(n + 1)
    for i in range(n // 2):
        first = blocks <= i
        col = np.where(first, blocks, n - blocks)
        k_idx = np.minimum(col[:, None] * c + np.arange(c)[None], T - 1)
        for chunk in (i, n - 1 - i):
            yield chunk * c + np.arange(c), k_idx


# C' % bs == 0 (the per-block path), C' % bs != 0 (per key). The one-shot path's layout is one
# run of all keys; tests/test_rollout.py::test_teacher_forced_sparse_replays_rollout replays it.
@pytest.mark.parametrize("chunk", [32, 24])
def test_block_level_mask_equals_per_key_mask(monkeypatch, chunk):
    rng = np.random.default_rng(chunk)
    q = jnp.asarray(rng.normal(size=(3, T, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(3, T, HKV, D)), jnp.float32)
    key_mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [150], [97]]), jnp.int32)
    prompt_lengths = jnp.asarray([20, 5, 64], jnp.int32)
    # Budgets by 48-token bin: small (sparse), then one covering the length (dense rung).
    budgets, bin_size, max_selected = jnp.asarray([48, 64, 96, 4096], jnp.int32), 48, 8
    captured = {}

    def capture(visible, query_chunk, *args):
        captured["visible"] = visible
        return jnp.zeros(())
    monkeypatch.setattr(teacher_forced, "visible_causal_attention", capture)
    fn = teacher_forced.sparse_attention_fn(
        budgets=budgets, bin_size=bin_size, prompt_lengths=prompt_lengths,
        max_selected=max_selected, block_size=BS, dense_layers=(0,), query_chunk=chunk)
    positions = jnp.broadcast_to(jnp.arange(T), (3, T))
    fn(1, q, k, k, positions, key_mask)
    new = jax.jit(captured["visible"])
    old = jax.jit(_per_key_visible(q, k, key_mask.astype(bool), prompt_lengths, budgets,
                                   bin_size, max_selected))
    sparse_seen = 0
    for q_idx, k_idx in _layouts(chunk):
        q_pos = np.minimum(q_idx, T - 1)                 # padded queries (dropped) sit at T - 1
        args = (q[:, q_pos], positions[:, q_pos], jnp.asarray(q_idx), jnp.asarray(k_idx))
        a, b = np.asarray(new(*args)), np.asarray(old(*args))
        np.testing.assert_array_equal(a, b)
        causal = k_idx[None, :] <= q_idx[:, None, None]              # [C, M, C']
        sparse_seen += int((~b[0] & causal.transpose(1, 0, 2)).sum())   # row 0: no padding
    assert sparse_seen > 0                  # the selection really hid keys the queries precede
