"""The paged engine (page pools, continuous batching, prefix sharing, preemption) gives exactly
the static engine's samples; transformers' greedy generate in dense mode; no page leaks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import assert_greedy_matches_torch, make_tiny_qwen3, random_prompts
from sparrow_jax.model import load_hf
from sparrow_jax.rollout import RolloutConfig, generate, page_pool, continuous
from sparrow_jax.rollout.page_pool import PagePool, PoolExhausted
from sparrow_jax.runtime.shapes import COMPILES

# Budgets of 4 then 6 blocks (48-token bins) against contexts up to ~157 tokens: sparse
# selection really drops blocks.
BUDGETS = np.asarray([64] + [96] * 19, np.int32)
BASE = dict(max_new_tokens=120, backend="xla", max_budget=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch_model = make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return torch_model, load_hf(path, dtype=jnp.float32)



def _run(model, cfg, toks, lens, group_size=2, rng=None, engine="paged", **paged_kw):
    cfg = dataclasses.replace(cfg, engine=engine, **paged_kw)
    return generate(model, toks, lens, cfg=cfg, budgets=BUDGETS, bin_size=48,
                    group_size=group_size, rng=rng)


def _assert_same(a, b):
    """Same samples: tokens, lengths, budgets exactly; log-probs and top-k to f32 noise."""
    m = np.asarray(a.mask)
    np.testing.assert_array_equal(np.asarray(a.response_lengths), np.asarray(b.response_lengths))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    np.testing.assert_array_equal(np.asarray(a.budgets), np.asarray(b.budgets))
    np.testing.assert_array_equal(np.asarray(a.cached_lengths), np.asarray(b.cached_lengths))
    np.testing.assert_array_equal(np.asarray(a.prompt_tokens), np.asarray(b.prompt_tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs)[m], np.asarray(b.logprobs)[m], atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.topk_logprobs)[m], np.asarray(b.topk_logprobs)[m],
                               atol=1e-5)


def _page_bytes(model):
    return page_pool.page_bytes(model.config, model.dtype, 16)


def test_page_pool_refcounts_and_leak_check():
    pool = PagePool(4)
    a = pool.alloc(2)
    assert a == [0, 1] and pool.free_pages == 2
    pool.share(a)                         # a second sample of the group holds the prompt pages
    pool.release(a)
    assert pool.free_pages == 2           # still held once
    with pytest.raises(PoolExhausted):
        pool.alloc(3)
    assert pool.free_pages == 2           # a failed alloc takes nothing
    with pytest.raises(RuntimeError, match="page leak"):
        pool.check_all_free()
    pool.release(a)
    pool.check_all_free()
    with pytest.raises(ValueError, match="not allocated"):
        pool.release([0])


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_paged_equals_static_with_stop_tokens_groups_and_preemption(tiny, mode):
    """Sampled (both engines key each token by sample and index), ragged prompts (a partly filled last prompt page, one exactly full), GRPO groups, a stop
    token that ends rows mid-sequence; then the same with a pool too small for all samples at
    once (preemption + recompute): every sample identical, every page back in the pool."""
    _, model = tiny
    toks, lens = random_prompts([20, 37, 32], seed=3)
    cfg = RolloutConfig(temperature=1.0, mode=mode, **BASE)
    rng = jax.random.key(2)
    free = np.asarray(_run(model, cfg, toks, lens, rng=rng, engine="static").tokens)
    # A stop token that row 0 first produces mid-sequence and the last row never does.
    stop = next(int(t) for t in free[0, 40:] if t not in free[-1] and t not in free[0, :40])
    cfg = dataclasses.replace(cfg, stop_token_ids=(stop,))
    static = _run(model, cfg, toks, lens, rng=rng, engine="static")
    rl = np.asarray(static.response_lengths)
    assert rl.min() < 120 and rl.max() == 120           # a stop mid-sequence, a row at the cap
    assert int(np.asarray(static.cached_lengths)[np.asarray(static.mask)].max()) > 150
    _assert_same(static, _run(model, cfg, toks, lens, rng=rng))
    roomy = continuous.LAST_STATS
    assert roomy.preemptions == 0 and roomy.shared_prompt_pages == 1 + 2 + 2
    # Samples move between slots, wait in the queue, are preempted and recomputed: their
    # tokens stay those of the static engine (keys per sample and token index).
    _assert_same(static, _run(model, cfg, toks, lens, rng=rng, pool_bytes=12 * _page_bytes(model)))
    tight = continuous.LAST_STATS
    assert tight.preemptions > 0 and tight.peak_pages <= 12
    if mode == "sparse":
        _assert_same(static, _run(model, cfg, toks, lens, rng=rng, max_slots=2))


def test_paged_dense_equals_transformers_generate(tiny):
    torch_model, model = tiny
    toks, lens = random_prompts([5, 19, 33], seed=0)
    cfg = RolloutConfig(max_new_tokens=24, temperature=0.0, mode="dense", backend="xla",
                        engine="paged", chunk_steps=8)
    traj = generate(model, toks, lens, cfg=cfg, budgets=BUDGETS)
    assert_greedy_matches_torch(traj, torch_model, toks, lens, 24)


def test_overlapped_loop_equals_sync_loop_without_an_empty_last_chunk(tiny):
    """The overlapped host loop (chunk i+1 dispatched before chunk i is read) gives the sync
    loop's samples in as many chunks: no continuation over samples that reach max_new_tokens in
    the running chunk (it would run empty: every row here ends at the cap)."""
    _, model = tiny
    toks, lens = random_prompts([5, 19, 33], seed=0)
    cfg = RolloutConfig(max_new_tokens=40, temperature=1.0, mode="sparse", backend="xla",
                        max_budget=128, engine="paged", chunk_steps=8)
    rng = jax.random.key(4)
    sync = _run(model, dataclasses.replace(cfg, overlap_chunks=False), toks, lens, rng=rng)
    sync_stats = continuous.LAST_STATS
    overlap = _run(model, cfg, toks, lens, rng=rng)
    stats = continuous.LAST_STATS
    _assert_same(sync, overlap)
    assert (np.asarray(overlap.response_lengths) == 40).all()
    assert sync_stats.overlapped_chunks == 0 and stats.overlapped_chunks > 0
    assert stats.chunks == sync_stats.chunks, (stats, sync_stats)


def test_group_prompt_pages_are_stored_once(tiny):
    """8 samples of one 100-token prompt: its 6 full pages exist once, not 8 times."""
    _, model = tiny
    toks, lens = random_prompts([100], seed=3)
    cfg = RolloutConfig(temperature=1.0, mode="dense", max_new_tokens=2, backend="xla",
                        engine="paged", chunk_steps=1)
    generate(model, toks, lens, cfg=cfg, budgets=BUDGETS, group_size=8, rng=jax.random.key(0))
    st = continuous.LAST_STATS
    assert st.shared_prompt_pages == 6 * 7
    # Held at once: 6 shared pages + one private page per sample (the partly filled 7th page,
    # which also takes the next token): 14 pages, vs 8 x 7 = 56 for private copies.
    assert st.peak_pages == 6 + 8
    assert st.peak_bytes == 14 * _page_bytes(model)


def test_compiles_are_bucketed(tiny):
    """A rollout compiles a bounded number of programs: slots and pages per slot in powers of
    the config's ladders, whatever the samples' lengths; what jax compiles is exactly what the
    shape log (`COMPILES`, the names of the compile plan) reports, and within the plan."""
    from sparrow_jax.runtime.compile_cache import count_compiles
    from sparrow_jax.train import compile_plan
    _, model = tiny
    toks, lens = random_prompts([20, 37, 32], seed=5)
    for ladders, slots, pages in [({}, {1, 2, 4, 6}, {4, 8, 12}),
                                  (dict(slot_ladder=4, page_ladder=4, min_table_pages=2),
                                   {1, 4, 6}, {2, 8, 12})]:
        COMPILES.clear()
        cfg = RolloutConfig(temperature=1.0, mode="sparse", engine="paged", **BASE, **ladders)
        with count_compiles() as names:
            generate(model, toks, lens, cfg=cfg, budgets=BUDGETS, bin_size=48, group_size=2,
                     rng=jax.random.key(1))
        decode_shapes = COMPILES.shapes("rollout/paged_decode")
        assert {s["slots"] for s in decode_shapes} <= slots
        assert {s["pages_per_slot"] for s in decode_shapes} <= pages
        # What compiled is what the shape log says (the first ladder's programs are reused by
        # the second only where a shape repeats, so count per run).
        assert names.count("jit(decode_chunk_program)") <= len(decode_shapes)
        assert names.count("jit(prefill_program)") <= len(COMPILES.shapes("rollout/paged_prefill"))
        plan = {p.name: p for p in compile_plan.plan(
            cfg, group_size=2, prompts_per_call=3, calls_per_step=1, longest_prompt=37,
            length_buckets=(16,), fused=True).programs}
        assert len(decode_shapes) <= plan["rollout/paged_decode"].first
        assert len(COMPILES.shapes("rollout/paged_prefill")) <= plan["rollout/paged_prefill"].most


def test_a_second_rollout_at_the_same_shapes_compiles_nothing(tiny):
    """Every program of a paged rollout (page pools included) is compiled once per shape: the
    same rollout again adds no compile, counted by jax's own compile events."""
    from sparrow_jax.runtime.compile_cache import count_compiles
    _, model = tiny
    toks, lens = random_prompts([20, 37], seed=6)
    cfg = RolloutConfig(temperature=1.0, mode="sparse", engine="paged", **BASE)
    run = lambda: generate(model, toks, lens, cfg=cfg, budgets=BUDGETS, bin_size=48,  # noqa: E731
                           group_size=2, rng=jax.random.key(2))
    with count_compiles() as first:
        a = run()
    with count_compiles() as second:
        b = run()
    assert first, "the counter saw no compile of the first rollout"
    assert second == [], second
    _assert_same(a, b)


