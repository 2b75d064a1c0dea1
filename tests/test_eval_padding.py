"""Held-out evaluation whose prompt count does not divide the data shards: the batch is padded
(padded rows masked out of every metric) instead of raising.

The 8-device part runs in a subprocess (tests/eval_padding_check.py): the host devices come from
XLA_FLAGS, which must be set before jax is first imported.
"""

import os

import numpy as np
import pytest

from hf_fixtures import run_on_cpu_devices
from sparrow_jax.data.prompts import PromptBatch
from sparrow_jax.evaluation import heldout as evaluation

HERE = os.path.dirname(os.path.abspath(__file__))


def _records(n):
    return [{"prompt_ids": list(range(1, 3 + i)), "answer": f"a{i}", "prompt": f"p{i}",
             "meta": {"i": i}} for i in range(n)]


def test_prompt_batch_pads_with_masked_rows():
    b = PromptBatch.from_records(_records(3), pad_id=0, rows=5)
    assert b.prompt_ids.shape == (5, 4)
    assert b.valid.tolist() == [True, True, True, False, False]
    assert b.prompt_lengths.tolist() == [2, 3, 4, 2, 2]  # padding rows copy a real prompt
    assert b.answers[:3] == ("a0", "a1", "a2")
    # A short batch padded with its last row, and a row per sample of a 2-sample rollout.
    short = PromptBatch.from_records(_records(2), pad_id=0).padded_to(4)
    assert short.valid.tolist() == [True, True, False, False] and short.answers[3] == "a1"
    assert PromptBatch.from_records(_records(2), pad_id=0).per_sample(2).answers == (
        "a0", "a0", "a1", "a1")
    assert PromptBatch.from_records(_records(2), pad_id=0).valid.all()
    with pytest.raises(ValueError, match="fewer than"):
        PromptBatch.from_records(_records(3), pad_id=0, rows=2)


def test_shard_eval_batch_single_device_keeps_every_prompt():
    b = evaluation.shard_eval_batch(_records(5), pad_id=0)
    assert b.prompt_ids.shape[0] == 5 and b.valid.all()
    with pytest.raises(ValueError, match="no held-out prompts"):
        evaluation.shard_eval_batch([], pad_id=0)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_padding")
    return run_on_cpu_devices([os.path.join(HERE, "eval_padding_check.py"), str(out)])[-1]


def test_five_prompts_on_eight_way_data_mesh_equal_unsharded(result):
    assert result["mesh"] == {"data": 8, "model": 1}
    assert (result["rows"], result["valid"]) == (8, 5)        # 3 padded rows, masked
    for mode in ("dense", "sparse"):
        r = result[mode]
        assert r["sharded_reward"] == pytest.approx(r["reward"], abs=1e-6), (mode, r)
        assert r["sharded_length"] == pytest.approx(r["length"], abs=1e-6), (mode, r)
        # The check can fail: counting the padding rows would give another mean.
        assert not np.isclose(r["reward_if_padding_counted"], r["reward"]), (mode, r)


def test_summary_without_a_step_0_evaluation_says_so():
    """TrainConfig.eval_at_start = False: no "nan" start. (The trainer drops the speeds of its
    first, compiling evaluation, so no ratio comes from one: tests/test_experiment.py.)"""
    last = {"eval_dense/reward": 0.25, "eval_sparse/reward": 0.25, "eval_dense/ref_p_exact": 0.13,
            "eval_dense/ref_p_exact_se": 0.02, "eval_dense/ref_greedy": 0.2}
    lines, out = evaluation.summary_lines({}, last)
    text = "\n".join(lines)
    assert "nan" not in text and "(not evaluated at step 0) -> 0.250" in text
    assert not any("speed" in line for line in lines) and "speedup_sparse_over_dense" not in out
    last = {**last, "eval_dense/tokens_per_s": 900.0, "eval_sparse/tokens_per_s": 700.0}
    first = {"eval_dense/reward": 0.0, "eval_sparse/reward": 0.0}
    lines, out = evaluation.summary_lines(first, last)
    assert "0.000 -> 0.250" in lines[0] and out["speedup_sparse_over_dense"] == 700 / 900


def test_summary_gives_log_p_when_the_reference_probability_underflows():
    """The long task's 4.5K-token references have p ~ 1e-18: 0.0000 -> 0.0000 said nothing."""
    first = {"eval_dense/ref_p_exact": 1e-18, "eval_dense/ref_logp": -41.5,
             "eval_dense/ref_greedy": 0.0}
    last = {"eval_dense/ref_p_exact": 3e-17, "eval_dense/ref_logp": -38.25,
            "eval_dense/ref_logp_se": 1.5, "eval_dense/ref_greedy": 0.0}
    text = "\n".join(evaluation.summary_lines(first, last)[0])
    assert "log p(reference) (dense; p(T=1 sample = reference) < 5e-05): -41.50 -> -38.25 " \
           "(+- 1.50)" in text and "0.0000" not in text
    # a probability that prints keeps the probability line
    first["eval_dense/ref_p_exact"] = 0.02
    text = "\n".join(evaluation.summary_lines(first, last)[0])
    assert "p(T=1 sample = reference) (dense): 0.0200 -> 0.0000" in text
