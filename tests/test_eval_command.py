"""`sparrow eval` end to end on tiny models: bad inputs, duplicates, resume after kill -9, the
demo checkpoint on a verl-layout Parquet file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hf_fixtures import make_tiny_synthetic_model
from sparrow_jax import cli
from sparrow_jax.data import synthetic

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# verl rows hold a chat list; the synthetic tokenizer has no chat template, so the test models
# get one that writes <bos> and the user's text, exactly what the task's plain prompts give.
PASSTHROUGH = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
SMALL = ["--n", "2", "--k", "1,2", "--max_new_tokens", "16", "--problems_per_chunk", "2",
         "--reward_processes", "0"]


def verl_rows(problems, source="synthetic"):
    return [{"data_source": source, "prompt": [{"role": "user", "content": p["prompt"]}],
             "reward_model": {"ground_truth": p["answer"], "style": "rule"},
             "extra_info": {"index": i}} for i, p in enumerate(problems)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    make_tiny_synthetic_model(root / "model", chat_template=PASSTHROUGH)
    rows = verl_rows(synthetic.make_problems(7, 0, (1, 1), 4))
    pq.write_table(pa.Table.from_pylist(rows + rows[:2]), root / "data.parquet")  # 2 duplicates
    return root


def run_eval(argv, capsys):
    rc = cli.main(["eval", *map(str, argv)])
    return rc, capsys.readouterr()


def test_bad_inputs_fail_in_one_line_before_the_model_loads(tiny, tmp_path, capsys, monkeypatch):
    from sparrow_jax.evaluation import run_samples

    def no_load(*a, **k):     # the sampling stage is where the weights load
        raise AssertionError("the model must not load for a bad input")
    monkeypatch.setattr(run_samples, "run", no_load)
    no_answer = tmp_path / "no_answer.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": "a 1 | 0 1 >"}]),
                   no_answer)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "a \xff", "answer": "1"}\n')
    mismatched = tmp_path / "mismatched"
    shutil.copytree(tiny / "model", mismatched)
    cfg = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**cfg, "vocab_size": 20}))
    data = tiny / "data.parquet"
    cases = [
        ([tiny / "model", no_answer], "missing answer field"),
        ([tiny / "model", tmp_path / "empty.jsonl"], "no usable prompts"),
        ([tiny / "model", tmp_path / "bad.jsonl"], "not UTF-8: byte 0xff"),
        ([tiny / "model", data, "--n", "2", "--k", "1,4"], "every k must be between 1 and --n 2"),
        ([mismatched, data], "vocab_size is 20"),
        ([tmp_path / "nowhere", data], "neither a Hugging Face directory"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            run_eval([*argv, "--out", tmp_path / "out"], capsys)
        text = str(e.value.code)
        assert text.startswith("sparrow eval: ") and message in text, (argv, text)
        assert "\n" not in text


@pytest.mark.slow
def test_resume_after_kill_gives_identical_eval_json(tiny, tmp_path, capsys):
    """An uninterrupted run (in this process) vs a subprocess killed with SIGKILL after its
    first chunk and resumed: the same eval.json, byte for byte; duplicates dropped."""
    argv = [tiny / "model", tiny / "data.parquet", *SMALL, "--scorer",
            "eval_worker_rewards:slow_exact"]
    rc, out = run_eval([*argv, "--out", tmp_path / "a"], capsys)
    assert rc == 0
    assert "dropped 2 duplicate row(s)" in out.err
    assert "synthetic" in out.out and "avg@2" in out.out
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "sparrow_jax.cli", "eval", *map(str, argv),
                             "--out", str(tmp_path / "b")], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = tmp_path / "b" / "chunks" / "00000.json"
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert first.exists(), err.decode()[-2000:]
    chunks = sorted((tmp_path / "b" / "chunks").glob("*.json"))
    assert 1 <= len(chunks) < 4 and not (tmp_path / "b" / "eval.json").exists()
    rc, out = run_eval([*argv, "--out", tmp_path / "b"], capsys)
    assert rc == 0 and "resuming" in out.err
    a = (tmp_path / "a" / "eval.json").read_bytes()
    assert a == (tmp_path / "b" / "eval.json").read_bytes()
    result = json.loads(a)
    assert result["data"]["duplicates_dropped"] == 2 and result["data"]["problems"] == 7
    assert [p["index"] for p in result["problems"]] == list(range(7))
    assert all(len(p["responses"]) == 2 for p in result["problems"])
    # Other settings into the same directory: refused, naming the setting.
    with pytest.raises(SystemExit, match="seed"):
        run_eval([*argv, "--out", tmp_path / "b", "--seed", "1"], capsys)


@pytest.mark.slow
def test_demo_checkpoint_on_verl_parquet(tmp_path, capsys):
    """The shipped demo checkpoint (with a pass-through chat template for the verl chat rows)
    on a verl-layout Parquet file of demo prompts: the table and eval.json's metrics."""
    model = tmp_path / "demo_sft"
    shutil.copytree(REPO / "checkpoints" / "demo_sft", model)
    tok = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok,
                                                             "chat_template": PASSTHROUGH}))
    problems = [json.loads(line) for line in
                (REPO / "data" / "demo" / "eval.jsonl").read_text().splitlines()[:3]]
    pq.write_table(pa.Table.from_pylist(verl_rows(problems)), tmp_path / "demo.parquet")
    rc, out = run_eval([model, tmp_path / "demo.parquet", "--out", tmp_path / "out", "--n", "2",
                        "--k", "1,2", "--max_new_tokens", "64", "--problems_per_chunk", "3",
                        "--reward_processes", "0"], capsys)
    assert rc == 0
    lines = out.out.splitlines()
    assert lines[0].split()[:4] == ["data_source", "problems", "avg@2", "pass@1"]
    assert lines[1].split()[:2] == ["synthetic", "3"] and lines[2].split()[:2] == ["overall", "3"]
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    m = result["metrics"]["by_source"]["synthetic"]
    # 64 tokens cannot hold a ~1000-token solution: every response is cut, none is right.
    assert m["truncated_share"] == 1.0 and m["avg@2"] == 0.0 and m["response_length_max"] == 64
    # The demo model writes the task's format: a cycle label, then "a <digit> <sum>" ...
    first = result["problems"][0]["responses"][0]["text"].split()
    assert first[3] == "a" and first[4].isdigit()
    scalars = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert scalars["val-core/synthetic/acc/mean@2"] == 0.0


