"""`python -m sparrow_jax.tools.config_smoke`: a shipped config for a few steps at its model's
shape on random weights (the device check's `train_real` stage)."""

import json

import gin
import pytest

from sparrow_jax.tools import config_smoke

REPO = config_smoke.REPO
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "tie_word_embeddings": True}


def test_placeholder_tokenizer_covers_the_whole_vocabulary():
    tok = config_smoke.placeholder_tokenizer(64)
    assert len(tok) == 64 and tok.convert_ids_to_tokens(63) == "<x20>"
    assert tok.decode([7, 63, 2]) == "0 <x20> <eos>"          # every id decodes
    assert tok.encode("a 1 =", add_special_tokens=False) == [
        tok.convert_tokens_to_ids(t) for t in ("a", "1", "=")]
    with pytest.raises(ValueError, match="below the synthetic task's 43 tokens"):
        config_smoke.placeholder_tokenizer(40)


def test_model_shape_from_a_preset_or_a_file(tmp_path):
    cfg = config_smoke.model_config("qwen3-1.7b", None, 4)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (4, 2048, 151936)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY | {"architectures": ["Qwen3ForCausalLM"]}))
    assert config_smoke.model_config(None, str(path), None).hidden_size == 32
    for bad in ((None, None, None), ("qwen3-1.7b", str(path), None), ("qwen3-1.7b", None, 0)):
        with pytest.raises(SystemExit):
            config_smoke.model_config(*bad)


@pytest.mark.parametrize("config", ["configs/qwen3_1p7b_gpu.gin", "configs/qwen3_8b_tpu.gin",
                                    "configs/qwen3_0p6b_v5e.gin"])
def test_overrides_bind_on_every_shipped_config(config, tmp_path):
    """The smoke run's bindings parse on top of each shipped config and leave no evaluation,
    no chat template and the synthetic data (what the run needs with the placeholder tokenizer)."""
    from sparrow_jax import cli
    gin.clear_config()
    try:
        cli.parse_gin([str(REPO / config)], config_smoke.train_overrides(
            tmp_path / "m", tmp_path / "r", steps=2, prompts=8, new_tokens=4096))
        assert gin.query_parameter("TrainConfig.eval_data") == ""
        assert gin.query_parameter("PromptFormat.use_chat_template") is False
        assert gin.query_parameter("TrainConfig.train_data").endswith("data/long/train.jsonl")
        assert gin.query_parameter("RolloutConfig.max_new_tokens") == 4096
    finally:
        gin.clear_config()


@pytest.mark.slow    # ~2-3 min on the loaded 2-core machine: the GPU config's programs, tiny model
def test_the_gpu_config_runs_a_step_on_a_random_tiny_model(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    code = config_smoke.main([
        str(REPO / "configs/qwen3_1p7b_gpu.gin"), "--model_config", str(path), "--steps", "1",
        "--prompts", "1", "--new_tokens", "16", "--out", str(tmp_path / "smoke"), "--json",
        "--gin_param", "RolloutConfig.pool_bytes = 67108864",
        "--gin_param", "RolloutConfig.min_table_pages = 16",
        "--gin_param", "RolloutConfig.prompt_buckets = (64,)",
        "--gin_param", "RolloutConfig.prefill_chunk = 64",
        "--gin_param", "TrainConfig.reward_processes = 0"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    [row] = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert row["bench"] == "config_smoke" and row["step"] == 1 and row["time/step"] > 0
    assert row["rollout/tokens_per_s"] > 0 and row["layers"] == 3
    assert (tmp_path / "smoke" / "model" / "config.json").exists()
