"""Benchmark scorers held to the reference behaviour, case by case (hand-written tables).

DAPO: the expected values follow verl's `reward_score/math_dapo.py` (DAPO's reference scorer),
worked out by hand from its rules, quirks included (a bold `**Answer:**` fails; "1, 2" and "12"
normalize alike). math-verify: mathematical equivalence of the last `\\boxed{}` as a person
grades it. The hostile case must time out in the reward pool instead of hanging.
"""

from __future__ import annotations

import threading
import time



from sparrow_jax.evaluation import scorers
from sparrow_jax.rewards.answers import dapo_score, normalize_dapo
from sparrow_jax.rewards.pool import RewardPool
from sparrow_jax.rewards.registry import get_reward

PAD300 = "x" * 300
CODE = "```python\nprint('Answer: 41')\n```\n"

# (response, ground truth, reference score)
DAPO_CASES = [
    ("Answer: 42", "42", 1),
    ("answer: 42", "42", 1),                       # any case
    ("ANSWER : 42", "42", 1),                      # spaces before the colon
    ("Answer:42", "42", 1),
    ("Answer:\n42", "42", 1),                      # \s* crosses the newline
    ("Answer: 42\n", "42", 1),
    ("Final Answer: 42", "42", 1),
    ("Answer: $42$", "42", 1),
    ("Answer: 1,000", "1000", 1),                  # thousands separators dropped
    ("Answer: 1000", "1,000", 1),                  # ... in the ground truth too
    ("Answer: 12", "1,2", 1),                      # quirk: a list of digits loses its commas
    ("Answer: x = 5", "5", 1),                     # text after the last "="
    ("Answer: 5 degrees", "5", 1),                 # units removed
    ("Answer: 5^\\circ", "5", 1),
    ("Answer: 12 inches", "12", 1),
    ("Answer: 7 ways", "7", 1),
    ("Answer: 5 dollars", "5", 1),
    ("Answer: \\$5", "5", 1),
    ("Answer: 10 \\text{ cm}", "10", 1),           # \text{cm} -> \text{} -> gone
    ("Answer: \\text{12 units}", "12", 1),
    ("Answer: \\text{B}", "B", 1),                 # \text{} unwrapped
    ("Answer: \\mbox{7}", "7", 1),
    ("Answer: \\textbf{7}", "7", 1),
    ("Answer: \\overline{3}", "3", 1),
    ("Answer: \\boxed{7}", "7", 1),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", 1),
    ("Answer: \\frac12", "\\frac{1}{2}", 1),       # shorthand TeX expanded
    ("Answer: 2\\sqrt{3}", "2\\sqrt3", 1),
    ("Answer: 0.5", "\\frac{1}{2}", -1),           # strings only: no numeric equivalence
    ("Answer: \\pi", "3.14159", -1),
    ("Answer: 3\\pi", "3\\pi", 1),
    ("Answer: a 5", "5", 1),                       # articles removed
    ("Answer: $x$ is $7$", "7", -1),               # only the first $...$ survives
    ("Answer: $7.$", "7", 1),                      # ".$" -> "$"
    ("Answer: 7.", "7", -1),                       # a bare final period stays
    ("Answer: **7**", "7", -1),                    # markdown bold is not stripped
    ("**Answer:** 7", "7", -1),                    # ... so "** 7" != "7"
    ("Answer: -5", "-5", 1),
    ("Answer: \u22125", "-5", -1),                 # a Unicode minus is another character
    ("Answer: 43", "42", -1),
    ("The answer is 42", "42", -1),                # no "Answer:" line
    ("Answer:", "42", -1),                         # nothing after the colon
    ("", "42", -1),                                # empty response
    ("Answer: 3\nAnswer: 4", "4", 1),              # the last one counts
    ("Answer: 4\nAnswer: 3", "4", -1),
    (CODE + "Answer: 42", "42", 1),                # code block before the final line
    ("Answer: 42\n" + CODE, "42", -1),             # ... after it: its Answer: is the last
    ("Answer: 42\n" + PAD300, "42", -1),           # outside the last 300 characters
    ("y" * 5000 + "\nAnswer: 42", "42", 1),        # a long response, answer at the end
    ("Answer: 42\n" + "z" * 292, "42", -1),        # the tail starts inside "Answer"
    ("Answer: The answer is 42", "42", -1),
    ("Answer: \\{1,2\\}", "\\{1,2\\}", 1),
]


def test_dapo_table():
    assert len(DAPO_CASES) >= 40
    wrong = [(resp[-60:], gt, want, dapo_score(resp, gt)) for resp, gt, want in DAPO_CASES
             if dapo_score(resp, gt) != want]
    assert not wrong, wrong
    # The registered reward is the same rule.
    fn = get_reward("dapo")
    assert [fn(r, g) for r, g, _ in DAPO_CASES] == [float(w) for _, _, w in DAPO_CASES]


def test_dapo_normalization_examples():
    assert normalize_dapo("\\frac12") == "\\frac{1}{2}"
    assert normalize_dapo("x = \\sqrt2") == "\\sqrt{2}"
    assert normalize_dapo("1,234,567") == "1234567"
    assert normalize_dapo("\\text{(A)}") == "(A)"


