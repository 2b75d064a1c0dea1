"""DistillSparse: a LoRA adapter only the sparse actor carries (sparrow_jax.rl.distill)."""

import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import gin_argv, make_tiny_qwen3, make_tiny_run, tiny_train_bindings
from sparrow_jax import cli
from sparrow_jax.tools.export import export
from sparrow_jax.model import load_hf
from sparrow_jax.rl import distill
from sparrow_jax.rl.distill import DistillConfig, Distiller, merge_lora, merge_lora_model
from sparrow_jax.rl.learner import Learner, LearnerBatch, LearnerConfig, SparseReplay
from sparrow_jax.rollout import RolloutConfig, generate
from sparrow_jax.rollout.teacher_forced import replay_logprobs
from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime.metrics import read_jsonl

REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
BUDGETS = np.full(20, 48)                       # 3 blocks of 16: sink + last 2 (sparse)
REPLAY = SparseReplay(bin_size=16, max_selected=4)
ALPHA = 16.0


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_distill")
    make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return path


def _rollout(model, seed=0, prompt=30, new=20):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, 96, (4, prompt)).astype(np.int32)
    lens = rng.integers(prompt // 3, prompt + 1, 4).astype(np.int32)
    cfg = RolloutConfig(max_new_tokens=new, mode="sparse", backend="xla", max_budget=64)
    return generate(model, toks, lens, cfg=cfg, budgets=BUDGETS, bin_size=16, group_size=2,
                    rng=jax.random.key(seed))


def _random_lora(params, rank=2, scale=0.05, seed=1):
    """An adapter with non-zero b (a fresh one merges to the base exactly)."""
    lora = distill.init_lora(params, rank, key=jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 100))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: scale * jax.random.normal(next(keys), x.shape) if p[-1].key == "b" else x,
        lora)


def _kernel(params, layer, parent, name):
    return np.asarray(params["layers"][layer][parent][name]["kernel"][...])


