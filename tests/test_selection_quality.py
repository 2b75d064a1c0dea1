"""The teacher-forced replay's block scorers (rollout.teacher_forced: centroid, quest, oracle) and
the scorer-comparison bench (bench.selection_quality) on a tiny random model, in seconds."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.bench import selection_quality as sq
from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
from sparrow_jax.evaluation.reference import reference_batch
from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM
from sparrow_jax.rollout.teacher_forced import oracle_block_mass, sparse_attention_fn

BS = 4


def test_oracle_block_mass_is_each_blocks_causal_softmax_share():
    rng = np.random.default_rng(0)
    b, c, hq, hkv, d, s = 2, 3, 4, 2, 8, 16
    q = rng.normal(size=(b, c, hq, d)).astype(np.float32)
    keys = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    pos = np.array([[3, 9, 15], [0, 7, 12]])
    got = np.asarray(oracle_block_mass(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(pos), BS))
    want = np.zeros((b, c, hkv, s // BS))
    for i in range(b):
        for t in range(c):
            for h in range(hq):
                g = h // (hq // hkv)
                logits = keys[i, g, :pos[i, t] + 1] @ q[i, t, h] / np.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                for j, pj in enumerate(p):
                    want[i, t, g, j // BS] += pj
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), hq // hkv, atol=1e-5)   # each head's mass sums to 1


@pytest.fixture(scope="module")
def tiny():
    tok = build_synthetic_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(3))
    digits = "3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 2 6 4 3 3 8 3 2 7 9 5"
    records = [{"id": str(i),
                "prompt_ids": tok.encode(f"a {i} b 2 | 5 >", add_special_tokens=False),
                "meta": {"solution": " ".join([digits] * (2 + i))}} for i in range(2)]
    batch = reference_batch(records, tok, eos_id=tok.eos_token_id, block_size=BS)
    return model, batch


@pytest.mark.parametrize("scorer", ["quest", "oracle"])
def test_a_budget_covering_the_length_is_dense_for_every_scorer(tiny, scorer):
    model, batch = tiny
    graphdef, state = nnx.split(model)
    kw = dict(dense_layers=(0,), block_size=BS, query_chunk=8)
    dense = sq.hidden_states(graphdef, state, batch, scorer=None, budget=0, **kw)
    wide = sq.hidden_states(graphdef, state, batch, scorer=scorer, budget=1024, **kw)
    np.testing.assert_allclose(np.asarray(wide), np.asarray(dense), atol=2e-5)


def test_bench_rows_tail_and_kv(tiny):
    model, batch = tiny
    rows = sq.run(model, batch, budgets=[12, 1024], scorers=["oracle"],
                  dense_sets=[(0,)], block_size=BS, query_chunk=8, report_bin=32,
                  log=lambda *_: None)
    assert [(r["scorer"], r["budget"]) for r in rows] == [("oracle", 12), ("oracle", 1024)]
    tokens = int(np.asarray(batch.mask).sum())
    for r in rows:
        assert r["tokens"] == tokens == sum(b["tokens"] for b in r["bins"])
        assert 0.0 <= r["below"] <= 1.0 and 0.0 < r["mean_alpha"] <= 1.0
        assert r["model_kv_read"] == pytest.approx(1 / 3 + 2 / 3 * r["sparse_kv_read"])
    wide = [r for r in rows if r["budget"] == 1024]
    assert all(r["below"] == 0.0 and r["mean_alpha"] > 0.9999 for r in wide)
    assert all(r["sparse_kv_read"] == 1.0 for r in wide)
    narrow = [r for r in rows if r["budget"] == 12]
    assert all(r["sparse_kv_read"] < 0.5 and r["mean_alpha"] < 1.0 for r in narrow)


def test_unknown_scorer_is_refused():
    with pytest.raises(ValueError, match="scorer must be one of"):
        sparse_attention_fn(budgets=jnp.ones((1,), jnp.int32), bin_size=16,
                            prompt_lengths=jnp.ones((1,), jnp.int32), max_selected=4,
                            scorer="topk")


def test_tail_table_bins_by_cache_length():
    alpha = np.array([[1.0, 0.5, 0.95, 0.8]])
    cached = np.array([[10, 11, 40, 41]])
    mask = np.array([[True, True, True, False]])
    t = sq.tail_table(alpha, cached, mask, report_bin=32, threshold=0.9)
    assert t["tokens"] == 3 and t["below"] == pytest.approx(1 / 3)
    assert [(b["from"], b["tokens"], b["below"]) for b in t["bins"]] == [(0, 2, 0.5), (32, 1, 0.0)]


def test_documented_command_parses():
    """docs/experiment.md's commands (registered in tests/test_docs.py)."""
    args = sq.parse_args("--model checkpoints/long_sft --data data/long/heldout64.jsonl --rows 4 "
                         "--budgets 256 512 --dense_layers 0,1 0".split())
    assert args.dense_sets == [(0, 1), (0,)] and args.budgets == [256, 512]
    assert args.scorers == ["centroid", "quest", "oracle"]
    args = sq.parse_args("--model runs/long_sparse_sft --rows 16 --budgets 256 --scorers centroid "
                         "--dense_layers 0,1".split())
    assert args.rows == 16 and args.scorers == ["centroid"] and args.dense_sets == [(0, 1)]
    args = sq.parse_args("--model runs/long_sparse1_sft --rows 16 --budgets 128 256 512 "
                         "--scorers centroid --dense_layers 0,1 0".split())
    assert args.budgets == [128, 256, 512] and args.dense_sets == [(0, 1), (0,)]
    with pytest.raises(SystemExit):
        sq.parse_args(["--budgets", "40"])