def test_bad_paged_settings(tiny):
    _, model = tiny
    toks, lens = random_prompts([20], seed=3)
    with pytest.raises(ValueError, match="static engine only"):
        RolloutConfig(engine="paged", mode="compress")
    with pytest.raises(ValueError, match="engine must be"):
        RolloutConfig(engine="vllm")
    cfg = RolloutConfig(temperature=1.0, engine="paged", **BASE)
    with pytest.raises(ValueError, match="cannot hold one sample"):
        generate(model, toks, lens, cfg=dataclasses.replace(cfg, pool_bytes=4 * _page_bytes(model)),
                 budgets=BUDGETS)
    with pytest.raises(ValueError, match="max_slots"):
        generate(model, toks, lens, cfg=dataclasses.replace(cfg, max_slots=1), budgets=BUDGETS,
                 group_size=2)
    with pytest.raises(ValueError, match="pool_fraction"):
        generate(model, toks, lens, cfg=dataclasses.replace(cfg, pool_fraction=0.5),
                 budgets=BUDGETS)


def test_whole_page_and_row_token_writes_give_equal_pools():
    """The TPU form of the decode chunk's K/V write (whole pages) and the GPU/CPU form (one row
    per token) write the same pool, incl. slots that do not write; the page form also returns
    the written pages."""
    import jax
    import jax.numpy as jnp

    from sparrow_jax.rollout import paged

    hkv, n_pages, bs, d, s = 2, 6, 4, 3, 4
    k0, k1 = jax.random.split(jax.random.key(0))
    pool = jax.random.normal(k0, (1, hkv, n_pages, bs, d), jnp.float32)
    new = jax.random.normal(k1, (s, hkv, d), jnp.float32)
    page = jnp.array([0, 3, 5, 2], jnp.int32)       # distinct pages: active slots never share one
    offset = jnp.array([0, 2, 3, 1], jnp.int32)
    write = jnp.array([True, True, False, True])
    pages, by_page = paged.write_token_pages(pool, new, page, offset, write)
    by_row = paged.write_token_rows(pool, new, page, offset, write)
    assert jnp.array_equal(by_page, by_row)
    assert jnp.array_equal(by_row[0, :, 5], pool[0, :, 5])            # slot 2 does not write
    assert jnp.array_equal(by_row[0, :, 3, 2], new[1])                  # slot 1's row
    assert jnp.array_equal(pages[:, 1], by_row[0, :, 3])                # the written page
    assert paged.writes_whole_pages("pallas_tpu") and not paged.writes_whole_pages("pallas_triton")
    assert not paged.writes_whole_pages("xla")