def test_merged_weights_are_base_plus_b_a_scaled(ckpt_dir):
    model = load_hf(ckpt_dir, dtype=jnp.float32)
    params = nnx.state(model, nnx.Param)
    rank = 2
    fresh = distill.init_lora(params, rank, key=jax.random.key(0))
    # A fresh adapter: a small normal, b = 0, so the merge changes nothing.
    assert np.asarray(fresh["layers"]["0"]["q_proj"]["a"]).std() > 0
    for a, b in zip(jax.tree.leaves(merge_lora(params, fresh, alpha=ALPHA, rank=rank)),
                    jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lora = _random_lora(params, rank)
    merged = merge_lora(params, lora, alpha=ALPHA, rank=rank)
    n_adapted = 0
    for layer in range(3):
        for name, parent in distill.TARGETS.items():
            ab = lora["layers"][str(layer)][name]
            a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
            # torch form W' = W + B @ A x alpha / r with W [out, in]; NNX stores W^T [in, out].
            w_torch = _kernel(params, layer, parent, name).T.astype(np.float64)
            expect = (w_torch + (b.T @ a.T) * ALPHA / rank).T
            np.testing.assert_allclose(_kernel(merged, layer, parent, name), expect,
                                       rtol=1e-5, atol=1e-6)
            n_adapted += 1
    assert n_adapted == 21
    # Norms and embeddings are not adapted; the input model is untouched.
    np.testing.assert_array_equal(np.asarray(merged["embed_tokens"]["embedding"][...]),
                                  np.asarray(params["embed_tokens"]["embedding"][...]))
    merged_model = merge_lora_model(model, lora, alpha=ALPHA)
    np.testing.assert_allclose(
        np.asarray(merged_model.layers[2].mlp.down_proj.kernel[...]),
        _kernel(merged, 2, "mlp", "down_proj"), rtol=1e-6)
    assert not np.allclose(np.asarray(model.layers[2].mlp.down_proj.kernel[...]),
                           _kernel(merged, 2, "mlp", "down_proj"))


@pytest.mark.slow       # ~35 s each; the adapter run end to end stays in CI
def test_dense_side_never_sees_the_adapter(ckpt_dir):
    """With a non-zero adapter merged into the sparse actor, the learner's dense logprobs and the
    base gradient equal those without it; only the alpha replay runs the merged weights."""
    base = load_hf(ckpt_dir, dtype=jnp.float32)
    lora = _random_lora(nnx.state(base, nnx.Param))
    actor = merge_lora_model(base, lora, alpha=ALPHA)
    traj = _rollout(actor)
    learner = Learner(base, LearnerConfig(learning_rate=1e-2, micro_batch_size=4),
                      group_size=2)
    adv = learner.advantages(REWARDS)
    mask = np.asarray(traj.mask)
    plain = learner.analyze(traj, BUDGETS, REPLAY)
    with_actor = learner.analyze(traj, BUDGETS, REPLAY, sparse_model=actor)
    np.testing.assert_array_equal(np.asarray(plain.logp_old), np.asarray(with_actor.logp_old))
    assert not np.allclose(np.asarray(plain.alpha)[mask], np.asarray(with_actor.alpha)[mask])
    # The replay of the merged actor reproduces the rollout's own logprobs.
    np.testing.assert_allclose(np.asarray(with_actor.logp_sparse_replay)[mask],
                               np.asarray(traj.logprobs)[mask], atol=2e-5)
    # Fused gradient program (pi_old from the gradient forward) and the two-pass one.
    for logp_old in (None, plain.logp_old):
        batch = LearnerBatch(traj=traj, logp_old=logp_old, advantages=adv)
        g0, m0, l0, t0 = learner.gradients(batch, BUDGETS, REPLAY, 0, 1)
        g1, m1, l1, t1 = learner.gradients(batch, BUDGETS, REPLAY, 0, 1, sparse_model=actor)
        assert float(l0) == float(l1)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if logp_old is None:
            np.testing.assert_array_equal(np.asarray(t0.logp_old), np.asarray(t1.logp_old))
            np.testing.assert_allclose(np.asarray(t1.logp_sparse_replay)[mask],
                                       np.asarray(traj.logprobs)[mask], atol=2e-5)


def test_rollout_logprobs_equal_teacher_forced_sparse_forward_of_merged(ckpt_dir):
    base = load_hf(ckpt_dir, dtype=jnp.float32)
    learner = Learner(base, LearnerConfig(), group_size=2)
    dist = Distiller(DistillConfig(rank=4), learner, REPLAY)
    dist.lora = _random_lora(learner.params, rank=4, scale=0.1)
    actor = dist.sparse_model(base)
    traj = _rollout(actor, seed=3)
    mask = np.asarray(traj.mask)
    replayed = replay_logprobs(actor, traj, budgets=BUDGETS, bin_size=16, max_budget=64)
    np.testing.assert_allclose(np.asarray(replayed)[mask], np.asarray(traj.logprobs)[mask],
                               atol=2e-5)
    # ... and not the base's: the adapter really changed the sparse actor.
    base_replay = replay_logprobs(base, traj, budgets=BUDGETS, bin_size=16, max_budget=64)
    assert np.abs(np.asarray(base_replay) - np.asarray(replayed))[mask].max() > 1e-3


def _kl_batch(ckpt_dir, learner_cfg):
    base = load_hf(ckpt_dir, dtype=jnp.float32)
    traj = _rollout(base, seed=5, prompt=96, new=32)    # 4-8 blocks, 3 kept: sparse
    learner = Learner(base, learner_cfg, group_size=2)
    dense = learner.analyze(traj).logp_old
    return learner, traj, LearnerBatch(traj=traj, logp_old=dense,
                                       advantages=learner.advantages(REWARDS))


def test_kl_only_update_lowers_the_kl(ckpt_dir):
    """pg_coef 0: the adapter minimises k3 KL(sparse || dense) alone on a fixed batch."""
    learner, traj, batch = _kl_batch(ckpt_dir, LearnerConfig(learning_rate=1e-5))
    cfg = DistillConfig(rank=4, kl_coef=1.0, pg_coef=0.0, budget_blocks=3)
    dist = Distiller(cfg, learner, REPLAY)
    kls = [dist.update(batch, 0, 1, BUDGETS)["distill/kl"] for _ in range(8)]
    assert kls[0] > 1e-4, kls
    assert kls[-1] < 0.5 * kls[0], kls           # measured: 2.4e-4 -> 4.6e-5 in 8 steps
    assert all(b < a for a, b in zip(kls, kls[1:])), kls
    m = dist.update(batch, 0, 1, BUDGETS)
    assert m["distill/lr"] == pytest.approx(1e-5 * 5) and m["distill/skipped"] == 0
    assert {"distill/loss", "distill/kl", "distill/grad_norm", "distill/pg_loss"} <= set(m)
    # The base is frozen.
    fresh = load_hf(ckpt_dir, dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(nnx.state(fresh, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow       # `launch/local.sh test --all`
def test_micro_batched_adapter_step_is_exact_and_runs_per_mini_batch(ckpt_dir):
    learner, traj, batch = _kl_batch(ckpt_dir, LearnerConfig(learning_rate=1e-3))
    cfg = DistillConfig(rank=2, budget_blocks=3, kl_coef=0.1)
    one = Distiller(cfg, learner, REPLAY)
    m_one = one.update(batch, 0, 1, BUDGETS)
    micro = Learner(learner.model, LearnerConfig(learning_rate=1e-3, micro_batch_size=2),
                    group_size=2)
    split = Distiller(cfg, micro, REPLAY)
    m_split = split.update(batch, 0, 1, BUDGETS)
    for k in ("distill/loss", "distill/kl", "distill/grad_norm"):
        assert m_split[k] == pytest.approx(m_one[k], rel=1e-4, abs=1e-7), k
    # The adapters after one Adam step: each element moved by ~lr x g / (|g| + eps), about
    # +-5e-3 here, so an element whose gradient is near eps carries the f32 summation-order
    # difference of the micro-batches amplified (9e-7 seen, 2e-4 of its value). Tolerance: 1e-3
    # of the step. A missing or mis-scaled micro-batch fails the metrics above at 1e-4.
    for a, b in zip(jax.tree.leaves(one.lora), jax.tree.leaves(split.lora)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-6)
    # Two mini-batches: the hook runs after each base step, with the dense anchor attached.
    mini = Learner(load_hf(ckpt_dir, dtype=jnp.float32),
                   LearnerConfig(learning_rate=1e-3, ppo_mini_batch_size=4), group_size=2)
    dist = Distiller(cfg, mini, REPLAY)
    calls = []

    def hook(b, j, n):
        assert b.logp_old is not None
        calls.append((j, n))
        return dist.update(b, j, n, BUDGETS)
    _, metrics = mini.step(traj, mini.advantages(REWARDS), BUDGETS, REPLAY, after_step=hook)
    assert calls == [(0, 2), (1, 2)] and "distill/kl" in metrics
    assert dist.num_steps == 2


def test_non_finite_adapter_step_is_skipped(ckpt_dir):
    learner, traj, batch = _kl_batch(ckpt_dir, LearnerConfig(learning_rate=1e-3))
    dist = Distiller(DistillConfig(rank=2, budget_blocks=3), learner, REPLAY)
    before = jax.tree.map(np.asarray, dist.state())
    bad = LearnerBatch(traj=traj, logp_old=batch.logp_old,
                       advantages=jnp.full_like(batch.advantages, jnp.nan))
    m = dist.update(bad, 0, 1, BUDGETS)
    assert m["distill/skipped"] == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(dist.state())):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_checkpoint_round_trip(ckpt_dir, tmp_path):
    learner, traj, batch = _kl_batch(ckpt_dir, LearnerConfig(learning_rate=1e-3))
    dist = Distiller(DistillConfig(rank=2, budget_blocks=3), learner, REPLAY)
    dist.update(batch, 0, 1, BUDGETS)
    saved = jax.tree.map(np.asarray, dist.state())
    with ckpt.CheckpointManager(tmp_path, max_to_keep=None) as mngr:
        assert mngr.save(1, learner.params, learner.opt_state, {"step": 1},
                         distill=dist.state())
        assert mngr.save(2, learner.params, learner.opt_state, {"step": 2})   # no adapter
    other = Distiller(DistillConfig(rank=2, budget_blocks=3), learner, REPLAY)
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mngr:
        state = mngr.restore_distill(1, ckpt.abstract_like(other.state()))
        assert mngr.restore_distill(2, ckpt.abstract_like(other.state())) is None
        params, _, extra = mngr.restore(2, ckpt.abstract_like(learner.params))   # old layout
        assert extra["step"] == 2
    other.load_state(state)
    assert jax.tree.structure(other.state()) == jax.tree.structure(dist.state())
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(other.state())):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert other.num_steps == 1


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("distill_train"), eval_rows=0)


def _train(root, steps):
    gin.clear_config()
    binds = tiny_train_bindings(root, "run", steps, DistillConfig__rank="2",
                                DistillConfig__budget_blocks="3")
    return cli.main(["train", *gin_argv(binds)])


def test_train_with_adapter_logs_checkpoints_resumes_and_exports(train_setup, tmp_path):
    root = train_setup
    assert _train(root, 2) == 0
    rows = [r for r in read_jsonl(root / "run") if "reward/mean" in r]
    assert len(rows) == 2
    for key in ("distill/loss", "distill/kl", "distill/grad_norm", "distill/lr", "time/distill",
                "alpha/alpha_mean"):
        assert all(key in r for r in rows), key
    step_dir = root / "run" / "checkpoints" / "2"
    assert (step_dir / "distill").is_dir()
    # Resume restores the adapter (its step count continues) and trains a third step.
    assert _train(root, 3) == 0
    with ckpt.CheckpointManager(root / "run", read_only=True) as mngr:
        base = load_hf(root / "model", dtype=jnp.float32)
        learner = Learner(base, LearnerConfig(), group_size=2)
        dist = Distiller(DistillConfig(rank=2), learner, REPLAY)
        state = mngr.restore_distill(3, ckpt.abstract_like(dist.state()))
    dist.load_state(state)
    assert dist.num_steps == 3
    assert np.abs(np.asarray(state["lora"]["layers"]["2"]["o_proj"]["b"])).max() > 0
    # Export: the dense policy by default, the merged sparse actor with --merge_lora.
    dense = export(root / "run", tmp_path / "dense")
    merged = export(root / "run", tmp_path / "merged", merge_lora=True)
    assert dense.step == merged.step == 3
    prov = json.loads((tmp_path / "merged" / "sparrow_export.json").read_text())
    assert prov["merged_lora"] == {"rank": 2, "alpha": 16.0}
    d = load_hf(tmp_path / "dense", dtype=jnp.float32)
    m = load_hf(tmp_path / "merged", dtype=jnp.float32)
    policy = nnx.state(d, nnx.Param)
    expect = merge_lora(policy, state["lora"], alpha=16.0, rank=2)
    for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.Param)), jax.tree.leaves(expect)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert not np.allclose(np.asarray(d.layers[2].self_attn.o_proj.kernel[...]),
                           np.asarray(m.layers[2].self_attn.o_proj.kernel[...]))
