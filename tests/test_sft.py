"""`sparrow sft`: the warm-up command writes a loadable HF directory and lowers the loss."""

import json
import re
from pathlib import Path

import gin
import numpy as np
import pytest

from sparrow_jax import cli
from sparrow_jax.data import synthetic
from sparrow_jax.model import load_hf, load_tokenizer
from sparrow_jax.train.sft import crops

REPO = Path(__file__).resolve().parents[1]


def _shipped_problems(data_dir: str) -> tuple[set[int], set[str]]:
    """The generator seeds (ids "synthetic-<seed>-<i>") and prompts of data/<data_dir>/*.jsonl."""
    seeds, prompts = set(), set()
    for path in (REPO / "data" / data_dir).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            seeds.add(int(row["id"].split("-")[1]))
            prompts.add(row["prompt"])
    return seeds, prompts


def _stage_seeds(text: str) -> set[int]:
    return {int(s) for s in re.findall(r"SFTConfig\.seed = (\d+)", text)}


def _draws(seed: int, k_range: tuple[int, int], n: int) -> set[str]:
    rng = np.random.default_rng(seed)
    return {synthetic.make_problem(rng, k_range)["prompt"] for _ in range(n)}


def test_crops_keep_real_positions_and_mask_missing_context():
    rng = np.random.default_rng(0)
    pairs = [(np.arange(1, 11, dtype=np.int32), np.arange(11, 60, dtype=np.int32))]
    tokens, positions, weights, mask = crops(pairs, 20, 5, rng)
    assert (mask == 1).all()
    start = int(positions[0, 0])
    np.testing.assert_array_equal(tokens[0], np.arange(1, 60)[start:start + 20])
    np.testing.assert_array_equal(positions[0], np.arange(start, start + 20))
    if start:
        assert (weights[0, :5] == 0).all()
    # The last token of the sequence predicts nothing; prompt positions before len(p)-1 neither.
    full = np.zeros(59)
    full[9:58] = 1
    expect = full[start:start + 20].copy()
    if start:
        expect[:5] = 0
    np.testing.assert_array_equal(weights[0], expect)


def test_prompt_crops_keep_the_prompt_before_each_window():
    """SFTConfig.crop_keep_prompt: every row is its prompt at positions 0.. then a window of the
    target at its real positions; a weight sits exactly where the next token is a target token
    whose source lies inside the row (the first `context` window tokens unweighted unless the
    window starts the target), and the windows chosen to end with the sequence end with <eos>."""
    rng = np.random.default_rng(1)
    prompt = np.arange(1, 8, dtype=np.int32)                   # 7 tokens
    target = np.arange(100, 160, dtype=np.int32)              # 60 tokens (the last = <eos>)
    starts = set()
    for start_fraction, end_fraction in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
        for _ in range(5):
            tokens, positions, weights, mask = crops([(prompt, target)] * 2, 20, 5, rng,
                                                      start_fraction, True, end_fraction)
            assert tokens.shape == positions.shape == weights.shape == mask.shape == (2, 27)
            np.testing.assert_array_equal(tokens[:, :7], np.stack([prompt] * 2))
            np.testing.assert_array_equal(positions[:, :7], np.stack([np.arange(7)] * 2))
            assert (mask == 1).all()
            for row in range(2):
                start = int(positions[row, 7]) - 7
                starts.add(start)
                np.testing.assert_array_equal(tokens[row, 7:], target[start:start + 20])
                np.testing.assert_array_equal(positions[row, 7:], 7 + np.arange(start, start + 20))
                expect = np.zeros(27)
                expect[6:26] = 1                      # predicts window tokens 0..19
                if start:
                    expect[6:6 + 5] = 0               # their sources precede the window
                np.testing.assert_array_equal(weights[row], expect)
                if start_fraction == 1.0:
                    assert start == 0
                if end_fraction == 1.0:
                    assert start == 40 and tokens[row, -1] == target[-1]
    assert len(starts) > 3                            # uniform windows do move


