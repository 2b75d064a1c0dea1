"""The built-in math rewards: math-verify on the final answer, and the DAPO-Math rule.

  math_verify              the last `\\boxed{}` or `Answer:` line, whichever comes last
  math_verify_boxed        only the last `\\boxed{}`
  math_verify_answer_line  only the last `Answer: ...` line
  dapo                     the DAPO-Math rule (sparrow_jax.rewards.answers.dapo_score): +1 / -1

Registered when this module is imported, which the package's `__init__` does.
"""

from __future__ import annotations

import logging
import threading

from sparrow_jax.rewards.answers import (ANSWER_FORMATS, dapo_score, extract_answer,
                                         extract_last_boxed)
from sparrow_jax.rewards.registry import register_reward


def _normalize_plain(s: str) -> str:
    return "".join(s.split()).rstrip(".").strip("$")


class _ShortLogs(logging.Filter):
    """Cuts a log message to `LOG_CHARS` characters: math-verify logs the whole input it timed
    out on ("Timeout during parsing: <pred>"), and a hostile completion is thousands of them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > LOG_CHARS:
            record.msg = f"{message[:LOG_CHARS]} [... {len(message) - LOG_CHARS} more characters]"
            record.args = None
        return True


LOG_CHARS = 200
# Logger filters do not apply to child loggers' records: each math-verify module's own logger.
_MATH_VERIFY_LOGGERS = ("math_verify", "math_verify.parser", "math_verify.grader",
                        "math_verify.metric", "math_verify.utils")


def shorten_math_verify_logs() -> None:
    """Installs the `_ShortLogs` filter on math-verify's loggers (idempotent)."""
    for name in _MATH_VERIFY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ShortLogs) for f in logger.filters):
            logger.addFilter(_ShortLogs())


def _math_verify(completion_text: str, ground_truth: str, formats: tuple[str, ...]) -> float:
    """1.0 iff the completion's final answer (by `formats`, see sparrow_jax.rewards.answers)
    equals the ground truth per math-verify (symbolic/numeric: "\\frac{1}{2}" == "0.5"), else
    0.0."""
    answer = extract_answer(completion_text, formats)
    if answer is None or not answer.strip():
        return 0.0
    from math_verify import parse, verify  # lazy: sympy is slow to import

    shorten_math_verify_logs()    # here: also in spawned reward workers
    # math-verify's own timeouts use SIGALRM, which only works on the main thread.
    main = threading.current_thread() is threading.main_thread()
    limit = 5 if main else None
    gt = str(ground_truth).strip()
    gold_box = extract_last_boxed(gt)
    if gold_box is not None:
        gt = gold_box
    gold = parse(gt if "$" in gt else f"${gt}$", parsing_timeout=limit)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if gold and pred and verify(gold, pred, timeout_seconds=limit):
        return 1.0
    # Non-math ground truths (names, labels) that math-verify cannot parse: exact text match.
    return 1.0 if _normalize_plain(answer) == _normalize_plain(gt) else 0.0


@register_reward("math_verify", preload=("math_verify",))
def math_verify_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """The last `\\boxed{}` or `Answer:` line (whichever comes last) checked with math-verify."""
    del prompt, meta
    return _math_verify(completion_text, ground_truth, ANSWER_FORMATS)


@register_reward("math_verify_boxed", preload=("math_verify",))
def math_verify_boxed_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """Only the last `\\boxed{}` counts (prompts that ask for a box)."""
    del prompt, meta
    return _math_verify(completion_text, ground_truth, ("boxed",))


@register_reward("math_verify_answer_line", preload=("math_verify",))
def math_verify_answer_line_reward(
    completion_text: str, ground_truth: str, *, prompt: str = "", meta: dict | None = None
) -> float:
    """Only the last `Answer: ...` line counts (DAPO-style prompts, strictly)."""
    del prompt, meta
    return _math_verify(completion_text, ground_truth, ("answer_line",))


@register_reward("dapo")
def dapo_reward(completion_text: str, ground_truth: str, *, prompt: str = "",
                meta: dict | None = None) -> float:
    """The DAPO-Math rule (sparrow_jax.rewards.answers.dapo_score): +1 / -1, no math-verify."""
    del prompt, meta
    return dapo_score(completion_text, ground_truth)
