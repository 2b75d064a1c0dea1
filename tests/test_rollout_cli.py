"""`sparrow rollout` and `sparrow bench rollout` end to end through sparrow_jax.cli.main."""

import json
import os
from pathlib import Path

import gin
import pytest

from hf_fixtures import make_tiny_synthetic_model
from sparrow_jax import cli
from sparrow_jax.data.tokenizer import build_synthetic_tokenizer

EOS = 2
PROMPTS = [
    {"id": "p0", "prompt": "a 1 b 2 c 3 |", "answer": "6"},
    {"id": "p1", "messages": [{"role": "user", "content": "d 4 e 5"}], "answer": 9},
    {"id": "p2", "prompt": "f 6 >", "answer": "6"},
]


@pytest.fixture(autouse=True)
def _fresh_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_rollout_model")
    # A minimal template so chat ('messages') rows are exercised too.
    return make_tiny_synthetic_model(
        path, heads=4, kv_heads=2, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}=")


def _prompt_file(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def _rollout(model_dir, prompts, out, *extra):
    gin.clear_config()  # parsing locks the gin config; every CLI call starts from a clean one
    return cli.main(["rollout", "--model", str(model_dir), "--prompts", str(prompts),
                     "--out", str(out), *extra])


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_sparse_rollout_writes_one_row_per_sample(model_dir, tmp_path, capsys):
    prompts = _prompt_file(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "out" / "samples.jsonl"
    # 3 blocks of budget against contexts up to ~70 tokens (5 blocks): really sparse.
    args = ["--group_size", "2", "--batch_size", "2", "--seed", "3", "--mode", "sparse",
            "--schedule", '{"budgets": [48], "bin_size": 2000}',
            "--gin_param", "RolloutConfig.max_new_tokens = 64"]
    assert _rollout(model_dir, prompts, out, *args) == 0
    captured = capsys.readouterr()
    printed = captured.err + captured.out
    rows = _read(out)
    assert not (tmp_path / "out" / "samples.jsonl.partial").exists()
    # 3 prompts x 2 samples in prompt order (the padded 2nd batch's filler row is dropped).
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [
        (p, j) for p in ("p0", "p1", "p2") for j in (0, 1)]
    tok = build_synthetic_tokenizer()
    assert rows[2]["prompt"] == "d 4 e 5 =" and rows[2]["answer"] == "9"  # chat template row
    for r in rows:
        n = r["response_length"]
        assert 1 <= n <= 64 and len(r["token_ids"]) == n == len(r["logprobs"])
        assert all(lp <= 0 for lp in r["logprobs"])
        assert r["finish_reason"] == ("stop" if r["token_ids"][-1] == EOS else "length")
        assert EOS not in r["token_ids"][:-1]  # generation stops at the first eos
        assert r["completion"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        b = r["budgets"]
        assert b["mode"] == "sparse"
        if b["sparse_tokens"]:            # a row that stopped at its first token has none
            assert b["min"] == b["max"] == 48
        assert b["sparse_tokens"] + b["dense_tokens"] == n
    assert any(r["budgets"]["sparse_tokens"] > 0 for r in rows)
    assert "tokens/s" in printed and "backend=xla" in printed

    # Same seed -> the same samples (compiled program reused); another seed -> different ones.
    again = tmp_path / "again.jsonl"
    assert _rollout(model_dir, prompts, again, *args) == 0
    assert [r["token_ids"] for r in _read(again)] == [r["token_ids"] for r in rows]
    other = tmp_path / "other.jsonl"
    assert _rollout(model_dir, prompts, other, *args[:-2], "--seed", "4",
                    "--max_new_tokens", "64") == 0
    assert [r["token_ids"] for r in _read(other)] != [r["token_ids"] for r in rows]


def test_dense_rollout_by_default_without_schedule(model_dir, tmp_path):
    prompts = _prompt_file(tmp_path / "p.jsonl", PROMPTS[:1])
    out = tmp_path / "dense.jsonl"
    assert _rollout(model_dir, prompts, out, "--max_new_tokens", "8") == 0
    (row,) = _read(out)
    assert row["budgets"] == {"mode": "dense"} and row["response_length"] <= 8


def test_malformed_rows_raise_with_row_number_or_are_skipped(model_dir, tmp_path):
    prompts = _prompt_file(tmp_path / "p.jsonl", PROMPTS[:1],
                           extra_lines=["{not json", json.dumps({"answer": "1"})])
    with pytest.raises(SystemExit, match=r"row 2: bad JSON"):
        _rollout(model_dir, prompts, tmp_path / "x.jsonl")
    out = tmp_path / "skip.jsonl"
    assert _rollout(model_dir, prompts, out, "--on_error", "skip", "--max_new_tokens", "8") == 0
    assert [r["prompt_id"] for r in _read(out)] == ["p0"]


@pytest.mark.parametrize("case, extra, message", [
    ("missing_model", [], r"model directory .* does not exist"),
    ("missing_prompts", [], r"prompt file not found"),
    ("budget_over_max", ["--schedule", "[8192]"], r"exceeds RolloutConfig.max_budget=4096"),
    ("unknown_schedule", ["--schedule", "no-such-schedule"], r"bad --schedule"),
    ("sparse_needs_schedule", ["--mode", "sparse"], r"needs a sparse schedule"),
    ("bad_gin", ["--gin_param", "RolloutConfig.mode = 'fast'"], r"mode must be"),
])
def test_clear_errors(model_dir, tmp_path, case, extra, message):
    prompts = _prompt_file(tmp_path / "p.jsonl", PROMPTS)
    model = tmp_path / "nope" if case == "missing_model" else model_dir
    if case == "missing_prompts":
        prompts = str(tmp_path / "missing.jsonl")
    with pytest.raises(SystemExit, match=message):
        _rollout(model, prompts, tmp_path / "o.jsonl", *extra)
    assert not (tmp_path / "o.jsonl").exists()


def test_out_never_replaces_its_inputs_a_run_or_a_model(model_dir, tmp_path):
    """Issue #45 list 5 and 8: `--out` replaced its own --prompts, a run's metrics.jsonl, a
    model's config.json; a directory crashed after the whole rollout. Refused before loading."""
    import subprocess
    import sys
    prompts = _prompt_file(tmp_path / "p.jsonl", PROMPTS[:1])
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    kept = {p: p.read_bytes() for p in (Path(prompts), run / "metrics.jsonl",
                                        Path(model_dir) / "config.json")}
    # As the user ran it: the prompt file as --out.
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "sparrow_jax.cli", "rollout", "--model",
                           str(model_dir), "--prompts", prompts, "--out", prompts],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(repo)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "is the prompt file it reads (--prompts)" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for out, message in ((tmp_path, "is a directory; name a file"),
                         (Path(model_dir) / "config.json", "inside the model directory"),
                         (run / "metrics.jsonl", "exists in a training run")):
        with pytest.raises(SystemExit, match=message):
            _rollout(model_dir, prompts, out)
    assert {p: p.read_bytes() for p in kept} == kept


def test_model_without_a_tokenizer_is_named_before_loading(model_dir, tmp_path):
    """Issue #45 list 10: rollout shares train's tokenizer checks (a missing tokenizer said
    `prompt_lengths must be in [1, 0]`)."""
    import shutil
    from sparrow_jax.model.dir_check import TOKENIZER_FILES
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    prompts = _prompt_file(tmp_path / "p.jsonl", PROMPTS[:1])
    with pytest.raises(SystemExit, match="sparrow rollout: model directory .* has no tokenizer "
                                         "files"):
        _rollout(bare, prompts, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_rollout_json(capsys):
    # `--` because the dispatcher's REMAINDER argument only takes option-first args after it.
    argv = ["bench", "rollout", "--", "--json", "--layers", "3", "--hidden", "32", "--heads", "4",
            "--kv_heads", "2", "--head_dim", "16", "--vocab", "64", "--context", "160",
            "--budget", "48", "--batch", "2", "--new_tokens", "32", "--repeats", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(records) == 1
    r = records[0]
    assert r["context"] == 160 and r["budget"] == 48 and r["backend"] == "xla"
    assert r["config"]["num_hidden_layers"] == 3 and r["device"].startswith("cpu")
    assert r["prefill_s"] > 0 and r["dense_tok_s"] > 0 and r["sparse_tok_s"] > 0
    assert r["ratio"] == pytest.approx(r["sparse_tok_s"] / r["dense_tok_s"])
    # Decode is timed alone: per-step time and tokens/s describe the same measurement.
    assert r["dense_ms_per_step"] == pytest.approx(1e3 * 2 / r["dense_tok_s"])
    assert set(r["compile_s"]) == {"dense", "sparse:48:0,1"}
    assert "dense tok/s" in out  # the human-readable table is printed too
