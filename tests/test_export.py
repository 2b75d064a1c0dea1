"""`sparrow export`: a training checkpoint -> Hugging Face directory that transformers and load_hf
load, with the trained weights (not the base model's) and the base model's tokenizer/configs."""

from __future__ import annotations

import json
import shutil
import struct

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hf_fixtures import make_tiny_synthetic_model
from sparrow_jax import cli
from sparrow_jax.data import synthetic
from sparrow_jax.runtime.gin_files import gin_binding
from sparrow_jax.tools.export import ExportError, export
from sparrow_jax.model import Qwen3ForCausalLM, load_hf, read_config
from sparrow_jax.rewards.registry import register_reward
from sparrow_jax.runtime import checkpoint as ckpt


@register_reward("export_test_length")
def _length_reward(completion_text: str, ground_truth: str, *, prompt: str = "",
                   meta: dict | None = None) -> float:
    """Differs between the samples of a group (a random model's exact-match reward is 0 for all,
    so GRPO advantages - and the update - would be zero)."""
    return float(len(completion_text.split()) % 5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 1-step `sparrow train` run (checkpoint written by the train loop) of a tiny model."""
    root = tmp_path_factory.mktemp("export")
    make_tiny_synthetic_model(root / "model")
    # A generation_config.json with an extra stop id: the export must carry it over verbatim.
    (root / "model" / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0}))
    synthetic.write_jsonl(str(root / "train.jsonl"), 8, seed=0, k_range=(1, 1), num_letters=4)
    argv = ["train",
            "--gin_param", f"TrainConfig.run_dir = '{root / 'run'}'",
            "--gin_param", f"TrainConfig.model_path = '{root / 'model'}'",
            "--gin_param", f"TrainConfig.train_data = '{root / 'train.jsonl'}'",
            "--gin_param", "TrainConfig.eval_data = ''",
            "--gin_param", "TrainConfig.reward = 'export_test_length'",
            "--gin_param", "TrainConfig.reward_processes = 0",
            "--gin_param", "TrainConfig.prompts_per_step = 2",
            "--gin_param", "TrainConfig.group_size = 2",
            "--gin_param", "TrainConfig.total_steps = 1",
            "--gin_param", "RolloutConfig.max_new_tokens = 16",
            "--gin_param", "RolloutConfig.max_budget = 64",
            "--gin_param", "RolloutConfig.backend = 'xla'",
            "--gin_param", "RolloutConfig.mode = 'dense'",
            "--gin_param", "TrainConfig.rollout_mode = 'dense'",
            "--gin_param", "TrainConfig.adapt_schedule = False",
            "--gin_param", "LearnerConfig.learning_rate = 1e-2",
            "--gin_param", "LearnerConfig.micro_batch_size = 2"]
    gin.clear_config()
    assert cli.main(argv) == 0
    assert (root / "run" / "checkpoints" / "1").is_dir()
    return root


def _checkpoint_params(run_dir, step=None):
    """The checkpoint's params as saved (f32 unless stored otherwise), restored independently of
    sparrow_jax.tools.export: the abstract target comes from orbax's metadata."""
    with ckpt.CheckpointManager(run_dir, read_only=True) as m:
        meta = m.params_metadata(step)
        cfg = read_config(run_dir.parent / "model")
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg)))
        abstract = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.ShapeDtypeStruct(x.shape, meta[ckpt.tree_path_names(p)][1]), state)
        return graphdef, m.restore_params(step, abstract)


def _read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_export_matches_checkpoint_in_transformers_and_load_hf(run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "hf"
    gin.clear_config()
    assert cli.main(["export", str(run / "run"), "--out", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json", "sparrow_export.json"):
        assert (out / name).is_file(), name
    prov = json.loads((out / "sparrow_export.json").read_text())
    assert prov["step"] == 1 and prov["dtype"] == prov["stored_dtype"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 7]

    graphdef, params = _checkpoint_params(run / "run")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(prov["stored_dtype"])}
    ref = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float32), params))
    tokens = np.random.default_rng(0).integers(3, 43, (2, 11)).astype(np.int32)
    jax_logits = np.asarray(ref(jnp.asarray(tokens)))

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch_logits = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(torch_logits, jax_logits, atol=1e-5, rtol=0)

    # The training step moved the weights: the export is the policy, not the base model.
    base = load_hf(run / "model", dtype=jnp.float32)
    assert np.abs(np.asarray(base(jnp.asarray(tokens))) - jax_logits).max() > 1e-4

    # load_hf round trip: bit-identical parameters.
    again = load_hf(out, dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(nnx.state(again, nnx.Param)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32))

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == [2, 7]


