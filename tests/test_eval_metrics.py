"""avg@n, pass@k and maj@k against independent computations (brute force over subsets)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sparrow_jax.evaluation.metrics import (aggregate, majority, mean_se, pass_at_k,
                                            problem_metrics)


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """The share of all k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_enumeration(n):
    rng = np.random.default_rng(n)
    for _ in range(6):
        correct = list(rng.random(n) < rng.random())
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k),
                                                                  abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # C(1024, 512) overflows a float; the product form does not. Closed form for c = 1: k/n.
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(1024, 0, 16) == 0.0
    assert pass_at_k(1024, 1009, 16) == 1.0     # n - c < k: every subset holds a correct one
    exact = 1 - math.comb(1024 - 300, 32) / math.comb(1024, 32)   # Python's exact integers
    assert pass_at_k(1024, 300, 32) == pytest.approx(exact, rel=1e-12)


def test_bad_k_and_counts():
    for n, c, k in [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
    with pytest.raises(ValueError, match="k=3"):
        problem_metrics([True, False], ["1", "2"], [3])


def test_avg_is_mean_of_sample_scores_and_se_over_problems():
    rng = np.random.default_rng(0)
    scores = rng.random((7, 6)) < 0.4
    per = [problem_metrics(list(s), [None] * 6, [1, 6]) for s in scores]
    agg = aggregate(per, 6)
    assert agg["avg@6"] == pytest.approx(scores.mean())
    per_problem = scores.mean(axis=1)
    assert agg["avg@6_se"] == pytest.approx(per_problem.std(ddof=1) / math.sqrt(7))
    assert agg["pass@1"] == pytest.approx(scores.mean())      # pass@1 is avg@n
    assert mean_se([0.25]) == (0.25, 0.0)


def test_majority_vote_and_ties():
    # Clear majority, wrong.
    assert majority(["3", "4", "4"], [True, False, False]) is False
    # Tie 2-2: the answer seen first wins ("5" at sample 0), whatever the order after.
    assert majority(["5", "6", "6", "5"], [True, False, False, True]) is True
    assert majority(["6", "5", "5", "6"], [False, True, True, False]) is False
    # Samples without an answer do not vote; none at all scores 0.
    assert majority([None, None, "7"], [False, False, True]) is True
    assert majority([None, None], [False, False]) is False


def test_maj_at_k_averages_disjoint_blocks():
    answers = ["1", "1", "2", "2", "2", "3"]
    correct = [a == "1" for a in answers]
    m = problem_metrics(correct, answers, [1, 2, 3, 6])
    assert m["maj@1"] == pytest.approx(2 / 6)          # each sample alone
    assert m["maj@2"] == pytest.approx(1 / 3)          # blocks [1,1] [2,2] [2,3]
    assert m["maj@3"] == pytest.approx(1 / 2)          # [1,1,2] right, [2,2,3] wrong
    assert m["maj@6"] == 0.0                           # "2" wins 3-2
