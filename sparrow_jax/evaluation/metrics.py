"""Benchmark metrics over n sampled responses per problem: avg@n, unbiased pass@k, maj@k.

Pure functions on per-problem arrays; each metric is a mean over problems with its standard
error over problems (sample standard deviation / sqrt(problems); 0 with one problem).

  avg@n   mean over problems of the share of the n samples that are correct
  pass@k  the unbiased estimator of P(at least one of k draws is correct) from n >= k samples
          with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), evaluated as the product
          prod_{i=n-c+1..n} (1 - k/i), which never forms the huge binomials
  maj@k   majority vote among k samples' extracted answers; the problem scores the vote
          winner's correctness. Samples without an extracted answer do not vote (all without:
          0). Ties go to the answer that appears first in sample order. With n > k, the n
          samples are cut into floor(n/k) consecutive blocks of k and the blocks' votes are
          averaged (deterministic, and exact at k = n, where AIME's maj@32 is usually quoted).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `c` of `n` samples correct (1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:       # every k-subset holds a correct sample
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (i - k)/i: c factors in (0, 1], no overflow.
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def majority(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer among `answers` is correct (ties: the earliest answer).

    answers[i] None = sample i has no extracted answer and does not vote."""
    counts: dict[Hashable, int] = {}
    first_correct: dict[Hashable, bool] = {}
    for a, ok in zip(answers, correct):
        if a is None:
            continue
        if a not in counts:
            counts[a] = 0
            first_correct[a] = bool(ok)
        counts[a] += 1
    if not counts:
        return False
    best = max(counts.values())
    winner = next(a for a in counts if counts[a] == best)   # dicts keep first-seen order
    return first_correct[winner]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-problem values."""
    x = np.asarray(values, np.float64)
    if x.size == 0:
        raise ValueError("no problems to average")
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    return float(x.mean()), se


def problem_metrics(correct: Sequence[bool], answers: Sequence[Hashable | None],
                    ks: Sequence[int]) -> dict[str, float]:
    """Per-problem values from its n samples' correctness [n] and extracted answers [n]:
    {"avg": c/n, "pass@k": ..., "maj@k": ...} for every k in `ks` (each <= n)."""
    n, c = len(correct), int(sum(bool(x) for x in correct))
    if n == 0:
        raise ValueError("a problem with no samples")
    out = {"avg": c / n}
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"k={k} must be between 1 and n={n}")
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        blocks = [majority(answers[b * k:(b + 1) * k], correct[b * k:(b + 1) * k])
                  for b in range(n // k)]
        out[f"maj@{k}"] = float(np.mean(blocks))
    return out


def aggregate(per_problem: Sequence[dict[str, float]], n: int) -> dict[str, float]:
    """Means over problems with standard errors: {"avg@n", "avg@n_se", "pass@k", "pass@k_se",
    ...} from `problem_metrics` dicts."""
    if not per_problem:
        raise ValueError("no problems to aggregate")
    out: dict[str, float] = {}
    for key in per_problem[0]:
        name = f"avg@{n}" if key == "avg" else key
        out[name], out[f"{name}_se"] = mean_se([p[key] for p in per_problem])
    return out
