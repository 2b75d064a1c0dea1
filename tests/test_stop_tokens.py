"""Stop tokens: tokenizer eos + every generation_config.json eos id, in `sparrow train`'s rollouts
and evaluations alike (sparrow_jax.model.stop_token_ids is the one function for train, rollout and
evaluation)."""

from __future__ import annotations

import json
from collections import Counter

import gin
import jax
import numpy as np
import pytest

from hf_fixtures import make_tiny_synthetic_model
from sparrow_jax import cli
from sparrow_jax.evaluation import heldout as evaluation
from sparrow_jax.data import synthetic
from sparrow_jax.data.prompts import PromptDataset
from sparrow_jax.model import load_hf, load_tokenizer, stop_token_ids
from sparrow_jax.rewards import scoring
from sparrow_jax.rollout import RolloutConfig, generate
from sparrow_jax.runtime.metrics import read_jsonl

MAX_NEW = 24


def test_stop_token_ids_reads_generation_config(tmp_path):
    make_tiny_synthetic_model(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert stop_token_ids(tok, tmp_path) == (tok.eos_token_id,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(tok, tmp_path) == (tok.eos_token_id, 9)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [9, tok.eos_token_id, 11]}))
    assert stop_token_ids(tok, str(tmp_path)) == (tok.eos_token_id, 9, 11)  # deduplicated


def _eval_rollout(model, batch, stops):
    """The run's dense evaluation at step 0: T = 1 sampling with the train loop's eval rng
    (`jax.random.key(TrainConfig.seed + 1)`). A random model's greedy output is one token
    repeated, so sampling is what puts a stop id in the middle of responses."""
    cfg = RolloutConfig(mode="dense", temperature=1.0, max_new_tokens=MAX_NEW, backend="xla",
                        stop_token_ids=stops, pad_token_id=0)
    traj = generate(model, batch["prompt_ids"], batch["prompt_lengths"], cfg=cfg,
                    budgets=np.full(20, 64, np.int32), bin_size=16, rng=jax.random.key(0 + 1))
    return np.asarray(traj.tokens), np.asarray(traj.response_lengths)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random model and a token it emits mid-response on the held-out prompts: listed in
    generation_config.json (it is not the tokenizer's eos), it must end responses there."""
    gin.clear_config()  # RolloutConfig below must not pick up another test's bindings
    root = tmp_path_factory.mktemp("stops")
    make_tiny_synthetic_model(root / "model")
    synthetic.write_jsonl(str(root / "train.jsonl"), 8, seed=0, k_range=(1, 1), num_letters=4)
    synthetic.write_jsonl(str(root / "eval.jsonl"), 4, seed=1, k_range=(1, 1), num_letters=4)
    tok = load_tokenizer(root / "model")
    records = PromptDataset.from_files(str(root / "eval.jsonl"), tok).records
    batch = evaluation.batch_records(records, tok.pad_token_id)
    model = load_hf(root / "model", dtype=np.float32)
    eos = tok.eos_token_id
    tokens, lengths = _eval_rollout(model, batch, (eos,))
    # The token whose first occurrence cuts the responses shortest.
    counts = Counter(int(t) for i, n in enumerate(lengths) for t in tokens[i, :n - 1])
    candidates = [t for t in counts if t not in (eos, tok.pad_token_id, tok.bos_token_id)]
    assert candidates, "the greedy responses have no token besides eos to stop on"

    def cut(t):
        return [int(np.argmax(tokens[i, :n] == t)) + 1 if t in tokens[i, :n - 1] else int(n)
                for i, n in enumerate(lengths)]

    # Prefer a token never sampled first: then every stop happens in the decode loop, not at the
    # prefill's first token.
    mid = [t for t in candidates if t not in tokens[:, 0]]
    assert mid, "every candidate token is some row's first token"
    stop = min(mid, key=lambda t: sum(cut(t)))
    expected = cut(stop)
    assert sum(expected) < lengths.sum()  # the extra stop id changes what the run must produce
    # The engine ends a row on the stop id (kept as the row's last token): the reference.
    _, stopped = _eval_rollout(model, batch, (eos, stop))
    assert stopped.tolist() == expected
    (root / "model" / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": [eos, stop],
                    "pad_token_id": tok.pad_token_id}))
    return root, stop, expected, lengths.tolist()


def test_train_stops_on_generation_config_ids(setup, monkeypatch):
    root, stop, expected, unstopped = setup
    seen = []  # (tokens, lengths) of every rollout the run decodes: training and evaluation
    decode = scoring.decode_responses

    def spy(tokenizer, traj):
        seen.append((np.asarray(traj.tokens), np.asarray(traj.response_lengths)))
        return decode(tokenizer, traj)

    monkeypatch.setattr(scoring, "decode_responses", spy)
    argv = ["train",
            "--gin_param", f"TrainConfig.run_dir = '{root / 'run'}'",
            "--gin_param", f"TrainConfig.model_path = '{root / 'model'}'",
            "--gin_param", f"TrainConfig.train_data = '{root / 'train.jsonl'}'",
            "--gin_param", f"TrainConfig.eval_data = '{root / 'eval.jsonl'}'",
            "--gin_param", "TrainConfig.eval_temperature = 1.0",
            "--gin_param", "TrainConfig.seed = 0",
            "--gin_param", "TrainConfig.reward = 'synthetic_exact'",
            "--gin_param", "TrainConfig.reward_processes = 0",
            "--gin_param", "TrainConfig.prompts_per_step = 2",
            "--gin_param", "TrainConfig.group_size = 4",
            "--gin_param", "TrainConfig.total_steps = 1",
            "--gin_param", "TrainConfig.rollout_mode = 'dense'",
            "--gin_param", "TrainConfig.adapt_schedule = False",
            "--gin_param", f"RolloutConfig.max_new_tokens = {MAX_NEW}",
            "--gin_param", "RolloutConfig.max_budget = 64",
            "--gin_param", "RolloutConfig.backend = 'xla'",
            "--gin_param", f"make_schedule.budgets = {[48] * 20}",
            "--gin_param", "make_schedule.bin_size = 16",
            "--gin_param", "LearnerConfig.micro_batch_size = 4"]
    gin.clear_config()
    assert cli.main(argv) == 0

    # The dense evaluation at step 0 (untrained model, fixed rng) reproduces the reference.
    rows = {r["step"]: r for r in read_jsonl(root / "run")}
    assert rows[0]["eval_dense/response_length"] == pytest.approx(np.mean(expected))
    assert rows[0]["eval_dense/response_length"] != pytest.approx(np.mean(unstopped))
    # No decoded response anywhere (train rollouts, dense and sparse evaluations) runs past the
    # stop id: it can only be a row's last token.
    assert len(seen) >= 3
    ended_on_stop = 0
    for tokens, lengths in seen:
        for row, n in zip(tokens, lengths):
            assert stop not in row[:n - 1].tolist(), (stop, row[:n].tolist())
            ended_on_stop += int(n > 0 and row[n - 1] == stop)
    assert ended_on_stop >= sum(e < u for e, u in zip(expected, unstopped))
