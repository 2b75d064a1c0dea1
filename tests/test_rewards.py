"""Reward registry, boxed-answer extraction, math-verify equivalence and the timeout pool.

The slow/crashing rewards below live at module level so spawned pool workers can import them
(this file is importable as `test_rewards`: conftest puts tests/ on sys.path, which spawn passes
on to the children).
"""

from __future__ import annotations

import os
import time

import gin
import numpy as np
import pytest

from sparrow_jax.rl import rewards
from sparrow_jax.rl.rewards import RewardPool, extract_last_boxed, get_reward, register_reward


@register_reward("test_slow")
def slow_reward(completion_text, ground_truth, *, prompt="", meta=None):
    """Hangs on "hang", crashes the process on "crash", raises on "raise", else exact match."""
    if completion_text == "hang":
        time.sleep(60)
    if completion_text == "crash":
        os._exit(3)
    if completion_text == "raise":
        raise RuntimeError("bad reward")
    return float(completion_text == ground_truth)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\text{a}{b}{c{d}}}", "\\text{a}{b}{c{d}}"),
        ("answer \\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("no box here", None),
        ("\\boxed{3} and \\boxed{\\frac{1", None),  # truncated last box: no answer
        ("\\boxed", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    "completion,truth,expected",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\boxed{3}", "3.0", 1.0),
        ("\\boxed{3}", 3, 1.0),
        ("\\boxed{4}", "3", 0.0),
        ("3", "3", 0.0),  # no boxed answer
        ("\\boxed{7} wait, \\boxed{8}", "8", 1.0),
        ("\\boxed{12}", "\\boxed{12}", 1.0),
    ],
)
def test_math_verify_reward(completion, truth, expected):
    assert get_reward("math_verify")(completion, truth) == expected


def test_registry():
    assert get_reward("test_slow") is slow_reward
    assert {"math_verify", "synthetic_exact", "synthetic_answer"} <= set(rewards.reward_names())
    with pytest.raises(KeyError, match="unknown reward 'nope'.*math_verify"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math_verify")(lambda *a, **k: 0.0)
    assert get_reward("sparrow_jax.data.synthetic:synthetic_answer")("= 3", "3") == 1.0
    gin.clear_config()
    gin.parse_config("make_reward_fn.name = 'test_slow'")
    assert rewards.make_reward_fn() is slow_reward
    gin.clear_config()


def test_inprocess_pool_counts_errors():
    with RewardPool("test_slow", processes=0) as pool:
        r, info = pool.score([("a", "a"), ("raise", "a"), ("b", "a", "prompt", {"k": 1})])
    np.testing.assert_array_equal(r, [1, 0, 0])
    assert info["errors"] == 1 and info["failed"] == [1] and "bad reward" in info["first_error"]


def test_pool_timeout_crash_and_recovery():
    items = [("a", "a"), ("hang", "a"), ("b", "a"), ("crash", "a"), ("raise", "a"), ("c", "c")]
    with RewardPool("test_slow", processes=2, timeout_s=3.0) as pool:
        t0 = time.monotonic()
        r, info = pool.score(items)
        assert time.monotonic() - t0 < 30  # the hung item did not wait its 60 s
        np.testing.assert_array_equal(r, [1, 0, 0, 0, 0, 1])
        assert info["timeouts"] == 1 and info["timed_out"] == [1]
        assert info["errors"] == 2 and sorted(info["failed"]) == [3, 4]
        assert info["restarts"] == 2  # the hung and the crashed worker were replaced
        # The pool keeps working after the replacements.
        r2, info2 = pool.score([("x", "x"), ("y", "z")] * 3)
        np.testing.assert_array_equal(r2, [1, 0] * 3)
        assert info2["timeouts"] == info2["errors"] == 0
        assert pool.total["timeouts"] == 1


def test_pool_math_verify_and_huge_answer():
    huge = "\\boxed{" + "9" * 200_000 + "}"
    with RewardPool("math_verify", processes=1, timeout_s=20) as pool:
        r, info = pool.score([("\\boxed{\\frac{1}{2}}", "0.5"), (huge, "1"), ("\\boxed{2}", "2")])
    assert r[0] == 1.0 and r[1] == 0.0 and r[2] == 1.0


def test_pool_rejects_fork():
    with pytest.raises(ValueError, match="spawn"):
        RewardPool("test_slow", processes=1, start_method="fork")
