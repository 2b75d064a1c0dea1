"""PPO mini-batches / epochs, the fused one-step learner, and shape buckets (bounded compiles)."""

import logging
import re

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import gin_argv, make_tiny_qwen3, make_tiny_synthetic_model, tiny_train_bindings
from sparrow_jax import cli
from sparrow_jax.data import synthetic
from sparrow_jax.model import load_hf
from sparrow_jax.rl import learner_programs
from sparrow_jax.rl.learner import Learner, LearnerBatch, LearnerConfig, SparseReplay
from sparrow_jax.rollout import RolloutConfig, generate
from sparrow_jax.runtime.metrics import read_jsonl
from sparrow_jax.runtime.shapes import COMPILES, bucket_length, default_buckets

REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_minibatch")
    make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return path


def _rollout(model, mode="dense", prompts=4, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, 96, (prompts, 30)).astype(np.int32)
    lens = rng.integers(10, 31, prompts).astype(np.int32)
    cfg = RolloutConfig(max_new_tokens=20, mode=mode, backend="xla", max_budget=64)
    return generate(model, toks, lens, cfg=cfg, budgets=np.full(20, 48), bin_size=16,
                    group_size=2, rng=jax.random.key(seed))


def test_second_mini_batch_sees_a_moved_policy(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(model)
    learner = Learner(model, LearnerConfig(learning_rate=2e-2, ppo_mini_batch_size=4,
                                           micro_batch_size=2), group_size=2)
    analysis, metrics = learner.step(traj, learner.advantages(REWARDS))
    steps = learner.last_step_metrics
    assert metrics["learner/optimizer_steps"] == 2 and len(steps) == 2
    # Mini-batch 1: parameters = pi_old, ratio exactly 1. Mini-batch 2: after one update.
    assert abs(steps[0]["loss/ratio_max"] - 1) < 1e-5 and abs(steps[0]["loss/ratio_min"] - 1) < 1e-5
    assert max(abs(steps[1]["loss/ratio_max"] - 1), abs(steps[1]["loss/ratio_min"] - 1)) > 1e-3
    for key in ("loss/clipfrac_high", "loss/clipfrac_low", "loss/dual_clipfrac"):
        assert key in metrics and all(key in s for s in steps)
    assert analysis.logp_old.shape == traj.tokens.shape
    # Epochs: 2 passes over 2 mini-batches = 4 optimizer steps.
    again = Learner(model, LearnerConfig(learning_rate=1e-3, ppo_mini_batch_size=4, ppo_epochs=2),
                    group_size=2)
    twice = again.step(traj, again.advantages(REWARDS))[1]
    assert twice["learner/optimizer_steps"] == 4
    # Model FLOPs (issue 55): every row at prompt width + response length, one forward+backward
    # per epoch, plus the analysis forward (not fused: two mini-batches); no replay here.
    from sparrow_jax.sparsity.cost_model import ModelShape, learner_flops
    shape = ModelShape(3, 48, 4, 2, model.config.head_dim, model.config.intermediate_size, 96)
    seq = traj.prompt_tokens.shape[1] + traj.tokens.shape[1]
    assert metrics["learner/model_flops"] == learner_flops(shape, 8, seq, passes=1, forwards=1)
    assert twice["learner/model_flops"] == learner_flops(shape, 8, seq, passes=2, forwards=1)
    assert "learner/peak_flops" not in metrics          # a CPU: no peak in the table


def test_mini_batch_config_is_checked(ckpt):
    model = load_hf(ckpt, dtype=jnp.float32)
    with pytest.raises(ValueError, match="ppo_mini_batch_size=3 must be a multiple of the group"):
        Learner(model, LearnerConfig(ppo_mini_batch_size=3), group_size=2)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        Learner(model, LearnerConfig(ppo_mini_batch_size=6, micro_batch_size=4), group_size=2)
    with pytest.raises(ValueError, match="ppo_epochs"):
        LearnerConfig(ppo_epochs=0)
    learner = Learner(model, LearnerConfig(ppo_mini_batch_size=6), group_size=2)
    traj = _rollout(model)
    with pytest.raises(ValueError, match="not a multiple of ppo_mini_batch_size=6"):
        learner.step(traj, learner.advantages(REWARDS))


@pytest.mark.parametrize("micro", [0, 4])
def test_fused_step_equals_analysis_then_update(ckpt, micro, monkeypatch):
    """One mini-batch, one epoch: the analysis comes out of the gradient program (one dense
    forward) and equals the separate analysis pass; the update is the same."""
    budgets, replay = np.full(20, 48), SparseReplay(bin_size=16, max_selected=4)
    cfg = LearnerConfig(learning_rate=1e-2, micro_batch_size=micro, alpha_mode="full")
    base = load_hf(ckpt, dtype=jnp.float32)
    traj = _rollout(base, mode="sparse")
    sep = Learner(load_hf(ckpt, dtype=jnp.float32), cfg, group_size=2)
    adv = sep.advantages(REWARDS)
    ref_analysis = sep.analyze(traj, budgets, replay)
    ref_batch = LearnerBatch(traj=traj, logp_old=ref_analysis.logp_old, advantages=adv)
    ref_grads, _, ref_loss = sep.grads(ref_batch)
    fused = Learner(base, cfg, group_size=2)
    assert fused.fused(8)
    grads, _, loss, _ = fused.gradients(LearnerBatch(traj=traj, logp_old=None, advantages=adv),
                                     budgets, replay, 0, 1)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    from sparrow_jax.rl import learner as learner_mod
    for module in (learner_programs, learner_mod):
        monkeypatch.setattr(module, "analyze_program",
                            lambda *a, **k: pytest.fail("fused step ran a second dense forward"))
    analysis, metrics = fused.step(traj, adv, budgets, replay)
    assert metrics["learner/optimizer_steps"] == 1
    mask = np.asarray(traj.mask)
    for key in ("logp_old", "alpha", "logp_sparse_replay"):
        np.testing.assert_allclose(np.asarray(getattr(analysis, key))[mask],
                                   np.asarray(getattr(ref_analysis, key))[mask], atol=1e-5,
                                   err_msg=key)


def test_bucket_helpers():
    b = default_buckets(32768)
    assert b[0] == 64 and b[-1] == 32768 and len(b) < 24
    assert all(y <= 1.5 * x + 16 for x, y in zip(b, b[1:]))        # <= 1.5x padding
    assert bucket_length(65, b) == 96 and bucket_length(33000, b) == 33008
    assert RolloutConfig(prompt_buckets=(32, 64)).prompt_width(40) == 64
    with pytest.raises(ValueError, match="prompt_buckets"):
        RolloutConfig(prompt_buckets=(30,))


@pytest.fixture(scope="module")
def varied_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    make_tiny_synthetic_model(root / "model")
    rows = []
    for i, letters in enumerate((1, 12, 3, 26, 6, 12, 1, 26)):        # prompts of 7..57 tokens
        synthetic.write_jsonl(str(root / "one.jsonl"), 1, seed=i, k_range=(1, 1),
                              num_letters=letters)
        rows.append((root / "one.jsonl").read_text())
    (root / "train.jsonl").write_text("".join(rows))
    return root


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow       # ~60 s: `launch/local.sh test --all`
def test_varying_lengths_compile_one_program_per_bucket(varied_run):
    root = varied_run
    prompt_buckets, length_buckets = (16, 32, 64), (16, 32, 48, 64)
    binds = tiny_train_bindings(root, "run", 6,
                                TrainConfig__prompts_per_step="1",
                                TrainConfig__checkpoint_every="100",
                                RolloutConfig__max_new_tokens="64",
                                RolloutConfig__prompt_buckets=str(prompt_buckets),
                                LearnerConfig__length_buckets=str(length_buckets))
    argv = ["train", *gin_argv(binds)]
    jax.config.update("jax_log_compiles", True)
    COMPILES.clear()
    # The CLI reconfigures the root logger, so collect jax's compile log on its own logger.
    collect, jax_log = _Collect(), logging.getLogger("jax._src.interpreters.pxla")
    jax_log.addHandler(collect)
    try:
        gin.clear_config()
        assert cli.main(argv) == 0
    finally:
        jax.config.update("jax_log_compiles", False)
        jax_log.removeHandler(collect)
    compiled = [m for msg in collect.messages
                for m in re.findall(r"Compiling jit\((\w+)\) with global shapes", msg)]
    prefill_shapes = COMPILES.shapes("rollout/prefill")
    grads_shapes = COMPILES.shapes("learner/grads")
    # Which buckets the 6 steps touched, from the data actually generated.
    steps = read_jsonl(root / "run")
    assert len(steps) == 6
    widths = {s["prompt_width"] for s in prefill_shapes}
    responses = {s["response"] for s in grads_shapes}
    assert widths <= set(prompt_buckets) and responses <= set(length_buckets)
    assert len(widths) >= 2, "the data should touch several prompt buckets"
    # At most one compiled program per bucket touched (new shapes only where noted).
    assert compiled.count("prefill_program") <= len(widths)
    assert compiled.count("decode_program") <= len(widths)
    # The learner's programs are per (prompt bucket, response bucket) pair touched.
    pairs = {(s["prompt_width"], s["response"]) for s in grads_shapes}
    assert len(pairs) == len(grads_shapes) <= len(widths) * len(responses)
    assert 1 <= compiled.count("grads_program") <= len(pairs)
    # The learner's length is the step's longest response rounded up to a bucket.
    lengths = [s["response/length_max"] for s in steps]
    assert responses == {bucket_length(max(int(x), 1), length_buckets) for x in lengths}
