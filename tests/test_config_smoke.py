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


def test_split_line_names_each_phase_its_compiles_and_the_learner_share():
    row = {"time/rollout": 12.0, "time/compile/rollout": 8.0, "time/reward": 0.5,
           "time/probe": 3.0, "time/learner": 20.0, "time/compile/learner": 15.0,
           "time/step": 35.5, "time/learner_flops_per_s": 79e12,
           "time/learner_flops_share": 0.1}
    assert config_smoke.split_line(row) == (
        "rollout 12 s (compile 8), reward 0.5 s, probe 3 s, learner 20 s (compile 15); "
        "step 35.5 s; learner 79 TFLOP/s, 10.0% of the bf16 peak")


def test_the_model_is_written_without_holding_the_accelerator(monkeypatch):
    """The parent only writes the random model; `sparrow train` (its child) needs the GPU's
    memory: jax's preallocation is off while the model is written, the environment as it was
    after (what the child inherits)."""
    import os
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "bfc")
    with config_smoke.allocating_on_demand():
        assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "bfc"     # a user's setting stays
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
    assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "bfc"


@pytest.mark.slow    # 30-75 s on the 2-core machine: two `sparrow train` runs of a tiny model
def test_bench_step_puts_dense_and_sparse_steps_side_by_side(tmp_path, capsys):
    """`sparrow bench step` (issue 55): the same config, seed and prompts once dense and once
    sparse, each step's seconds by phase - the controller replay (`probe`) apart from the
    learner, each phase's compile seconds - side by side with the ratio, and the learner's
    model FLOPs."""
    from sparrow_jax import cli
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    argv = ["bench", "step", "configs/demo_cpu.gin", "--model_config", str(path), "--steps",
            "2", "--prompts", "1", "--new_tokens", "16", "--json", "--out", str(tmp_path / "s"),
            "--gin_param", "TrainConfig.group_size = 2",
            "--gin_param", "LearnerConfig.micro_batch_size = 0",
            "--gin_param", f"make_schedule.budgets = {[48] * 20}",
            "--gin_param", "make_schedule.bin_size = 16",
            "--gin_param", "RolloutConfig.max_budget = 64"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [(r["mode"], r["step"]) for r in rows] == [("dense", 1), ("sparse", 1),
                                                      ("dense", 2), ("sparse", 2)]
    for r in rows:
        assert {"time/rollout", "time/reward", "time/learner", "time/probe", "time/step"} <= set(r)
        assert r["learner/model_flops"] > 0 and r["time/learner_flops_per_s"] > 0
        assert r["ratio/time/step"] == pytest.approx(
            r["time/step"] / next(d["time/step"] for d in rows
                                  if d["mode"] == "dense" and d["step"] == r["step"]))
    # the first step compiles the rollout and the learner; the second compiles nothing new
    assert rows[0]["time/compile/rollout"] > 0 and rows[0]["time/compile/learner"] > 0
    # sparse mode replays the sparse actor for alpha: one forward more than dense
    assert rows[1]["learner/model_flops"] > rows[0]["learner/model_flops"]
    assert "sparse/dense" in out and "time/compile/learner" in out
