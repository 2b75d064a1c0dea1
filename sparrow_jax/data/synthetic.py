"""The CPU demo task: cyclic table lookup with a running sum (docs/data.md, "The synthetic task").

Text format (space-separated symbols, one token each; `n` letters, default 26):

    prompt   = "a 3 b 7 ... z 9 | 1 3 >"          table of n (letter, digit) pairs, `|`, K as
                                                   two digits, `>`            -> 2n + 4 tokens
    solution = for c = 1..K:  "c1 c2 s"            cycle label (two digits) + running sum s
                 then for every letter x in order: "x d_x s" with s = (s + d_x) mod 10
               then "= s"                          (the model then emits <eos>)

s starts at 0. One cycle is 3 + 3n tokens (81 for n = 26), the target K(3 + 3n) + 2 tokens plus
<eos> (K = 13: 1055 + eos). Every step reads its inputs at a constant relative offset: the
digit of x is copied from 3n + 3 tokens back (the previous cycle), the running sum from 3 back;
repeating s after the cycle label keeps that offset constant across cycle boundaries (an
irregular offset per cycle made the prototype plateau at 97% per-step accuracy).

Rewards (registered): "synthetic_exact" = 1 iff the whole generation equals the deterministic
solution (an answer-only reward is hacked by stopping early: sums mod 10 repeat), and the
diagnostic "synthetic_answer" = 1 iff the final "= s" is right.
"""

from __future__ import annotations

import argparse
import json
import re
import string
from typing import Any, Sequence

import numpy as np

from sparrow_jax.data.tokenizer import EOS, PAD
from sparrow_jax.rewards.registry import register_reward

MAX_LETTERS = 26
_PROMPT_RE = re.compile(r"((?:[a-z] \d )+)\| (\d) (\d) >")


def prompt_tokens(num_letters: int = MAX_LETTERS) -> int:
    """Tokens in a prompt, without <bos>."""
    return 2 * num_letters + 4


def cycle_tokens(num_letters: int = MAX_LETTERS) -> int:
    """Tokens per cycle of the solution (81 for 26 letters)."""
    return 3 + 3 * num_letters


def target_tokens(k: int, num_letters: int = MAX_LETTERS) -> int:
    """Tokens of the solution for K = k cycles, without <eos>."""
    return k * cycle_tokens(num_letters) + 2


def format_prompt(digits: Sequence[int], k: int) -> str:
    """Prompt text for a table of digits (one per letter a, b, ...) and K = k cycles."""
    if not 1 <= len(digits) <= MAX_LETTERS or not 1 <= k <= 99:
        raise ValueError(f"need 1..26 letters and 1 <= K <= 99 (got {len(digits)}, {k})")
    table = " ".join(f"{string.ascii_lowercase[i]} {d}" for i, d in enumerate(digits))
    return f"{table} | {k // 10} {k % 10} >"


def format_solution(digits: Sequence[int], k: int) -> str:
    """The deterministic target text (without <eos>)."""
    parts: list[str] = []
    s = 0
    for c in range(1, k + 1):
        parts.append(f"{c // 10} {c % 10} {s}")
        for i, d in enumerate(digits):
            s = (s + d) % 10
            parts.append(f"{string.ascii_lowercase[i]} {d} {s}")
    parts.append(f"= {s}")
    return " ".join(parts)


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """(digits, K) from a prompt; tolerates surrounding text (<bos>, a chat template).

    Raises ValueError if no well-formed table is found or the letters are not a, b, c, ...
    """
    matches = list(_PROMPT_RE.finditer(" ".join(prompt.split()) + " "))
    if not matches:
        raise ValueError(f"not a synthetic-task prompt: {prompt[:120]!r}")
    m = matches[-1]
    pairs = m.group(1).split()
    letters, digits = pairs[0::2], [int(d) for d in pairs[1::2]]
    if letters != list(string.ascii_lowercase[: len(letters)]):
        raise ValueError(f"table letters must be a, b, c, ... in order: {' '.join(letters)}")
    k = int(m.group(2)) * 10 + int(m.group(3))
    if k < 1:
        raise ValueError("cycle count K must be >= 1")
    return digits, k


def solve(prompt: str) -> str:
    """The deterministic solution text of a prompt."""
    digits, k = parse_prompt(prompt)
    return format_solution(digits, k)


def make_problem(
    rng: np.random.Generator | int,
    k_range: tuple[int, int] = (8, 13),
    num_letters: int = MAX_LETTERS,
) -> dict[str, Any]:
    """A random problem: dict(prompt, answer (final digit), solution (full target), k).

    K is drawn uniformly from the inclusive range `k_range`.
    """
    rng = np.random.default_rng(rng)
    k = int(rng.integers(k_range[0], k_range[1] + 1))
    digits = [int(d) for d in rng.integers(0, 10, size=num_letters)]
    solution = format_solution(digits, k)
    return {
        "prompt": format_prompt(digits, k),
        "answer": solution.rsplit(" ", 1)[1],
        "solution": solution,
        "k": k,
    }