def test_export_bfloat16_writes_bf16_tensors(run, tmp_path):
    r = export(run / "run", tmp_path / "bf16", dtype="bfloat16")
    header = _read_header(tmp_path / "bf16" / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16" and r.dtype == "bfloat16"
    # Same values as the f32 checkpoint, rounded once.
    _, params = _checkpoint_params(run / "run")
    got = load_hf(tmp_path / "bf16", dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(nnx.state(got, nnx.Param)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a),
                                      np.asarray(b.astype(jnp.bfloat16)).astype(np.float32))


def test_bf16_stored_checkpoint_restores_in_its_dtype(run, tmp_path):
    """Older runs saved bf16 master weights: the export reads the dtype from orbax's metadata."""
    run_dir = tmp_path / "old_run"
    model = load_hf(run / "model", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = nnx.state(model, nnx.Param)
    opt_state = optax.adamw(1e-3).init(params)
    with ckpt.CheckpointManager(run_dir) as m:
        m.save(3, params, opt_state, {"step": 3},
               operative_config=f"TrainConfig.model_path = \\\n    '{run / 'model'}'\n")
    r = export(run_dir, tmp_path / "out")
    assert (r.step, r.stored_dtype, r.dtype) == (3, "bfloat16", "bfloat16")
    header = _read_header(tmp_path / "out" / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    got = nnx.state(load_hf(tmp_path / "out", dtype=jnp.bfloat16), nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gin_binding_reads_wrapped_and_qualified_values():
    text = ("import sparrow_jax.train.config\n"
            "TrainConfig.reward = @some_fn\n"
            "sparrow_jax.train.config.TrainConfig.model_path = \\\n    '/a/very/long/path'\n"
            "scope/TrainConfig.model_path = '/scoped'\n")
    assert gin_binding(text, "TrainConfig", "model_path") == "/a/very/long/path"
    assert gin_binding(text, "TrainConfig", "eval_data") is None


def test_export_errors(run, tmp_path):
    run_dir = run / "run"
    with pytest.raises(ExportError, match=r"step 7 is not a checkpoint .* available steps: \[1\]"):
        export(run_dir, tmp_path / "a", step=7)
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    with pytest.raises(ExportError, match="no checkpoint directory"):
        export(empty_run, tmp_path / "b")
    (empty_run / "checkpoints").mkdir()
    with pytest.raises(ExportError, match="no checkpoint in"):
        export(empty_run, tmp_path / "b")
    with pytest.raises(ExportError, match="does not exist"):
        export(tmp_path / "nope", tmp_path / "b")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ExportError, match="not writable"):
        export(run_dir, blocker / "sub")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export(run_dir, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").exists()


def test_moved_base_model_needs_model_path(run, tmp_path, monkeypatch):
    """The run's TrainConfig.model_path is gone: a clear error naming --model_path, which works."""
    moved = tmp_path / "moved_run"
    shutil.copytree(run / "run", moved)
    model_copy = tmp_path / "model_copy"
    shutil.copytree(run / "model", model_copy)
    cfg_file = moved / "checkpoints" / "1" / "operative_config" / "operative_config.gin"
    cfg_file.write_text(cfg_file.read_text().replace(str(run / "model"), str(tmp_path / "gone")))
    (moved / "operative_config.gin").unlink()
    with pytest.raises(ExportError, match="is gone.*--model_path"):
        export(moved, tmp_path / "x")
    # Issue #45 list 9: trained with a relative model path, exported from another directory:
    # this said the base model "is gone". Now it names the relative path and the directory.
    text = cfg_file.read_text()
    cfg_file.write_text(text.replace(str(tmp_path / "gone"), "model"))
    monkeypatch.chdir(tmp_path / "moved_run")
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(moved), "--out", str(tmp_path / "rel")])
    assert (f"base model directory 'model' (TrainConfig.model_path of the run) is a relative "
            f"path, not found from the current directory {tmp_path / 'moved_run'}: run the "
            f"export from the directory the training ran in") in str(e.value), str(e.value)
    assert not (tmp_path / "rel").exists()
    cfg_file.write_text(text)
    assert export(moved, tmp_path / "x", model_path=model_copy).step == 1
    # The config of another model shape is caught before any array is read.
    make_tiny_synthetic_model(tmp_path / "other", hidden=64)
    with pytest.raises(ExportError, match="in checkpoint step 1 but"):
        export(moved, tmp_path / "y", model_path=tmp_path / "other")