def test_sft_config_refuses_bad_crop_fractions():
    from sparrow_jax.train.sft import SFTConfig
    for bad in (dict(crop_start_fraction=0.8, crop_end_fraction=0.3, crop_keep_prompt=True),
                dict(crop_end_fraction=-0.1), dict(attention_chunk=-1),
                dict(crop_end_fraction=0.3), dict(sparse_loss_coef=-1.0),
                dict(sparse_budget=40), dict(sparse_budget=32),
                dict(sparse_block_size=24, sparse_budget=96)):
        with pytest.raises(ValueError, match="SFTConfig"):
            SFTConfig(**bad)
    SFTConfig(crop_start_fraction=0.5, crop_end_fraction=0.5, crop_keep_prompt=True)


def test_sft_command_writes_checkpoint(tmp_path, capsys):
    gin.clear_config()
    out = tmp_path / "sft"
    rc = cli.main(["sft", "--gin_param", f"SFTConfig.output_dir = '{out}'",
                   "--gin_param", "SFTConfig.crop_steps = 3", "--gin_param", "SFTConfig.long_steps = 2",
                   "--gin_param", "SFTConfig.long_k_range = (1, 2)",
                   "--gin_param", "SFTConfig.crop_length = 64", "--gin_param", "SFTConfig.eval_problems = 2",
                   "--gin_param", "SFTConfig.hidden_size = 32", "--gin_param", "SFTConfig.intermediate_size = 64",
                   "--gin_param", "SFTConfig.num_layers = 3", "--gin_param", "SFTConfig.head_dim = 16"])
    assert rc == 0
    assert "warm-up checkpoint written" in capsys.readouterr().out
    model = load_hf(out)
    tok = load_tokenizer(out)
    assert model.config.vocab_size == len(tok) and model.config.num_hidden_layers == 3
    assert "greedy_exact=" in (out / "sft_summary.txt").read_text()
    # A long-task stage continues it: prompt-kept crops, chunked attention, a longer context.
    gin.clear_config()
    longer = tmp_path / "sft_long"
    rc = cli.main(["sft", "--gin_param", f"SFTConfig.output_dir = '{longer}'",
                   "--gin_param", f"SFTConfig.init_from = '{out}'",
                   "--gin_param", "SFTConfig.crop_keep_prompt = True",
                   "--gin_param", "SFTConfig.crop_end_fraction = 0.5",
                   "--gin_param", "SFTConfig.attention_chunk = 32",
                   "--gin_param", "SFTConfig.max_position_embeddings = 8192",
                   "--gin_param", "SFTConfig.crop_steps = 2", "--gin_param", "SFTConfig.long_steps = 1",
                   "--gin_param", "SFTConfig.long_batch = 2",
                   "--gin_param", "SFTConfig.sparse_loss_coef = 1.0",
                   "--gin_param", "SFTConfig.sparse_budget = 48",
                   "--gin_param", "SFTConfig.long_k_range = (2, 3)",
                   "--gin_param", "SFTConfig.crop_length = 64", "--gin_param", "SFTConfig.eval_problems = 1"])
    assert rc == 0
    assert load_hf(longer).config.max_position_embeddings == 8192


def test_demo_checkpoint_stages_never_train_on_demo_data():
    """`sparrow sft` draws its problems with the synthetic generator from SFTConfig.seed, as
    `sparrow_jax.data.synthetic` made data/demo/*.jsonl (ids "synthetic-<seed>-<i>"): a stage
    with a data file's seed and K range would train on those very prompts, held-out ones
    included. Every stage of launch/make_demo_checkpoint.sh must use another seed, and no
    problem it draws may be a data/demo prompt."""
    script = (REPO / "launch" / "make_demo_checkpoint.sh").read_text()
    data_seeds, prompts = _shipped_problems("demo")
    stage_seeds = _stage_seeds(script) | {0}
    assert data_seeds and not stage_seeds & data_seeds, (stage_seeds, data_seeds)
    for seed in stage_seeds | {5}:   # the first problems each stage trains on; 5 = control
        for k_range in ((8, 13), (10, 13)):
            # The control: seed 5 made data/demo/heldout128.jsonl; its draws hit the data under
            # either K range (measured), so the check can fail.
            assert bool(prompts & _draws(seed, k_range, 256)) == (seed == 5), (seed, k_range)


