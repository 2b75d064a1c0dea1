"""The synthetic cyclic-lookup task: generator, solver, rewards, tokenizer round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparrow_jax.data import synthetic
from sparrow_jax.data.tokenizer import (
    build_synthetic_tokenizer,
    load_tokenizer,
    save_synthetic_tokenizer,
)
from sparrow_jax.rewards.pool import RewardPool
from sparrow_jax.rewards.registry import get_reward


def brute_force(digits, k):
    """Independent restatement of the task: simulate the scratchpad token by token."""
    out, s = [], 0
    for c in range(1, k + 1):
        out += [str(c // 10), str(c % 10), str(s)]
        for i, d in enumerate(digits):
            s = (s + d) % 10
            out += ["abcdefghijklmnopqrstuvwxyz"[i], str(d), str(s)]
    return " ".join(out + ["=", str(s)])


def test_known_small_problem():
    assert synthetic.format_prompt([3, 9], 2) == "a 3 b 9 | 0 2 >"
    assert synthetic.solve("a 3 b 9 | 0 2 >") == "0 1 0 a 3 3 b 9 2 0 2 2 a 3 5 b 9 4 = 4"


@pytest.mark.parametrize("k_range,letters", [((8, 13), 26), ((2, 2), 5), ((1, 12), 26)])
def test_solve_generated_problems(k_range, letters):
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = synthetic.make_problem(rng, k_range, letters)
        digits, k = synthetic.parse_prompt(p["prompt"])
        assert k_range[0] <= k <= k_range[1] and len(digits) == letters
        assert synthetic.solve(p["prompt"]) == p["solution"] == brute_force(digits, k)
        assert p["answer"] == p["solution"][-1]
        n_target = len(p["solution"].split())
        assert n_target == synthetic.target_tokens(k, letters) == k * (3 + 3 * letters) + 2
        assert len(p["prompt"].split()) == synthetic.prompt_tokens(letters)
    assert synthetic.cycle_tokens() == 81


def test_exact_reward():
    exact = get_reward("synthetic_exact")
    p = synthetic.make_problem(1, (8, 13))
    sol, prompt = p["solution"], p["prompt"]
    assert exact(sol, p["answer"], prompt=prompt) == 1.0
    assert exact(f"{sol} <eos>", p["answer"], prompt=f"<bos> {prompt}") == 1.0
    assert exact(f" {sol}  <eos> <pad> <pad>\n", p["answer"], prompt=prompt) == 1.0
    toks = sol.split()
    for pos in (5, len(toks) // 2, len(toks) - 1):  # a one-digit corruption anywhere
        bad = toks.copy()
        bad[pos] = str((int(bad[pos]) + 1) % 10)
        assert exact(" ".join(bad), p["answer"], prompt=prompt) == 0.0
    short = synthetic.make_problem(1, (3, 3))
    truncated = " ".join(short["solution"].split()[:-2])
    assert exact(truncated, short["answer"], prompt=short["prompt"]) == 0.0
    # Stopping early with the right final sum fools the answer reward but not the exact one.
    # (K - 10) cycles always end on the same sum mod 10 as K cycles.
    long = synthetic.make_problem(5, (11, 13))
    digits, k = synthetic.parse_prompt(long["prompt"])
    hack = synthetic.format_solution(digits, k - 10)
    assert get_reward("synthetic_answer")(hack, long["answer"], prompt=long["prompt"]) == 1.0
    assert exact(hack, long["answer"], prompt=long["prompt"]) == 0.0
    # Without a prompt the solution may come through meta.
    assert exact(sol, p["answer"], meta={"solution": sol}) == 1.0
    with pytest.raises(ValueError, match="needs the prompt"):
        exact(sol, p["answer"])


def test_prefix_reward_counts_the_right_tokens_before_the_first_wrong_one():
    prefix, exact = get_reward("synthetic_prefix"), get_reward("synthetic_exact")
    p = synthetic.make_problem(3, (6, 8))
    sol, prompt, n = p["solution"], p["prompt"], len(p["solution"].split())
    assert prefix(f" {sol}  <eos> <pad>", p["answer"], prompt=f"<bos> {prompt}") == 1.0
    toks = sol.split()
    for pos in (0, 7, n // 2, n - 1):      # one wrong digit: the tokens before it count
        bad = toks.copy()
        bad[pos] = str((int(bad[pos]) + 1) % 10) if bad[pos].isdigit() else "="
        assert prefix(" ".join(bad), p["answer"], prompt=prompt) == pos / n
        assert exact(" ".join(bad), p["answer"], prompt=prompt) == 0.0
    assert prefix(" ".join(toks[:10]), p["answer"], prompt=prompt) == 10 / n   # stops early
    assert prefix(sol + " 0 1 0", p["answer"], prompt=prompt) == n / (n + 3)  # runs past the end
    assert prefix("", p["answer"], prompt=prompt) == 0.0
    # the answer-only hack (stop 10 cycles early with the right final sum) scores its prefix only
    long = synthetic.make_problem(5, (11, 13))
    digits, k = synthetic.parse_prompt(long["prompt"])
    hack = synthetic.format_solution(digits, k - 10)
    got = prefix(hack, long["answer"], prompt=long["prompt"])
    assert got < (k - 9) / k and got == pytest.approx(
        next(i for i, (a, b) in enumerate(zip(hack.split(), long["solution"].split())) if a != b)
        / len(long["solution"].split()))


def test_answer_reward_is_answer_only():
    ans = get_reward("synthetic_answer")
    p = synthetic.make_problem(2, (4, 4), 6)
    assert ans(p["solution"] + " <eos>", p["answer"], prompt=p["prompt"]) == 1.0
    assert ans(f"0 1 0 = {p['answer']}", p["answer"], prompt=p["prompt"]) == 1.0
    assert ans(f"= {(int(p['answer']) + 1) % 10}", p["answer"], prompt=p["prompt"]) == 0.0
    assert ans("", p["answer"], prompt=p["prompt"]) == 0.0


def test_rewards_in_pool_inprocess():
    problems = synthetic.make_problems(4, seed=3, k_range=(2, 3), num_letters=26)
    items = [(p["solution"], p["answer"], p["prompt"]) for p in problems]
    items.append((problems[0]["solution"], problems[1]["answer"], problems[1]["prompt"]))
    with RewardPool("synthetic_exact", processes=0) as pool:
        report = pool.score(items)
    np.testing.assert_array_equal(report.rewards, [1, 1, 1, 1, 0])


def test_tokenizer_round_trip(tmp_path):
    tok = save_synthetic_tokenizer(str(tmp_path / "tok"))
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert len(loaded) == len(tok) == 43
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    p = synthetic.make_problem(4, (8, 13))
    for t in (tok, loaded):
        ids = t.encode(p["prompt"])
        assert ids[0] == t.bos_token_id and len(ids) == synthetic.prompt_tokens() + 1
        assert t.decode(ids, skip_special_tokens=True) == p["prompt"]
        target = t.encode(p["solution"], add_special_tokens=False)
        assert t.unk_token_id not in target and len(target) == synthetic.target_tokens(p["k"])
        assert t.decode(target) == p["solution"]
        assert (
            get_reward("synthetic_exact")(
                t.decode(target + [t.eos_token_id]), p["answer"], prompt=t.decode(ids)
            )
            == 1.0
        )


def test_sft_examples_and_jsonl(tmp_path):
    tok = build_synthetic_tokenizer()
    ex = synthetic.sft_examples(tok, 3, seed=5, k_range=(2, 2), num_letters=4)
    assert len(ex) == 3
    for prompt_ids, target_ids in ex:
        assert prompt_ids.dtype == target_ids.dtype == np.int32
        assert prompt_ids[0] == tok.bos_token_id and target_ids[-1] == tok.eos_token_id
        assert len(target_ids) == synthetic.target_tokens(2, 4) + 1
        assert synthetic.solve(tok.decode(prompt_ids)) == tok.decode(
            target_ids, skip_special_tokens=True
        )
    path = tmp_path / "s.jsonl"
    synthetic.write_jsonl(str(path), 5, seed=7, k_range=(2, 3))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and {"id", "prompt", "answer", "solution"} <= set(rows[0])
    synthetic.write_jsonl(str(tmp_path / "again.jsonl"), 5, seed=7, k_range=(2, 3))
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()  # seeded: reproducible
    assert all(synthetic.solve(r["prompt"]) == r["solution"] for r in rows)