@pytest.mark.slow
def test_run_directory_with_its_schedule(tmp_path, capsys):
    """MODEL = a `sparrow train` run directory: its checkpoint's policy, sparse decoding at the
    schedule saved with that step (`--schedule run`); the run itself evaluated with
    `TrainConfig.eval_samples = 2`."""
    import gin

    from hf_fixtures import gin_argv, make_tiny_run, tiny_train_bindings
    root = make_tiny_run(tmp_path, train_rows=4, eval_rows=2)
    binds = tiny_train_bindings(root, steps=2, TrainConfig__eval_data=repr(str(root / "eval.jsonl")),
                                TrainConfig__adapt_schedule="False", TrainConfig__eval_every="2",
                                TrainConfig__eval_samples="2", TrainConfig__eval_temperature="1.0")
    gin.clear_config()
    assert cli.main(["train", *gin_argv(binds)]) == 0
    # The train loop's evaluation with eval_samples = 2 logs avg@2 and pass@k (k = 1, 2).
    logged = {k for line in (root / "run" / "metrics.jsonl").read_text().splitlines()
              for k in json.loads(line)}
    assert {"eval_dense/avg@2", "eval_dense/pass@2", "eval_dense/pass@2_se"} <= logged, logged
    rc, out = run_eval([root / "run", root / "train.jsonl", "--out", tmp_path / "out",
                        "--schedule", "run", "--mode", "sparse", "--scorer", "synthetic_exact",
                        *SMALL], capsys)
    assert rc == 0 and "mode=sparse" in out.err
    settings = json.loads((tmp_path / "out" / "eval.json").read_text())["settings"]
    assert settings["step"] == 2
    # The fingerprint covers the step's parameters, not only the base model's files.
    from sparrow_jax.evaluation.results import model_fingerprint
    from sparrow_jax.tools.evaluate import step_checksums
    assert settings["model_fingerprint"] != model_fingerprint(root / "model")
    assert len(step_checksums(str(root / "run"), 2)) > 100     # real checksums, not "null"
    assert json.loads(settings["schedule"])["budgets"] == [48] * 20


