"""Learner: exact gradient accumulation, loss decreases, mismatch analysis vs rollout records."""

import dataclasses
import re

import gin
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from hf_fixtures import make_tiny_qwen3
from sparrow_jax.model import load_hf
from sparrow_jax.model.qwen3 import REMAT_MODES
from sparrow_jax.rl.learner import (AlphaMode, Learner, LearnerBatch, LearnerConfig, RematMode,
                                    SparseReplay)
from sparrow_jax.rollout import RolloutConfig, generate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return path


def _rollout(model, mode="dense", budget=4096, new=24, group=2, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, 96, (2, 30)).astype(np.int32)
    lens = np.array([30, 17], np.int32)
    cfg = RolloutConfig(max_new_tokens=new, mode=mode, backend="xla", max_budget=max(budget, 64))
    return generate(model, toks, lens, cfg=cfg, budgets=np.full(20, budget), bin_size=64,
                    group_size=group, rng=jax.random.key(seed))


def _batch(learner, traj, rewards):
    logp_old = learner.analyze(traj).logp_old
    return LearnerBatch(traj=traj, logp_old=logp_old, advantages=learner.advantages(rewards))


def test_micro_batch_accumulation_equals_full_batch(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model)
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    full = Learner(model, LearnerConfig(learning_rate=1e-3), group_size=2)
    batch = _batch(full, traj, rewards)
    # Perturb the policy so ratios != 1 and clipping paths are exercised.
    g_full, m_full, loss_full = full.grads(batch)
    micro = Learner(model, LearnerConfig(learning_rate=1e-3, micro_batch_size=2), group_size=2)
    g_micro, m_micro, loss_micro = micro.grads(batch)
    np.testing.assert_allclose(np.asarray(micro.analyze(traj).logp_old),
                               np.asarray(batch.logp_old), atol=1e-6)
    np.testing.assert_allclose(float(loss_micro), float(loss_full), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_micro)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


def test_updates_decrease_loss_on_fixed_batch(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model, seed=1)
    learner = Learner(model, LearnerConfig(learning_rate=3e-3, grad_clip=10.0), group_size=2)
    batch = _batch(learner, traj, np.array([1.0, 0.0, 0.0, 1.0]))
    losses = [learner.update(batch)["loss/policy"] for _ in range(4)]
    _, _, final = learner.grads(batch)
    assert float(final) < losses[0] - 1e-3, losses