def make_problems(
    n: int, seed: int, k_range: tuple[int, int] = (8, 13), num_letters: int = MAX_LETTERS
) -> list[dict[str, Any]]:
    """n problems from one seeded generator (the same seed gives the same list)."""
    rng = np.random.default_rng(seed)
    return [make_problem(rng, k_range, num_letters) for _ in range(n)]


def write_jsonl(
    path: str,
    n: int,
    seed: int,
    k_range: tuple[int, int] = (8, 13),
    num_letters: int = MAX_LETTERS,
) -> None:
    """Write n problems as JSONL rows {id, prompt, answer, solution, k} (data/prompts.py format)."""
    with open(path, "w") as f:
        for i, problem in enumerate(make_problems(n, seed, k_range, num_letters)):
            f.write(json.dumps({"id": f"synthetic-{seed}-{i}", **problem}) + "\n")


def sft_examples(
    tokenizer: Any,
    n: int | None = None,
    seed: int = 0,
    *,
    k_range: tuple[int, int] = (8, 13),
    num_letters: int = MAX_LETTERS,
    problems: Sequence[dict[str, Any]] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt_ids, target_ids) int32 pairs for supervised warm-up.

    prompt_ids = tokenizer(prompt) (with <bos>); target_ids = solution tokens + <eos>.
    Pass `problems` to reuse a fixed list, else n fresh problems from `seed`.
    """
    if problems is None:
        if n is None:
            raise ValueError("give n (and seed) or problems")
        problems = make_problems(n, seed, k_range, num_letters)
    out = []
    for p in problems:
        prompt_ids = tokenizer.encode(p["prompt"], add_special_tokens=True)
        target_ids = tokenizer.encode(p["solution"], add_special_tokens=False)
        target_ids.append(tokenizer.eos_token_id)
        out.append((np.asarray(prompt_ids, np.int32), np.asarray(target_ids, np.int32)))
    return out


def _clean_completion(text: str) -> str:
    """Cut at the first <eos> (generation stops there), drop padding, normalise whitespace."""
    text = text.split(EOS, 1)[0].replace(PAD, " ")
    return " ".join(text.split())


def _reference_solution(prompt: str, ground_truth: str, meta: dict | None) -> str:
    try:
        return solve(prompt)
    except ValueError:
        pass
    if meta and isinstance(meta.get("solution"), str):
        return " ".join(meta["solution"].split())
    if len(ground_truth.split()) > 1:  # a full solution given as the ground truth
        return " ".join(ground_truth.split())
    raise ValueError(
        "synthetic_exact needs the prompt (prompt=...) or meta['solution'] to know the solution"
    )


@register_reward("synthetic_exact")
def synthetic_exact_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """1.0 iff the completion is exactly the deterministic solution of the prompt."""
    expected = _reference_solution(prompt, ground_truth, meta)
    return 1.0 if _clean_completion(completion_text) == expected else 0.0


@register_reward("synthetic_prefix")
def synthetic_prefix_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """The share of the solution written right before the first wrong token: matched prefix /
    max(len(solution), len(completion)), in tokens. 1.0 iff the completion is exact (as
    `synthetic_exact`); no shortcut scores more than the correct tokens it contains (stopping
    early keeps only the prefix, running on past the end costs its extra tokens). A dense signal
    for long solutions, where a sampled answer is almost never exact (the long task: 4-4.5K
    tokens, docs/data.md)."""
    expected = _reference_solution(prompt, ground_truth, meta).split()
    got = _clean_completion(completion_text).split()
    matched = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                   min(len(got), len(expected)))
    return matched / max(len(expected), len(got))


@register_reward("synthetic_answer")
def synthetic_answer_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """Diagnostic (hackable by stopping early): 1.0 iff the last "= s" has the right digit."""
    del meta
    try:
        expected = solve(prompt).rsplit(" ", 1)[1]
    except ValueError:
        expected = ground_truth.strip()
    found = re.findall(r"= (\d)\b", _clean_completion(completion_text))
    return 1.0 if found and found[-1] == expected else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m sparrow_jax.data.synthetic OUT.jsonl --n 512 --seed 0 --k-min 8 --k-max 13`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k-min", type=int, default=8)
    parser.add_argument("--k-max", type=int, default=13)
    parser.add_argument("--letters", type=int, default=MAX_LETTERS)
    args = parser.parse_args(argv)
    write_jsonl(args.out, args.n, args.seed, (args.k_min, args.k_max), args.letters)
    print(
        f"wrote {args.n} problems to {args.out}: prompt {prompt_tokens(args.letters)} tokens "
        f"(+<bos>), {cycle_tokens(args.letters)} tokens/cycle, target "
        f"{target_tokens(args.k_min, args.letters)}-{target_tokens(args.k_max, args.letters)} "
        "tokens (+<eos>)"
    )


if __name__ == "__main__":
    main()
