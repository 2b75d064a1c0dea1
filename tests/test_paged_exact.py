"""Exact sparse mode on the paged engine (rollout/paged_exact.py): greedy tokens equal dense
greedy, sampled tokens equal the static engine's exact-sparse samples for the same seed (both
key every random number by sample and token index), recorded log-probs equal a teacher-forced
dense pass to 1e-5 - with GRPO groups sharing prompt pages, stops, long tails and preemption."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import (copies_of_shape, make_sharp_tiny_model, run_on_cpu_devices,
                         spy_compiled_text)
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.rollout import (RolloutConfig, continuous, exact, generate, page_pool,
                                 warmup)
from sparrow_jax.rollout.paged_exact import chunk_rounds
from sparrow_jax.rollout.teacher_forced import replay_logprobs
from sparrow_jax.runtime.compile_cache import count_compiles

BUDGETS = np.full(8, 48, np.int32)           # 3 blocks: sink + 2 local
# Chunks of 2 rounds of gamma 3 + 1; one page-table width and slot buckets of 1 or all (the
# exact chunk is the slowest program to compile here: few shapes keep the tests short).
KW = dict(backend="xla", max_budget=64, dense_layers=(), max_new_tokens=40, gamma=3,
          chunk_steps=8, min_table_pages=16, slot_ladder=16)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """hf_fixtures.make_sharp_tiny_model: drafts at a 3-block budget get rejected."""
    return make_sharp_tiny_model(tmp_path_factory.mktemp("tiny_sharp_paged"))


def _prompts(lengths, seed):
    r = np.random.default_rng(seed)
    toks = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        toks[i, :n] = r.integers(3, 96, n)
    return toks, np.asarray(lengths, np.int32)


def _tight(model, pages):
    return pages * page_pool.page_bytes(model.config, model.dtype, 16)


@pytest.mark.slow
@pytest.mark.guard      # the paged engine's exact sparse mode is checked in CI (~45 s loaded)
def test_paged_exact_greedy_equals_dense_greedy_with_groups_and_preemption(sharp):
    """Ragged prompts (row 2's 32 tokens fill two prompt pages: shared by its group), a stop
    (token 36, found from this fixture's dense greedy output: ends prompt 0's samples at their
    8th token) and tails to max_new_tokens; a pool too small for every sample at once preempts
    and recomputes. The warm-up's decode grid (`rollout.warmup`, compiled first) is the exact
    chunk the rollout then runs: it compiles no decode program of its own."""
    toks, lens = _prompts([40, 70, 32, 23], seed=2)
    cfg = RolloutConfig(temperature=0.0, stop_token_ids=(36,), **KW)
    dense = generate(sharp, toks, lens, cfg=dataclasses.replace(cfg, mode="dense"),
                     budgets=BUDGETS, group_size=2)
    ecfg = dataclasses.replace(cfg, mode="exact_sparse", engine="paged",
                               pool_bytes=_tight(sharp, 16))
    width = ecfg.prompt_width(int(lens.max()))
    layout = warmup.layout_for(sharp, ecfg, rows=8, prompt_width=width, group_size=2, spec=None)
    grid = [p for p in warmup.programs(ecfg, layout, rows=8, prompt_width=width, group_size=2,
                                       dtype=sharp.dtype) if p.function == "decode_chunk_program"]
    warmup.warm(sharp, grid, spec=None, budgets=BUDGETS, bin_size=2000)
    with count_compiles() as compiled:
        ex = generate(sharp, toks, lens, budgets=BUDGETS, group_size=2, cfg=ecfg)
    assert not [c for c in compiled if "decode_chunk" in c], compiled
    st = continuous.LAST_STATS
    assert st.preemptions > 0 and st.shared_prompt_pages > 0 and st.peak_pages <= 16
    np.testing.assert_array_equal(np.asarray(ex.tokens), np.asarray(dense.tokens))
    np.testing.assert_array_equal(np.asarray(ex.response_lengths),
                                  np.asarray(dense.response_lengths))
    m = np.asarray(dense.mask)
    np.testing.assert_allclose(np.asarray(ex.logprobs)[m], np.asarray(dense.logprobs)[m],
                               atol=1e-5)
    rl = np.asarray(dense.response_lengths)
    assert rl.min() == 8 and rl.max() == 40
    acc, alpha = np.asarray(ex.accepted), np.asarray(ex.alpha)
    # Drafts were accepted and rejected (> 10 verify-sampled tokens past the first).
    assert 0 < acc.sum() < m.sum() - m.shape[0] - 10
    assert not acc[:, 0].any() and np.isnan(alpha[:, 0]).all() and not acc[~m].any()
    assert np.asarray(ex.budgets).max() == 0


@pytest.mark.slow
def test_paged_exact_runs_a_per_bin_plan(sharp):
    """A gamma per 24-token bin (3, 0, 3: rounds mix slots drafting 3 and dense steps, each
    slot offering its own bin's drafts), verify-guided drafts, a pool that preempts: greedy
    tokens equal dense greedy. With bins 2+ approximate (`approximate_from_bin`), every token
    before a slot's first approximate bin is dense greedy's, the approximate ones are
    unverified drafts recording their budget."""
    toks, lens = _prompts([40, 70, 32, 23], seed=2)
    cfg = RolloutConfig(temperature=0.0, stop_token_ids=(36,), **KW)
    four = np.full(8, 64, np.int32)                 # one block chosen besides sink + local
    dense = generate(sharp, toks, lens, cfg=dataclasses.replace(cfg, mode="dense"),
                     budgets=four, group_size=2)
    ecfg = dataclasses.replace(cfg, mode="exact_sparse", engine="paged", gamma_by_bin=(3, 0, 3),
                               draft_scorer="verify", pool_bytes=_tight(sharp, 13))
    ex = generate(sharp, toks, lens, budgets=four, group_size=2, bin_size=24, cfg=ecfg)
    assert continuous.LAST_STATS.preemptions > 0
    np.testing.assert_array_equal(np.asarray(ex.tokens), np.asarray(dense.tokens))
    m = np.asarray(dense.mask)
    np.testing.assert_allclose(np.asarray(ex.logprobs)[m], np.asarray(dense.logprobs)[m],
                               atol=1e-5)
    acc = np.asarray(ex.accepted)
    assert 0 < acc.sum() < m.sum() - m.shape[0] - 10 and np.asarray(ex.budgets).max() == 0
    mixed = generate(sharp, toks, lens, budgets=four, group_size=2, bin_size=32,
                     cfg=dataclasses.replace(ecfg, gamma_by_bin=(3, 3, 0),
                                             approximate_from_bin=2))
    plen = np.repeat(lens, 2)
    mm = np.asarray(mixed.mask)
    approx = ((plen[:, None] + np.arange(40)[None]) // 32 >= 2) & mm
    first = np.argmax(approx | ~mm, axis=1)
    for r in range(8):
        np.testing.assert_array_equal(np.asarray(mixed.tokens)[r, :first[r]],
                                      np.asarray(dense.tokens)[r, :first[r]])
    unverified = np.asarray(mixed.budgets) > 0
    assert unverified.sum() > 40 and (np.asarray(mixed.budgets)[unverified] == 64).all()
    assert not np.asarray(mixed.accepted)[unverified].any()


@pytest.mark.slow       # ~90 s loaded: `launch/local.sh test --all`
def test_paged_exact_samples_equal_static_exact_and_logprobs_are_dense(sharp):
    """Sampled, groups of 3, a tight pool (preemption): every sample equals the static engine's
    exact-sparse sample of the same seed, and the recorded log-probs equal a teacher-forced
    dense pass over the trajectories to 1e-5 (f32)."""
    toks, lens = _prompts([40, 65, 12, 30], seed=1)
    cfg = RolloutConfig(mode="exact_sparse", temperature=1.0, record_topk=4, **KW)
    rng = jax.random.key(5)
    static = generate(sharp, toks, lens, cfg=cfg, budgets=BUDGETS, group_size=3, rng=rng)
    paged = generate(sharp, toks, lens, budgets=BUDGETS, group_size=3, rng=rng,
                     cfg=dataclasses.replace(cfg, engine="paged", pool_bytes=_tight(sharp, 18)))
    assert continuous.LAST_STATS.preemptions > 0
    m = _assert_same_samples_and_dense_logprobs(sharp, paged, static)
    np.testing.assert_array_equal(np.asarray(paged.cached_lengths),
                                  np.asarray(static.cached_lengths))
    np.testing.assert_allclose(np.asarray(paged.topk_logprobs)[m],
                               np.asarray(static.topk_logprobs)[m], atol=1e-5)
    acc = np.asarray(paged.accepted)[m]
    assert 0.2 < acc.mean() < 0.8


def _assert_same_samples_and_dense_logprobs(model, paged, static) -> np.ndarray:
    """paged's samples equal static's (tokens, lengths, mask, accepted; logprobs and alpha to
    1e-5) and its logprobs a teacher-forced dense pass to 1e-5. Returns the mask [B, T]."""
    m = np.asarray(static.mask)
    for name in ("tokens", "response_lengths", "mask", "accepted"):
        np.testing.assert_array_equal(np.asarray(getattr(paged, name)),
                                      np.asarray(getattr(static, name)), err_msg=name)
    for name in ("logprobs", "alpha"):
        np.testing.assert_allclose(np.asarray(getattr(paged, name))[m],
                                   np.asarray(getattr(static, name))[m], atol=1e-5,
                                   err_msg=name)
    replay = np.asarray(replay_logprobs(model, paged))
    np.testing.assert_allclose(replay[m], np.asarray(paged.logprobs)[m], atol=1e-5)
    return m


@pytest.mark.slow
def test_paged_per_bin_plan_samples_equal_static_per_bin_plan(sharp):
    """Sampled, a gamma per 24-token bin (3, 0, 2: rounds mix slots drafting 3 or 2 and dense
    steps), groups of 2, a tight pool: every sample equals the static engine's with the same
    plan and seed (the static engine's exactness, tests/test_exact_sparse.py, carries over),
    and the recorded log-probs equal a teacher-forced dense pass to 1e-5."""
    toks, lens = _prompts([40, 65, 12, 30], seed=3)
    cfg = RolloutConfig(mode="exact_sparse", temperature=1.0, gamma_by_bin=(3, 0, 2), **KW)
    rng = jax.random.key(7)
    static = generate(sharp, toks, lens, cfg=cfg, budgets=BUDGETS, group_size=2, rng=rng,
                      bin_size=24)
    paged = generate(sharp, toks, lens, budgets=BUDGETS, group_size=2, rng=rng, bin_size=24,
                     cfg=dataclasses.replace(cfg, engine="paged", pool_bytes=_tight(sharp, 13)))
    assert continuous.LAST_STATS.preemptions > 0
    m = _assert_same_samples_and_dense_logprobs(sharp, paged, static)
    # Drafts were accepted and rejected; bin 1's rounds are dense steps (1 token a pass).
    acc = np.asarray(paged.accepted)[m]
    assert 0.1 < acc.mean() < 0.9
    rows = {r["bin"]: r for r in exact.acceptance_by_bin(paged, gamma=(3, 0, 2), bin_size=24)}
    assert rows[1]["rounds"] > 5 and rows[1]["tokens_per_pass"] == 1.0


@pytest.mark.slow       # ~3 min loaded: `launch/local.sh test --all`
def test_sharded_paged_exact_equals_unsharded_static_exact(tmp_path):
    """On a data=2 x model=4 mesh of 8 CPU devices (a pool per data shard; KV heads over model
    where they divide it, replicated where not), with preemption: the unsharded static
    engine's exact-sparse samples (tests/paged_exact_sharded_check.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rows = run_on_cpu_devices([os.path.join(here, "paged_exact_sharded_check.py"),
                               str(tmp_path)])
    assert [r["case"] for r in rows] == ["kv4_sharded_heads", "kv2_replicated_heads"], rows
    for r in rows:
        assert r["tokens_equal"] and r["mask_equal"] and r["accepted_equal"], r
        assert r["max_logprob_diff"] <= 1e-5 and 0.2 < r["accept_rate"] < 0.95, r
        assert r["pools"] == 2 and r["preemptions"] > 0, r
        assert r["tokens_sharding"].startswith("P('data'"), r


def test_paged_exact_settings():
    """A chunk must hold one round; the pool's per-sample maximum has gamma slots of slack (the
    last round writes up to gamma drafts past the last fed token)."""
    with pytest.raises(ValueError, match="chunk_steps=3 must be >= gamma"):
        RolloutConfig(mode="exact_sparse", engine="paged", gamma=3, chunk_steps=3)
    cfg = RolloutConfig(mode="exact_sparse", engine="paged", gamma=3, chunk_steps=8,
                        max_new_tokens=40)
    assert chunk_rounds(cfg) == 2 and chunk_rounds(dataclasses.replace(cfg, chunk_steps=4)) == 1
    mcfg = Qwen3Config(num_hidden_layers=1)

    def max_pages(c):
        return page_pool.pool_layout(mcfg, c, jnp.float32, rows=2, prompt_width=32,
                                     group_size=1).max_pages
    # 32 + 40 - 1 = 71 positions: 5 pages; + gamma 3 = 74: still 5; gamma 9 = 80: 5; 10: 6.
    assert max_pages(dataclasses.replace(cfg, mode="sparse")) == 5
    assert max_pages(dataclasses.replace(cfg, gamma=9, chunk_steps=10)) == 5
    assert max_pages(dataclasses.replace(cfg, gamma=10, chunk_steps=11)) == 6


@pytest.mark.slow       # ~60 s: two exact chunk programs compile
def test_paged_traced_gamma_table_gives_the_static_plans_samples(sharp):
    """Re-planning (`replan_gammas`) on the paged engine: the per-bin gamma table is an input
    of the decode chunk; for the same plan the samples equal the compiled-in plan's, and the
    chunks' rounds per branch add up in `round_counts`."""
    toks, lens = _prompts([40, 70, 32, 23], seed=5)
    cfg = RolloutConfig(mode="exact_sparse", engine="paged", temperature=1.0,
                        gamma_by_bin=(3, 0, 3), **KW)
    rng = jax.random.key(6)
    compiled_in = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=24, rng=rng, cfg=cfg)
    traced = generate(sharp, toks, lens, budgets=BUDGETS, bin_size=24, rng=rng,
                      cfg=dataclasses.replace(cfg, replan_gammas=(0, 1, 3)))
    for field in ("tokens", "logprobs", "accepted", "response_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(traced, field)),
                                      np.asarray(getattr(compiled_in, field)), err_msg=field)
    counts = np.asarray(traced.round_counts)
    assert counts.shape == (4, 3) and (counts == counts[0]).all()
    assert counts[0, 1] == 0 and counts[0, 2] > 0       # gamma 1: in no bin
    # Every chunk runs chunk_rounds rounds, whichever branch.
    assert counts[0].sum() == continuous.LAST_STATS.chunks * chunk_rounds(cfg)


@pytest.mark.slow       # ~40 s: two exact chunk programs compiled twice
def test_a_per_bin_plan_updates_the_page_pools_in_place(sharp, monkeypatch):
    """As tests/test_exact_sparse.py's static twin: the paged exact chunk of a plan with
    several round branches holds no copy of a page pool (each was copied per branch under
    `lax.switch`; `verify.run_one_branch` aliases them)."""
    from sparrow_jax.rollout import paged_exact
    compiled: list = []
    spy_compiled_text(monkeypatch, paged_exact, "decode_chunk_program_for", compiled,
                      lambda args: args[2].k[0].shape)
    toks, lens = _prompts([40, 70, 32, 23], seed=2)
    cfg = RolloutConfig(temperature=0.0, mode="exact_sparse", engine="paged", **KW)
    for extra in (dict(gamma_by_bin=(3, 0, 3)), dict(gamma_by_bin=(3, 3, 0),
                                                     approximate_from_bin=2)):
        generate(sharp, toks, lens, budgets=BUDGETS, group_size=2, bin_size=24,
                 cfg=dataclasses.replace(cfg, **extra))
    assert compiled
    for hlo, pool_shape in compiled:
        assert copies_of_shape(hlo, pool_shape) == 0, pool_shape