def test_dense_decoding_in_the_sparse_programs(tiny):
    """`dense_via_sparse` (the evaluation's dense rollout of a sparse run): dense mode's samples
    from the sparse mode's programs at the dense rung - no decode program of its own, no
    budgets recorded - over narrow tables (the selection takes every block) and wide ones (the
    dense branch)."""
    from sparrow_jax.runtime.compile_cache import count_compiles
    _, model = tiny
    toks, lens = random_prompts([20, 37], seed=7)
    cfg = RolloutConfig(temperature=1.0, mode="sparse", **BASE)
    COMPILES.clear()
    _run(model, cfg, toks, lens, rng=jax.random.key(4))
    # Tables of 8 pages (<= the 8 selected blocks: the selection path) and 12 (the dense branch).
    assert {s["pages_per_slot"] for s in COMPILES.shapes("rollout/paged_decode")} >= {8, 12}
    dense = dataclasses.replace(cfg, mode="dense")
    with count_compiles() as names:
        shared = _run(model, dataclasses.replace(dense, dense_via_sparse=True), toks, lens,
                      rng=jax.random.key(4))
    assert "jit(decode_chunk_program)" not in names, names
    ref = _run(model, dense, toks, lens, rng=jax.random.key(4))
    _assert_same(shared, ref)
    assert not np.asarray(shared.budgets).any()
