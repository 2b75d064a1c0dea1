"""What a loaded prompt record looks like to the model, and whether its answer can score.

`describe_first_prompt`: the first prompt exactly as the model will see it (the config's
`PromptFormat`, e.g. the chat template), and how its ground truth parses and scores under the
reward: a completion ending in `\\boxed{<answer>}` and one ending in `Answer: <answer>` must
score 1. `sparrow data check` prints it (sparrow_jax.tools.data_check); `log_first_prompt` is
the same description, logged by `sparrow train` at start-up.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_SHOWN_CHARS = 4000     # a rendered prompt longer than this is cut in the log


def parse_answer(answer: str) -> str | None:
    """How math-verify reads a ground truth (None: it cannot)."""
    from math_verify import parse  # lazy: sympy

    try:
        parsed = parse(answer if "$" in answer else f"${answer}$", parsing_timeout=5)
    except Exception as e:  # noqa: BLE001 - a description, never a crash
        return f"(parse error: {type(e).__name__})"
    return str(parsed[0]) if parsed else None


def describe_first_prompt(record: dict[str, Any], reward: str, *,
                          oneline: bool = False) -> tuple[list[str], list[str]]:
    """(info lines, problems) about one loaded record: its rendered prompt and its answer.
    oneline: the prompt as a Python literal (a log line stays one line)."""
    from sparrow_jax.data import synthetic  # noqa: F401 - registers the synthetic task's rewards
    from sparrow_jax.rewards.registry import get_reward

    text = record["prompt"]
    shown = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + " [...]"
    lines = [f"first prompt ({record['id']}, {len(record['prompt_ids'])} tokens) as the model "
             f"sees it:{' ' + repr(shown) if oneline else chr(10) + shown}"]
    answer = record["answer"]
    field = record.get("answer_field", "answer")
    problems: list[str] = []
    if reward.split(":")[-1].startswith("math_verify"):
        parsed = parse_answer(answer)
        lines.append(f"its answer ({field}): {answer!r}; math-verify reads it as {parsed!r}")
        if parsed is None:
            problems.append(f"math-verify cannot parse the answer {answer!r}: only an exact "
                            "text match can score it")
        fn = get_reward(reward)
        scores = {form: fn(completion, answer) for form, completion in
                  (("\\boxed{...}", f"So the answer is \\boxed{{{answer}}}."),
                   ("Answer: ...", f"So the answer is this.\nAnswer: {answer}"))}
        lines.append(f"reward {reward!r} on a completion ending in " + ", ".join(
            f"{form}: {score:g}" for form, score in scores.items()))
        asks_line = "answer:" in text.lower()
        if asks_line and scores["Answer: ..."] == 0:
            problems.append(f"the prompt asks for an 'Answer:' line but reward {reward!r} does "
                            "not read one: use TrainConfig.reward = 'math_verify'")
        if not any(scores.values()):
            problems.append(f"reward {reward!r} scores 0 even for the ground truth itself: "
                            "training would see no reward")
    else:
        lines.append(f"its answer ({field}): {answer!r} (reward {reward!r} is not a math_verify "
                     "reward: not scored here)")
    return lines, problems


def log_first_prompt(record: dict[str, Any], reward: str) -> None:
    """The start-up lines of `sparrow train`: what the model sees and how its answer scores."""
    try:
        lines, problems = describe_first_prompt(record, reward, oneline=True)
    except Exception as e:  # noqa: BLE001 - reward errors are reported by the reward pool itself
        log.warning("could not describe the first prompt: %s: %s", type(e).__name__, e)
        return
    for line in lines:
        log.info("%s", line)
    for p in problems:
        log.warning("%s", p)
