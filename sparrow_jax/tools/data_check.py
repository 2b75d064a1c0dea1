"""`sparrow data check`: validate a prompt set against the model's tokenizer before a run.

    sparrow data check FILE [FILE ...] [CONFIG.gin ...] --model DIR [--gin_param ...]

FILE may be a file, directory, glob or several (sparrow_jax.data.rows); without FILE the
config's `TrainConfig.train_data` and `eval_data` are checked, and without --model its
`TrainConfig.model_path`. Prints rows loaded / skipped with each reason, the first prompt
exactly as the model will see it and how its ground truth scores (sparrow_jax.data.check), and
how many of the first 200 answers math-verify parses. Exit status 1 when no row loads or the
first answer cannot score; 0 otherwise (skipped rows and unparseable answers are listed, not
fatal).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from sparrow_jax.data.check import describe_first_prompt, parse_answer

_SHOWN_SKIPS = 20
_PARSE_SAMPLE = 200     # answers checked with math-verify (a few ms each)


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
        bad = [r for r in sample if parse_answer(r["answer"]) is None]
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