def test_long_warmup_never_draws_the_long_task_prompts():
    """The long task's warm-up (configs/sft_long.gin, launch/make_long_checkpoint.sh) draws its
    problems from seeds none of data/long/*.jsonl used, so it never trains on its held-out
    prompts; the control (seed 33, which made data/long/heldout64.jsonl) shows the check can
    fail."""
    # the stages that made checkpoints/long_sft, and the further stage docs/experiment.md shows
    text = "".join((REPO / f).read_text() for f in (
        "configs/sft_long.gin", "configs/sft_long_sparse.gin", "launch/make_long_checkpoint.sh",
        "docs/experiment.md"))
    data_seeds, prompts = _shipped_problems("long")
    stage_seeds = _stage_seeds(text)
    assert data_seeds == {31, 32, 33} and {21, 22, 23, 24} <= stage_seeds
    assert not stage_seeds & data_seeds, (stage_seeds, data_seeds)
    k_range = tuple(int(k) for k in re.search(r"long_k_range = \((\d+), (\d+)\)", text).groups())
    for seed in stage_seeds | {33}:
        for ks in (k_range, (50, 55)):
            # the control: seed 33 made data/long/heldout64.jsonl; its draws hit the data under
            # either K range (measured), so the check can fail
            assert bool(prompts & _draws(seed, ks, 512)) == (seed == 33), (seed, ks)


