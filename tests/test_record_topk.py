"""The per-token vocabulary top-k is recorded only where the learner reads it (issue 30):
`RolloutConfig.for_alpha_mode`; width 0 changes no sample on either engine, and the learner's
"full" analysis runs on such trajectories while "topk" refuses them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import make_tiny_qwen3
from sparrow_jax.model import load_hf
from sparrow_jax.rl.learner import Learner, LearnerConfig, SparseReplay
from sparrow_jax.rollout import RolloutConfig, generate

BUDGETS = np.full(20, 48, np.int32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_qwen3(path, layers=3, vocab=96, hidden=48, heads=4, kv_heads=2)
    return load_hf(path, dtype=jnp.float32)


def _generate(model, cfg):
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 96, (2, 30)).astype(np.int32)
    lens = np.array([30, 17], np.int32)
    return generate(model, toks, lens, cfg=cfg, budgets=BUDGETS, bin_size=64, group_size=2,
                    rng=jax.random.key(1))


def test_for_alpha_mode():
    cfg = RolloutConfig()
    assert cfg.for_alpha_mode("topk").record_topk == 20
    assert cfg.for_alpha_mode("full").record_topk == 0
    assert cfg.for_alpha_mode("none").record_topk == 0
    with pytest.raises(ValueError, match="record_topk"):
        dataclasses.replace(cfg, record_topk=0).for_alpha_mode("topk")
    with pytest.raises(ValueError, match="record_topk must be >= 0"):
        RolloutConfig(record_topk=-1)


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_width_zero_changes_no_sample(tiny, engine):
    base = RolloutConfig(max_new_tokens=40, backend="xla", max_budget=64, engine=engine,
                         chunk_steps=8)
    full = _generate(tiny, base)
    lean = _generate(tiny, base.for_alpha_mode("full"))
    assert lean.topk_logprobs.shape == lean.topk_ids.shape == full.tokens.shape + (0,)
    assert full.topk_ids.shape == full.tokens.shape + (20,)
    for f in ("tokens", "mask", "budgets", "response_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(lean, f)), np.asarray(getattr(full, f)))
    np.testing.assert_array_equal(np.asarray(lean.logprobs), np.asarray(full.logprobs))


def test_learner_full_alpha_on_width_zero_and_topk_refuses(tiny):
    cfg = RolloutConfig(max_new_tokens=40, backend="xla", max_budget=64)
    full, lean = _generate(tiny, cfg), _generate(tiny, cfg.for_alpha_mode("full"))
    replay = SparseReplay(bin_size=64, max_selected=4)
    learner = Learner(tiny, LearnerConfig(alpha_mode="full"), group_size=2)
    a, b = learner.analyze(full, BUDGETS, replay), learner.analyze(lean, BUDGETS, replay)
    for key in ("logp_old", "alpha", "logp_sparse_replay"):
        np.testing.assert_array_equal(np.asarray(getattr(a, key)), np.asarray(getattr(b, key)))
    with pytest.raises(ValueError, match="recorded none"):
        Learner(tiny, LearnerConfig(alpha_mode="topk"), group_size=2).analyze(lean)


def test_bench_rollout_before_and_after(capsys):
    """`sparrow bench rollout --before`: each sparse run also with the former top_k + sort
    selection and top-20 record, in one run (toy size)."""
    import json

    from sparrow_jax import cli
    argv = ["bench", "rollout", "--", "--json", "--layers", "3", "--hidden", "32", "--heads", "4",
            "--kv_heads", "2", "--head_dim", "16", "--vocab", "64", "--context", "96",
            "--budget", "48", "--batch", "2", "--new_tokens", "16", "--repeats", "1",
            "--dtype", "float32", "--before"]
    assert cli.main(argv) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(r["before"], r["record_topk"]) for r in records] == [(False, 0), (True, 20)]
    assert all(r["sparse_tok_s"] > 0 for r in records)
