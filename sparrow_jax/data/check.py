"""`sparrow data check`: validate a prompt set against the model's tokenizer before a run.

    sparrow data check FILE [FILE ...] [CONFIG.gin ...] --model DIR [--gin_param ...]

FILE may be a file, directory, glob or several (sparrow_jax.data.rows); without FILE the
config's `TrainConfig.train_data` and `eval_data` are checked, and without --model its
`TrainConfig.model_path`. Prints rows loaded / skipped with each reason, the first prompt
exactly as the model will see it (the config's `PromptFormat`, e.g. the chat template), and how
its ground truth parses and scores under the config's reward: a completion ending in
`\\boxed{<answer>}` and one ending in `Answer: <answer>` must score 1; and how many of the first
200 answers math-verify parses. Exit status 1 when no row loads or the first answer cannot
score; 0 otherwise (skipped rows and unparseable answers are listed, not fatal).

`log_first_prompt` is the same description, logged by `sparrow train` at start-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

_SHOWN_CHARS = 4000     # a rendered prompt longer than this is cut in the log
_SHOWN_SKIPS = 20
_PARSE_SAMPLE = 200     # answers checked with math-verify (a few ms each)


def _parse_answer(answer: str) -> str | None:
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
    from sparrow_jax.rl.rewards import get_reward

    text = record["prompt"]
    shown = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + " [...]"
    lines = [f"first prompt ({record['id']}, {len(record['prompt_ids'])} tokens) as the model "
             f"sees it:{' ' + repr(shown) if oneline else chr(10) + shown}"]
    answer = record["answer"]
    field = record.get("answer_field", "answer")
    problems: list[str] = []
    if reward.split(":")[-1].startswith("math_verify"):
        parsed = _parse_answer(answer)
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


# ------------------------------------------------------------------------------- the command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory whose tokenizer renders the prompts "
                             "(default: the config's TrainConfig.model_path)")
    parser.add_argument("--reward", default=None,
                        help="reward to score the answers with (default: TrainConfig.reward)")


def split_positionals(args: argparse.Namespace) -> None:
    """`sparrow data check FILE ... CONFIG.gin`: the positionals hold the action, data paths and
    gin files; only the `.gin` ones are gin files."""
    items = list(args.gin_files)
    if not items or items[0] != "check":
        raise SystemExit(f"sparrow data: expected `sparrow data check FILE --model DIR`, got "
                         f"{' '.join(items) or 'no action'}")
    args.action = items[0]
    args.gin_files = [p for p in items[1:] if p.endswith(".gin")]
    args.data = [p for p in items[1:] if not p.endswith(".gin")]


def _bound(name: str) -> Any:
    import gin

    try:
        return gin.query_parameter(name)
    except ValueError:
        return None


def _check_one(label: str, paths: Any, tokenizer: Any, capacity: int, reward: str,
               out: Any) -> bool:
    from sparrow_jax.data.prompts import load_prompt_records
    from sparrow_jax.data.rows import expand_paths

    print(f"== {label}: {paths}", file=out)
    try:
        files = expand_paths(paths)
        print(f"files: {len(files)} ({', '.join(files[:5])}{' ...' if len(files) > 5 else ''})",
              file=out)
        records, report = load_prompt_records(files, tokenizer, max_prompt_len=capacity)
    except (OSError, ValueError) as e:
        print(f"FAIL {type(e).__name__}: {e}", file=out)
        return False
    print(f"rows: {report.rows}; loaded: {report.loaded}; skipped (malformed): "
          f"{len(report.skipped)}; dropped (longer than {capacity} tokens): "
          f"{len(report.too_long)}", file=out)
    for f, row, why in report.skipped[:_SHOWN_SKIPS]:
        print(f"  skipped {f}:{row}: {why}", file=out)
    if len(report.skipped) > _SHOWN_SKIPS:
        print(f"  ... {len(report.skipped) - _SHOWN_SKIPS} more skipped rows", file=out)
    for f, row, n in report.too_long[:5]:
        print(f"  too long {f}:{row}: {n} tokens", file=out)
    lines, problems = describe_first_prompt(records[0], reward)
    print("\n".join(lines), file=out)
    if reward.split(":")[-1].startswith("math_verify"):
        sample = records[:_PARSE_SAMPLE]
        bad = [r for r in sample if _parse_answer(r["answer"]) is None]
        print(f"answers math-verify parses: {len(sample) - len(bad)} of the first {len(sample)}"
              + (f" (not: {', '.join(repr(r['answer'])[:40] for r in bad[:3])})" if bad else ""),
              file=out)
        if bad:
            problems.append(f"math-verify cannot parse {len(bad)} of {len(sample)} answers: "
                            "those score only on an exact text match")
    # An unparseable answer can still match as text (labels, names): a warning, not a failure.
    fatal = [p for p in problems if not p.startswith("math-verify cannot parse")]
    for p in problems:
        print(f"{'FAIL' if p in fatal else 'WARNING'} {p}", file=out)
    return not fatal


def main(args: argparse.Namespace) -> int:
    from sparrow_jax.model import load_tokenizer, read_config
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.runtime.faults import RunError, prompt_capacity

    model = args.model or _bound("TrainConfig.model_path")
    if not model:
        raise SystemExit("sparrow data check: name the model whose tokenizer renders the prompts "
                         "(--model DIR, or a config with TrainConfig.model_path)")
    if not os.path.isdir(model):
        raise SystemExit(f"sparrow data check: model directory {model!r} does not exist")
    reward = args.reward or _bound("TrainConfig.reward") or "math_verify"
    sets = [("data", args.data)] if args.data else [
        (name, _bound(f"TrainConfig.{name}")) for name in ("train_data", "eval_data")
        if _bound(f"TrainConfig.{name}")]
    if not sets:
        raise SystemExit("sparrow data check: name the data (FILE, or a config with "
                         "TrainConfig.train_data)")
    try:
        tokenizer = load_tokenizer(model)
        capacity = prompt_capacity(read_config(model).max_position_embeddings,
                                   RolloutConfig().max_new_tokens,
                                   _bound("make_prompt_iterator.max_prompt_len"))
    except (OSError, ValueError, RunError) as e:
        raise SystemExit(f"sparrow data check: {e}") from None
    print(f"tokenizer: {model} ({len(tokenizer)} tokens); reward: {reward}")
    ok = [_check_one(label, paths, tokenizer, capacity, reward, sys.stdout)
          for label, paths in sets]
    print("data check: " + ("PASS" if all(ok) else "FAIL"))
    return 0 if all(ok) else 1