def test_micro_batch_must_hold_whole_groups(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    with pytest.raises(ValueError, match="multiple of the group size"):
        Learner(model, LearnerConfig(micro_batch_size=3), group_size=2)


def test_modes_are_checked_at_config_time():
    """Mode settings are enums: a wrong string fails when the config is made, naming the setting
    and the allowed values; gin's strings still work and still compare equal."""
    msg = "LearnerConfig.alpha_mode must be one of ('full', 'topk', 'none'), got 'fulll'"
    with pytest.raises(ValueError, match=re.escape(msg)):
        LearnerConfig(alpha_mode="fulll")
    with pytest.raises(ValueError, match=re.escape("LearnerConfig.remat must be one of ('none', "
                                                   "'full', 'dots'), got 'some'")):
        LearnerConfig(remat="some")
    assert tuple(RematMode) == REMAT_MODES       # the model's remat modes, same order
    gin.clear_config()
    try:
        gin.parse_config("LearnerConfig.alpha_mode = 'topk'\nLearnerConfig.remat = 'dots'")
        cfg = LearnerConfig()
    finally:
        gin.clear_config()
    assert cfg.alpha_mode is AlphaMode.TOPK and cfg.alpha_mode == "topk"
    assert cfg.remat is RematMode.DOTS and cfg.remat == "dots"
    assert dataclasses.replace(cfg, alpha_mode="none").alpha_mode is AlphaMode.NONE
    assert hash(LearnerConfig(alpha_mode="full")) == hash(LearnerConfig())
    # Written back as gin writes strings (the operative config of a run, `repr`).
    assert repr(AlphaMode.FULL) == "'full'" and "alpha_mode='topk'" in repr(cfg)


def test_analyze_dense_rollout_has_alpha_one_and_matching_logprobs(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model, mode="dense")
    learner = Learner(model, LearnerConfig(alpha_mode="topk"), group_size=2)
    out = learner.analyze(traj)
    mask = np.asarray(traj.mask)
    np.testing.assert_allclose(np.asarray(out.logp_old)[mask], np.asarray(traj.logprobs)[mask],
                               atol=1e-5)
    # Identical distributions: the top-k lower bound is exactly the top-k probability mass.
    alpha = np.asarray(out.alpha)[mask]
    topk_mass = np.exp(np.asarray(traj.topk_logprobs)).sum(-1)[mask]
    np.testing.assert_allclose(alpha, topk_mass, atol=1e-5)


def test_analyze_sparse_full_alpha_and_topk_bound(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model, mode="sparse", budget=48, new=60)
    replay = SparseReplay(bin_size=64, max_selected=4)
    budgets = np.full(20, 48)
    full = Learner(model, LearnerConfig(alpha_mode="full"), group_size=2).analyze(traj, budgets,
                                                                                 replay)
    topk = Learner(model, LearnerConfig(alpha_mode="topk"), group_size=2).analyze(traj)
    mask = np.asarray(traj.mask)
    np.testing.assert_allclose(np.asarray(full.logp_sparse_replay)[mask],
                               np.asarray(traj.logprobs)[mask], atol=1e-5)
    a_full, a_topk = np.asarray(full.alpha)[mask], np.asarray(topk.alpha)[mask]
    assert (a_topk <= a_full + 1e-5).all()
    assert a_full.min() < 0.999  # the 3-block budget really changes the distribution
    # Query-chunked replay (long sequences; 13 does not divide the sequence) selects the same.
    chunked = Learner(model, LearnerConfig(alpha_mode="full", attention_chunk=13),
                      group_size=2).analyze(traj, budgets, replay)
    for key in ("logp_old", "logp_sparse_replay", "alpha"):
        np.testing.assert_allclose(np.asarray(getattr(chunked, key))[mask],
                                   np.asarray(getattr(full, key))[mask], atol=1e-5)


def test_chunked_attention_learner_equals_one_shot(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model, seed=2)
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    one_shot = Learner(model, LearnerConfig(learning_rate=1e-3, alpha_mode="topk"), group_size=2)
    chunked = Learner(model, LearnerConfig(learning_rate=1e-3, alpha_mode="topk",
                                           attention_chunk=16), group_size=2)
    batch = _batch(one_shot, traj, rewards)
    a_one, a_chunk = one_shot.analyze(traj), chunked.analyze(traj)
    for key in ("logp_old", "alpha"):
        np.testing.assert_allclose(np.asarray(getattr(a_chunk, key)),
                                   np.asarray(getattr(a_one, key)), atol=1e-5)
    g_one, _, loss_one = one_shot.grads(batch)
    g_chunk, _, loss_chunk = chunked.grads(batch)
    np.testing.assert_allclose(float(loss_chunk), float(loss_one), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-5)  # summation-order noise
    with pytest.raises(ValueError, match="attention_chunk must be >= 0.*got -1"):
        LearnerConfig(attention_chunk=-1)


def test_split_micro_batches_spreads_rows_over_shards_and_merges_back():
    from sparrow_jax.rl.learner import merge_micro_batches, split_micro_batches
    rows = jnp.arange(16 * 3).reshape(16, 3)       # 16 rows, trailing dims ride along
    contiguous = split_micro_batches({"x": rows}, 4)["x"]
    np.testing.assert_array_equal(contiguous[1][:, 0], [12, 15, 18, 21])      # rows 4..7
    spread = split_micro_batches(rows, 2, row_shards=4)   # 4 shards of 4 rows each
    assert spread.shape == (2, 8, 3)
    # Micro-batch j = rows 2j, 2j+1 of every shard: each shard contributes equally.
    np.testing.assert_array_equal(spread[0][:, 0] // 3, [0, 1, 4, 5, 8, 9, 12, 13])
    np.testing.assert_array_equal(spread[1][:, 0] // 3, [2, 3, 6, 7, 10, 11, 14, 15])
    for shards in (1, 2, 4):
        for n in (1, 2):
            parts = split_micro_batches(rows, n, row_shards=shards)
            np.testing.assert_array_equal(merge_micro_batches(parts, row_shards=shards), rows)


def test_micro_batch_metrics_match_full_batch(ckpt):
    """Max/min metrics start from the identity of their reduction, not from 0."""
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model, seed=2)
    full = Learner(model, LearnerConfig(), group_size=2)
    batch = _batch(full, traj, np.array([1.0, 0.0, 0.0, 1.0]))
    _, m_full, _ = full.grads(batch)
    _, m_micro, _ = Learner(model, LearnerConfig(micro_batch_size=2), group_size=2).grads(batch)
    assert set(m_full) == set(m_micro)
    for k in m_full:
        np.testing.assert_allclose(np.asarray(m_micro[k]), np.asarray(m_full[k]), rtol=1e-5,
                                   atol=1e-7, err_msg=k)
