"""Rollout engine: dense == transformers generate, sparse(budget >= length) == dense, recorded
logprobs == teacher-forced forwards (dense and sparse replay), ragged/EOS/max length, seeds."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from hf_fixtures import assert_greedy_matches_torch, make_tiny_qwen3, random_prompts
from sparrow_jax.model import load_hf
from sparrow_jax.rollout import RolloutConfig, decode, static, generate, start
from sparrow_jax.rollout.teacher_forced import replay_logprobs

BIG = np.full(20, 4096, np.int32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch_model = make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return torch_model, load_hf(path, dtype=jnp.float32)


def test_greedy_dense_matches_transformers_generate(tiny):
    torch_model, model = tiny
    toks, lens = random_prompts([5, 19, 33], seed=0)
    cfg = RolloutConfig(max_new_tokens=24, temperature=0.0, mode="dense", backend="xla")
    traj = generate(model, toks, lens, cfg=cfg, budgets=BIG)
    assert_greedy_matches_torch(traj, torch_model, toks, lens, 24)
    assert np.asarray(traj.mask).all()


def test_sparse_with_large_budget_equals_dense(tiny):
    _, model = tiny
    toks, lens = random_prompts([7, 40], seed=1)
    kw = dict(max_new_tokens=60, temperature=1.0, backend="xla", max_budget=4096)
    rng = jax.random.key(3)
    dense = generate(model, toks, lens, cfg=RolloutConfig(mode="dense", **kw), budgets=BIG,
                     group_size=2, rng=rng)
    sparse = generate(model, toks, lens, cfg=RolloutConfig(mode="sparse", **kw), budgets=BIG,
                      group_size=2, rng=rng)
    np.testing.assert_array_equal(np.asarray(sparse.tokens), np.asarray(dense.tokens))
    np.testing.assert_allclose(np.asarray(sparse.logprobs), np.asarray(dense.logprobs), atol=1e-5)


def test_recorded_logprobs_equal_teacher_forced_dense(tiny):
    _, model = tiny
    toks, lens = random_prompts([9, 26, 3], seed=2)
    cfg = RolloutConfig(max_new_tokens=40, temperature=1.0, mode="dense", backend="xla")
    traj = generate(model, toks, lens, cfg=cfg, budgets=BIG, group_size=2, rng=jax.random.key(0))
    replay = replay_logprobs(model, traj)
    np.testing.assert_allclose(np.asarray(replay), np.asarray(traj.logprobs), atol=1e-5)


def test_teacher_forced_sparse_replays_rollout(tiny):
    _, model = tiny
    toks, lens = random_prompts([20, 37], seed=3)
    budgets = np.full(20, 64, np.int32)
    budgets[1:] = 96  # second 48-token bin gets a bigger budget: exercises per-bin lookup
    cfg = RolloutConfig(max_new_tokens=120, temperature=1.0, mode="sparse", backend="xla",
                        max_budget=128)
    traj = generate(model, toks, lens, cfg=cfg, budgets=budgets, bin_size=48, group_size=2,
                    rng=jax.random.key(1))
    # The budget really binds: lengths reach ~157 tokens (10 blocks) with a 4-6 block budget.
    assert int(np.asarray(traj.cached_lengths).max()) > 150
    sparse = replay_logprobs(model, traj, budgets=budgets, bin_size=48, max_budget=128)
    dense = replay_logprobs(model, traj)
    mask = np.asarray(traj.mask)
    np.testing.assert_allclose(np.asarray(sparse)[mask], np.asarray(traj.logprobs)[mask], atol=1e-5)
    assert np.abs(np.asarray(dense)[mask] - np.asarray(traj.logprobs)[mask]).max() > 1e-3
    rec = np.asarray(traj.budgets)
    assert (rec[:, 0] == 0).all()  # first token comes from the dense prefill
    cl = np.asarray(traj.cached_lengths)
    expect = np.where(cl[:, 1:] // 48 >= 1, 96, 64)
    assert (rec[:, 1:][mask[:, 1:]] == expect[mask[:, 1:]]).all()


def test_eos_and_max_length(tiny):
    _, model = tiny
    toks, lens = random_prompts([6, 12, 30, 2], seed=4)
    cfg0 = RolloutConfig(max_new_tokens=30, temperature=1.0, mode="sparse", backend="xla",
                         max_budget=64)
    free = generate(model, toks, lens, cfg=cfg0, budgets=np.full(20, 64), rng=jax.random.key(5))
    # Pick as stop token one that row 0 generated in the middle: rows must stop right after it.
    stop = int(np.asarray(free.tokens)[0, 10])
    cfg = RolloutConfig(**{**cfg0.__dict__, "stop_token_ids": (stop,)})
    traj = generate(model, toks, lens, cfg=cfg, budgets=np.full(20, 64), rng=jax.random.key(5))
    tokens, mask = np.asarray(traj.tokens), np.asarray(traj.mask)
    rl = np.asarray(traj.response_lengths)
    for i in range(len(lens)):
        row = tokens[i, :rl[i]].tolist()
        if stop in row:
            assert row.index(stop) == rl[i] - 1  # stop token kept, nothing after it
        else:
            assert rl[i] == 30
        assert mask[i].sum() == rl[i] and (tokens[i, rl[i]:] == cfg.pad_token_id).all()
    assert rl[0] <= 11 and (np.asarray(free.tokens)[0, :rl[0]] == tokens[0, :rl[0]]).all()


def test_seed_reproducible(tiny):
    _, model = tiny
    toks, lens = random_prompts([8, 8], seed=5)
    cfg = RolloutConfig(max_new_tokens=20, mode="sparse", backend="xla", max_budget=64)
    a = generate(model, toks, lens, cfg=cfg, budgets=np.full(20, 64), group_size=4,
                 rng=jax.random.key(7))
    b = generate(model, toks, lens, cfg=cfg, budgets=np.full(20, 64), group_size=4,
                 rng=jax.random.key(7))
    c = generate(model, toks, lens, cfg=cfg, budgets=np.full(20, 64), group_size=4,
                 rng=jax.random.key(8))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    # The 4 samples of a group share a prompt but are different samples.
    assert len({tuple(r) for r in np.asarray(a.tokens)[:4].tolist()}) > 1


def test_bad_inputs(tiny):
    _, model = tiny
    toks, lens = random_prompts([4], seed=6)
    cfg = RolloutConfig(max_new_tokens=4, max_budget=64, backend="xla")
    with pytest.raises(ValueError, match="max_budget"):
        generate(model, toks, lens, cfg=cfg, budgets=np.full(20, 128))
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(model, toks, np.array([9]), cfg=cfg, budgets=np.full(20, 64))
    with pytest.raises(ValueError, match="mode"):
        RolloutConfig(mode="fast")
    with pytest.raises(ValueError, match="max_budget"):
        RolloutConfig(max_budget=40)
    state = start(model, toks, lens, cfg=cfg)
    with pytest.raises(ValueError, match="prefilled for"):
        decode(model, state, cfg=RolloutConfig(max_new_tokens=8, max_budget=64), budgets=[64])


def test_prefill_state_serves_both_modes_and_decode_updates_cache_in_place(tiny):
    """`start` is mode-independent: dense and sparse decode from copies of one prefill equal
    `generate`; the decode program aliases the donated cache to its output (no second copy)."""
    from flax import nnx
    from sparrow_jax.rollout.kv_cache import cache_bytes
    _, model = tiny
    toks, lens = random_prompts([30, 12], seed=9)
    cfgs = {m: RolloutConfig(max_new_tokens=40, mode=m, backend="xla", max_budget=48)
            for m in ("dense", "sparse")}
    budgets = np.full(20, 48)
    state = start(model, toks, lens, cfg=cfgs["dense"], group_size=2, rng=jax.random.key(3))
    for mode, cfg in cfgs.items():
        fresh = jax.tree.map(jnp.copy, state)
        got = decode(model, fresh, cfg=cfg, budgets=budgets, bin_size=16)
        want = generate(model, toks, lens, cfg=cfg, budgets=budgets, bin_size=16, group_size=2,
                        rng=jax.random.key(3))
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs),
                                   rtol=1e-5, atol=1e-6)
        assert fresh.cache.k[0].is_deleted()        # donated
    assert (np.asarray(got.budgets)[np.asarray(got.mask)] == 48).any()   # sparse bound hit
    graphdef, params = nnx.split(model)
    compiled = static.decode_program.lower(
        graphdef, params, state, jnp.asarray(budgets, jnp.int32), cfg=cfgs["sparse"], bin_size=16,
        spec=None).compile()
    stats = compiled.memory_analysis()
    whole_cache = cache_bytes(model.config, 4, state.cache.max_length, jnp.float32)
    assert stats.alias_size_in_bytes >= whole_cache
    assert stats.temp_size_in_bytes < whole_cache / 2


def test_every_engine_and_mode_has_its_implementation():
    """rollout/api.py: one `Generator` per engine and one `Decoder` per mode of the static
    engine, so a new engine or mode without one fails here, not in a user's run."""
    from sparrow_jax.rollout import api
    from sparrow_jax.rollout.config import Engine, RolloutMode
    assert set(api.ENGINES) == set(Engine) and set(api.DECODERS) == set(RolloutMode)