def test_dapo_hostile_input_is_fast():
    """The 300-character tail bounds the work: 10 MB of `Answer:` and `$` lines take no time."""
    hostile = ("Answer: $" * 1000 + "\n") * 1100
    start = time.perf_counter()
    assert dapo_score(hostile, "1") == -1
    assert time.perf_counter() - start < 1.0


# (response, ground truth, reference reward)
MATH_VERIFY_CASES = [
    ("\\boxed{42}", "42", 1),
    ("So \\boxed{42}.", "42", 1),
    ("\\boxed{43}", "42", 0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1),           # equivalent forms
    ("\\boxed{0.5}", "\\frac{1}{2}", 1),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", 1),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1),
    ("\\boxed{2^{10}}", "1024", 1),
    ("\\boxed{3.0}", "3", 1),
    ("\\boxed{-5}", "-5", 1),
    ("\\boxed{x=5}", "5", 1),                      # an equation's right-hand side
    ("\\boxed{5 \\text{ cm}}", "5", 1),            # units
    ("\\boxed{90^\\circ}", "90", 1),
    ("\\boxed{\\text{5}}", "5", 1),                # \text{}
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1),        # sets
    ("\\boxed{(1,2)}", "(1,2)", 1),
    ("\\boxed{[0,1)}", "[0,1)", 1),
    ("\\boxed{[0,1]}", "[0,1)", 0),
    ("\\boxed{\\infty}", "\\infty", 1),
    ("\\boxed{A}", "A", 1),                        # a choice letter
    ("\\boxed{B}", "A", 0),
    ("\\fbox{7}", "7", 1),
    ("\\boxed 7", "7", 1),
    ("\\boxed{3} first, then \\boxed{4}", "4", 1),  # several boxes: the last
    ("\\boxed{3} first, then \\boxed{4}", "3", 0),
    ("\\boxed{\\boxed{5}}", "5", 1),               # nested
    ("\\boxed{42}" + "x" * 1000, "42", 1),         # no 300-character window here
    ("The answer is 42", "42", 0),                 # no box
    ("Answer: 42", "42", 0),                       # only boxes count
    ("", "42", 0),                                 # empty
    ("\\boxed{42", "42", 0),                       # unterminated (truncated) box
    ("\\boxed{}", "42", 0),                        # empty box
    ("```\n\\boxed{41}\n```\n\\boxed{42}", "42", 1),  # a box in a code block before the last
    ("\\boxed{42}\n```\n\\boxed{41}\n```", "42", 0),  # ... or as the last box
    ("\\boxed{7}", "\\boxed{7}", 1),               # a boxed ground truth
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1),
    ("\\boxed{10\\%}", "10\\%", 1),
]


def test_math_verify_table():
    assert len(MATH_VERIFY_CASES) >= 40
    fn = get_reward(scorers.scorer_for(None, "math_verify"))
    # Off the main thread math-verify sets no SIGALRM timeouts of its own: on a loaded CI
    # machine a 5 s limit could turn a slow symbolic check into a 0 (timeouts: the next test).
    got: list[float] = []
    worker = threading.Thread(target=lambda: got.extend(fn(r, g) for r, g, _ in MATH_VERIFY_CASES))
    worker.start()
    worker.join()
    wrong = [(resp[-60:], gt, want, value) for (resp, gt, want), value
             in zip(MATH_VERIFY_CASES, got) if value != want]
    assert len(got) == len(MATH_VERIFY_CASES) and not wrong, wrong


def test_math_verify_hostile_input_times_out():
    """A tower of powers makes sympy compute for a long time: the pool kills it at the timeout
    and scores 0, and the next item is scored normally."""
    items = [("\\boxed{9^{9^{9^{9^{9}}}}}", "1"), ("\\boxed{42}", "42")]
    with RewardPool("math_verify_boxed", processes=1, timeout_s=2.0) as pool:
        report = pool.score(items)
    assert report.timeouts == 1 and report.timed_out == (0,)
    assert report.rewards.tolist() == [0.0, 1.0]


def test_scorer_choice_and_vote_answers():
    assert scorers.scorer_for("math_dapo") == "dapo"
    assert scorers.scorer_for("aime2024") == "dapo"
    assert scorers.scorer_for("HuggingFaceH4/MATH-500") == "math_verify_boxed"
    assert scorers.scorer_for("synthetic") == "synthetic_exact"
    assert scorers.scorer_for("math_dapo", "math_verify") == "math_verify_boxed"
    assert scorers.scorer_for(None, "synthetic_answer") == "synthetic_answer"
    assert scorers.answer_key("dapo", "blah\nAnswer: 1,000 dollars") == "1000"
    assert scorers.answer_key("dapo", "no answer") is None
    assert scorers.answer_key("math_verify_boxed", "\\boxed{ 1 / 2 }") == "1/2"
    assert scorers.answer_key("math_verify_boxed", "\\boxed{}") is None
    assert scorers.answer_key("synthetic_exact", " a b ") == "a b"


