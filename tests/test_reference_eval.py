"""sparrow_jax.evaluation.reference on the shipped demo checkpoint: the teacher-forced pass over the
reference equals greedy decoding (dense, and the sparse actor at a budget) token for token up
to logit ties, and its exact p(T=1 sample = reference) matches T=1 sampling within 2 s.e."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.data.prompts import PromptDataset
from sparrow_jax.model import load_hf, load_tokenizer
from sparrow_jax.evaluation.reference import reference_batch, score_references, summarize
from sparrow_jax.rollout import RolloutConfig, generate

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "checkpoints/demo_sft"
PROMPTS = 8
SAMPLES = 12


@pytest.fixture(scope="module")
def demo():
    tok = load_tokenizer(str(CKPT))
    model = load_hf(str(CKPT), dtype=jnp.float32)
    recs = PromptDataset.from_files(str(REPO / "data/demo/heldout128.jsonl"), tok).records
    recs = [r for r in recs if r["meta"]["k"] == 10][:PROMPTS]      # ~870-token references
    ref = reference_batch(recs, tok, eos_id=tok.eos_token_id)
    width = max(len(r["prompt_ids"]) for r in recs)
    ids = np.zeros((len(recs), width), np.int32)
    for i, r in enumerate(recs):
        ids[i, :len(r["prompt_ids"])] = r["prompt_ids"]
    lens = np.asarray([len(r["prompt_ids"]) for r in recs], np.int32)
    return tok, model, ref, ids, lens


def _first_divergence(decoded: np.ndarray, ref_tokens: np.ndarray, ref_len: np.ndarray):
    out = []
    for d, r, n in zip(decoded, ref_tokens, ref_len):
        diff = np.flatnonzero(d[:n] != r[:n])
        out.append(int(diff[0]) if diff.size else int(n))
    return np.asarray(out)


@pytest.mark.parametrize("budget", [None, 128])
def test_teacher_forced_equals_greedy_decoding(demo, budget):
    tok, model, ref, ids, lens = demo
    t = int(ref.tokens.shape[1])
    mode = "dense" if budget is None else "sparse"
    cfg = RolloutConfig(max_new_tokens=t, temperature=0.0, mode=mode, backend="xla",
                        max_budget=128, stop_token_ids=(tok.eos_token_id,),
                        pad_token_id=tok.pad_token_id or 0)
    budgets = np.full(20, 128 if budget else 1 << 30)
    traj = generate(model, ids, lens, cfg=cfg, budgets=budgets, bin_size=64)
    scores = score_references(model, ref, budgets=None if budget is None else budgets,
                              bin_size=64, max_budget=128, rows_per_call=PROMPTS)
    got = _first_divergence(np.asarray(traj.tokens), np.asarray(ref.tokens),
                            np.asarray(ref.response_lengths))
    tie = np.abs(scores["margin"]) < 1e-4       # a logit tie may go either way
    assert (got[~tie] == scores["first_miss"][~tie]).all(), (got, scores["first_miss"])
    assert ((got == np.asarray(ref.response_lengths)) == scores["greedy"])[~tie].all()
    assert (~tie).sum() >= PROMPTS - 1


@pytest.mark.slow       # ~100 s of T=1 sampling: `launch/local.sh test --all`
def test_exact_probability_matches_sampling(demo):
    tok, model, ref, ids, lens = demo
    t = int(ref.tokens.shape[1])
    cfg = RolloutConfig(max_new_tokens=t, temperature=1.0, mode="dense", backend="xla",
                        max_budget=128, stop_token_ids=(tok.eos_token_id,),
                        pad_token_id=tok.pad_token_id or 0)
    traj = generate(model, ids, lens, cfg=cfg, budgets=np.full(20, 1 << 30), bin_size=64,
                    group_size=SAMPLES, rng=jax.random.key(0))
    p = score_references(model, ref, rows_per_call=PROMPTS)["p_exact"]
    ref_tok = np.repeat(np.asarray(ref.tokens), SAMPLES, 0)
    ref_len = np.repeat(np.asarray(ref.response_lengths), SAMPLES, 0)
    exact = (_first_divergence(np.asarray(traj.tokens), ref_tok, ref_len) == ref_len) & (
        np.asarray(traj.response_lengths) == ref_len)
    se = np.sqrt(np.sum(p * (1 - p) / SAMPLES)) / PROMPTS
    assert p.mean() > 0.02 and se > 0                # not a vacuous comparison
    assert abs(exact.mean() - p.mean()) <= 2 * se, (exact.mean(), p.mean(), se)
    assert set(summarize({"p_exact": p, "greedy": p > 0.5, "logp": np.log(p)})) >= {
        "ref_p_exact", "ref_p_exact_se", "ref_greedy", "ref_logp"}