def test_training_evaluation_agrees_with_sparrow_eval(tiny, tmp_path, capsys):
    """`TrainConfig.eval_samples = n` (heldout.evaluate) and `sparrow eval` on the same prompts,
    seed, engine and sampling draw the same samples, so avg@n and pass@k agree exactly."""
    import jax
    import numpy as np

    import eval_worker_rewards  # noqa: F401 - registers "parity"
    from sparrow_jax.data.prompts import load_prompt_records
    from sparrow_jax.data.prompts import PromptBatch
    from sparrow_jax.evaluation.heldout import evaluate
    from sparrow_jax.model import load_hf, load_tokenizer
    from sparrow_jax.rewards.pool import RewardPool
    from sparrow_jax.rollout.config import RolloutConfig

    rc, _ = run_eval([tiny / "model", tiny / "data.parquet", "--n", "4", "--k", "1,2,4",
                      "--max_new_tokens", "16", "--problems_per_chunk", "7", "--engine",
                      "static", "--seed", "3", "--reward_processes", "0", "--scorer",
                      "eval_worker_rewards:parity", "--out", tmp_path / "e"], capsys)
    assert rc == 0
    want = json.loads((tmp_path / "e" / "eval.json").read_text())["metrics"]["overall"]
    tok = load_tokenizer(tiny / "model")
    records = load_prompt_records(str(tiny / "data.parquet"), tok)[0][:7]   # without duplicates
    cfg = RolloutConfig(max_new_tokens=16, mode="dense", engine="static", record_topk=0,
                        stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    with RewardPool("parity", processes=0) as pool:
        got = evaluate(load_hf(tiny / "model"), tok, pool, PromptBatch.from_records(records, tok.pad_token_id),
                       cfg=cfg, budgets=np.array([2 ** 30], np.int32), bin_size=2000,
                       rng=jax.random.key(3), samples=4)
    assert 0 < want["avg@4"] < 1
    for key in ("avg@4", "avg@4_se", "pass@1", "pass@2", "pass@4", "pass@4_se"):
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


def test_data_sources_and_sampling_defaults(tiny, tmp_path):
    """A row without data_source is reported under its file's name (its scorer still comes from
    the row alone); a generation_config.json with do_sample false decodes greedily."""
    import argparse

    import gin

    from sparrow_jax.tools import evaluate as command
    from sparrow_jax.model import load_tokenizer
    from sparrow_jax.rollout import config  # noqa: F401 - registers RolloutConfig with gin

    plain = tmp_path / "bench_a.jsonl"
    plain.write_text("".join(json.dumps({"prompt": p["prompt"], "answer": p["answer"]}) + "\n"
                             for p in synthetic.make_problems(2, 9, (1, 1), 4)))
    args = argparse.Namespace(data=[str(plain), str(tiny / "data.parquet")])
    records, info = command.load_data(args, load_tokenizer(tiny / "model"), 1000)
    assert [r["data_source"] for r in records] == ["bench_a"] * 2 + ["synthetic"] * 7
    assert info["rows"] == 11 and info["duplicates_dropped"] == 2 and info["problems"] == 9
    (tmp_path / "none.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit, match="none.jsonl"):
        command.load_data(argparse.Namespace(data=[str(plain), str(tmp_path / "none.jsonl")]),
                           load_tokenizer(tiny / "model"), 1000)
    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    # A training config's sampling (T = 1) does not override the model's own.
    gin.clear_config()
    gin.parse_config(["RolloutConfig.temperature = 1.0"])
    flags = argparse.Namespace(temperature=None, top_p=None, top_k=None)
    assert command.sampling_settings(flags, model) == {"temperature": 0.0, "top_p": 0.95, "top_k": 20}
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    flags.top_k = 5
    assert command.sampling_settings(flags, model) == {"temperature": 0.6, "top_p": None, "top_k": 5}
    gin.clear_config()


def test_training_config_does_not_make_the_eval_sparse(tiny, tmp_path, capsys):
    """A run's gin file names a sparse schedule and T = 1: `sparrow eval` with it still decodes
    dense (no --schedule) at the model's generation config's temperature."""
    (tmp_path / "train.gin").write_text("make_schedule.budgets = [48, 48]\nmake_schedule.bin_size"
                                        " = 16\nRolloutConfig.temperature = 1.0\n")
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    rc, out = run_eval([model, tiny / "data.parquet", tmp_path / "train.gin", "--out",
                        tmp_path / "out", "--scorer", "synthetic_exact", *SMALL], capsys)
    assert rc == 0 and "mode=dense schedule=custom" in out.err and "temperature=0.5" in out.err
