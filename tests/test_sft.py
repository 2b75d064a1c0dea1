"""`sparrow sft`: the warm-up command writes a loadable HF directory and lowers the loss."""

import gin
import numpy as np

from sparrow_jax import cli
from sparrow_jax.model import load_hf, load_tokenizer
from sparrow_jax.sft import _crops


def test_crops_keep_real_positions_and_mask_missing_context():
    rng = np.random.default_rng(0)
    pairs = [(np.arange(1, 11, dtype=np.int32), np.arange(11, 60, dtype=np.int32))]
    tokens, positions, weights = _crops(pairs, 20, 5, rng)
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