def test_sparse_loss_adds_the_block_sparse_forwards_cross_entropy():
    """The sparsity-aware loss: at a budget covering every sequence the sparse forward is the
    dense one (loss = (1 + coef) x CE), as with no sparse layer; at a small budget its CE is its
    own, equal with its gradient to a whole sparse forward's (the dense layers before the first
    sparse one run once for both forwards), and a gradient flows through it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
    from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM
    from sparrow_jax.rollout.teacher_forced import sparse_attention_fn
    from sparrow_jax.train.sft import sft_loss, nll_and_accuracy, pack

    tok = build_synthetic_tokenizer()
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
        dtype=jnp.float32, rngs=nnx.Rngs(0))
    pairs = synthetic.sft_examples(tok, 2, seed=5, k_range=(2, 3))
    tokens, weights = pack(pairs, tok.pad_token_id)
    args = (jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
            jnp.asarray(weights), jnp.ones(tokens.shape, jnp.int32),
            jnp.asarray([len(p) for p, _ in pairs], jnp.int32))
    dense, (nll, acc, s_nll, s_acc) = sft_loss(model, *args, 0, None)
    assert float(s_nll) == 0.0 and float(dense) == float(nll)
    wide, (nll_w, _, s_nll_w, _) = sft_loss(model, *args, 0, (0.5, 1024, (0, 1), 16))
    np.testing.assert_allclose(float(s_nll_w), float(nll), rtol=1e-5)
    np.testing.assert_allclose(float(wide), 1.5 * float(nll), rtol=1e-5)
    every, (_, _, s_nll_e, _) = sft_loss(model, *args, 0, (1.0, 48, (0, 1, 2), 16))
    assert float(s_nll_e) == float(nll) and float(every) == 2 * float(nll)   # no sparse layer
    narrow, (_, _, s_nll_n, _) = sft_loss(model, *args, 32, (1.0, 48, (0,), 16))
    assert abs(float(s_nll_n) - float(nll)) > 1e-5       # a random model: attention is flat
    # The dense layer 0, run once for both forwards, changes nothing: the sparse CE and its
    # gradient equal those of a whole sparse forward (the former form); the gradient flows.
    sparse_fn = sparse_attention_fn(budgets=jnp.full((1,), 48, jnp.int32), bin_size=1 << 30,
                                    prompt_lengths=args[4], max_selected=3, block_size=16,
                                    dense_layers=(0,), query_chunk=32)

    def whole_sparse_forward(m):
        return nll_and_accuracy(m(*args[:2], attention_mask=args[3], attention_fn=sparse_fn),
                                 args[0], args[2])[0]
    s_nll_ref, ref = nnx.value_and_grad(whole_sparse_forward)(model)
    grads = nnx.grad(lambda m: sft_loss(m, *args, 32, (1.0, 48, (0,), 16))[1][2])(model)
    np.testing.assert_allclose(float(s_nll_n), float(s_nll_ref), rtol=1e-5)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match=r"layers = \(2, 2\) must be \(start, stop\)"):
        model.run_layers(model.embed(args[0]), args[1], None, layers=(2, 2))


def test_sparse_warmup_configs_parse():
    """configs/sft_long.gin + configs/sft_long_sparse.gin, as docs/experiment.md runs them: the
    sparsity-aware stage, and its control with the sparse term off."""
    from sparrow_jax.train.sft import SFTConfig
    for extra, coef in (([], 1.0), (["SFTConfig.sparse_loss_coef = 0.0"], 0.0)):
        gin.clear_config()
        gin.parse_config_files_and_bindings(
            [str(REPO / "configs/sft_long.gin"), str(REPO / "configs/sft_long_sparse.gin")],
            ["SFTConfig.output_dir = 'runs/x'", *extra])
        cfg = SFTConfig()
        assert (cfg.init_from, cfg.crop_steps, cfg.long_steps, cfg.seed) == (
            "checkpoints/long_sft", 0, 60, 22)
        assert (cfg.sparse_loss_coef, cfg.sparse_budget, cfg.sparse_dense_layers) == (
            coef, 256, (0, 1))
        assert cfg.attention_chunk == 256 and cfg.long_k_range == (46, 58)
    gin.clear_config()     # the layer-1 stage's overrides
    gin.parse_config_files_and_bindings(
        [str(REPO / "configs/sft_long.gin"), str(REPO / "configs/sft_long_sparse.gin")],
        ["SFTConfig.output_dir = 'runs/x'", "SFTConfig.init_from = 'runs/long_sparse_sft'",
         "SFTConfig.sparse_dense_layers = (0,)", "SFTConfig.long_steps = 40", "SFTConfig.seed = 23"])
    cfg = SFTConfig()
    assert (cfg.sparse_dense_layers, cfg.long_steps, cfg.seed) == ((0,), 40, 23)
    gin.clear_config()     # layer 1 sparse from the layers-0-1 stage, the dense CE weighted up
    gin.parse_config_files_and_bindings(
        [str(REPO / "configs/sft_long.gin"), str(REPO / "configs/sft_long_sparse.gin")],
        ["SFTConfig.output_dir = 'runs/x'", "SFTConfig.init_from = 'runs/long_sparse_sft'",
         "SFTConfig.sparse_dense_layers = (0,)", "SFTConfig.long_steps = 40",
         "SFTConfig.sparse_loss_coef = 0.5", "SFTConfig.seed = 24"])
    cfg = SFTConfig()
    assert (cfg.init_from, cfg.sparse_dense_layers, cfg.long_steps, cfg.seed) == (
        "runs/long_sparse_sft", (0,), 40, 24)
    assert (cfg.sparse_loss_coef, cfg.sparse_budget) == (0.5, 256)
    gin.clear_config()


def test_sparse_dense_layers_must_exist(tmp_path):
    """A layer index the model lacks is refused before the first step, naming it."""
    from sparrow_jax.train.sft import SFTConfig, run_sft
    cfg = SFTConfig(output_dir=str(tmp_path / "out"), hidden_size=32, intermediate_size=64,
                    num_layers=3, head_dim=16, crop_steps=0, long_steps=1,
                    sparse_loss_coef=1.0, sparse_dense_layers=(0, 7))
    with pytest.raises(ValueError, match=r"layers \[7\] do not exist \(the model has 3\)"):
        run_sft(cfg)


def test_bench_sft_step_times_dense_and_sparse_steps(capsys):
    """`python -m sparrow_jax.bench.sft_step` (docs/benchmarks.md) on a random 2-layer model: both
    step kinds run from the same start on the same batches; only the sparse one has a sparse CE."""
    from sparrow_jax.bench import sft_step
    assert sft_step.main(["--model", "", "--layers", "2", "--dense_layers", "0", "--steps", "1",
                          "--batch", "1", "--k_range", "2", "3", "--width", "384", "--chunk",
                          "0", "--budget", "48"]) == 0
    out = capsys.readouterr().out
    dense, sparse = (re.search(rf"^{k}: .* loss (\S+) sparse loss (\S+)$", out, re.M)
                     for k in ("dense", "sparse"))
    assert float(dense[2]) == 0.0 and float(sparse[2]) > 0.0
    assert float(dense[1]) == pytest.approx(float(sparse[1]), rel=1e-4)   # the same start
    assert re.search(r"sparse / dense CPU s per step: \d+\.\d\dx", out)
    with pytest.raises(SystemExit):
        sft_step.parse_args(["--steps", "0"])
