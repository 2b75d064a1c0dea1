"""`sparrow eval MODEL DATA... [CONFIG.gin]`: benchmark numbers (avg@n, pass@k, maj@k) for a
Hugging Face model directory or a training run's checkpoint on math data files.

    sparrow eval MODEL DATA [DATA ...] [CONFIG.gin ...] --out DIR [--n 8] [--k 1,4]
        [--temperature T] [--top_p P] [--top_k K] [--max_new_tokens N] [--seed S]
        [--schedule NAME|JSON] [--mode dense|sparse] [--engine paged|static]
        [--scorer dapo|math_verify|REWARD] [--problems_per_chunk B] [--reward_processes W]

Order of work: arguments, tokenizer, data (rows read, skipped by reason, duplicates dropped) -
every input error is one line and exit status 1 before the weights load - then the model,
then chunks of B problems x n samples on the paged engine (a problem's n samples share its
prompt pages), scored, written per chunk (sparrow_jax.evaluation.results). Sample j of problem
i (in data order after deduplication) is drawn with sampling key (seed, i*n + j, token index),
so a rerun into the same --out resumes after the last whole chunk and writes the same eval.json.
Sampling defaults: the flags, else the model's generation_config.json, else gin RolloutConfig.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EvalError(SystemExit):
    """A user-facing input error: one line, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"sparrow eval: {message}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--out", required=True, help="output directory (eval.json; rerun to resume)")
    a("--overwrite", action="store_true", help="let --out replace an earlier evaluation with "
      "other settings (only its own files), or write beside files no sparrow command wrote")
    a("--n", type=int, default=8, help="samples per problem")
    a("--k", default="1", help="comma-separated k for pass@k and maj@k, each <= n")
    a("--temperature", type=float, default=None)
    a("--top_p", type=float, default=None)
    a("--top_k", type=int, default=None)
    a("--max_new_tokens", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--schedule", default=None, help="budget schedule for sparse decoding: a name, JSON, or "
      "'run' (a run directory's schedule at the evaluated step)")
    a("--mode", choices=("dense", "sparse"), default=None,
      help="default: dense, or sparse when --schedule names a sparse schedule")
    a("--engine", choices=("paged", "static"), default="paged")
    a("--scorer", default=None, help="dapo, math_verify or a reward name for every row "
      "(default: by each row's data_source, see sparrow_jax.evaluation.scorers)")
    a("--problems_per_chunk", type=int, default=16, help="problems per generate call")
    a("--reward_processes", type=int, default=2,
      help="scoring worker processes (0: in this process, no timeout)")
    a("--reward_timeout_s", type=float, default=10.0)
    a("--step", type=int, default=None, help="checkpoint step of a run directory (latest)")
    a("--compile_cache_dir", default="auto", help="persistent XLA compilation cache: 'auto' "
      "(on for GPU/TPU, see sparrow_jax.runtime.compile_cache), a directory, or '' (off)")


def split_positionals(args: argparse.Namespace) -> None:
    """Positionals: MODEL, then data paths; `.gin` files are gin files."""
    items = list(args.gin_files)
    if len(items) < 2:
        raise EvalError("usage: sparrow eval MODEL DATA [DATA ...] [CONFIG.gin] --out DIR")
    args.model = items[0]
    args.gin_files = [p for p in items[1:] if p.endswith(".gin")]
    args.data = [p for p in items[1:] if not p.endswith(".gin")]
    if not args.data:
        raise EvalError("name at least one data file after MODEL")


def parse_ks(text: str, n: int) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise EvalError(f"--k must be comma-separated integers, got {text!r}") from None
    if n < 1:
        raise EvalError(f"--n must be >= 1, got {n}")
    bad = [k for k in ks if not 1 <= k <= n]
    if not ks or bad:
        raise EvalError(f"--k {text!r}: every k must be between 1 and --n {n} (bad: {bad})")
    return ks


def _model_dirs(model: str, step: int | None) -> tuple[Path, int | None]:
    """(directory whose tokenizer/config to read, run step or None for an HF directory)."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path, None
    if (path / "checkpoints").is_dir():
        from sparrow_jax.runtime import checkpoint as ckpt
        from sparrow_jax.runtime.base_model import base_model_dir
        with ckpt.CheckpointManager(path, read_only=True) as mngr:
            steps = mngr.all_steps()
            if not steps or (step is not None and step not in steps):
                raise EvalError(f"{model}: no checkpoint step {step if step else ''} "
                                f"(available: {steps})")
            step = steps[-1] if step is None else step
            try:
                return base_model_dir(mngr, step), step
            except ValueError as e:
                raise EvalError(str(e)) from None
    raise EvalError(f"MODEL {model!r} is neither a Hugging Face directory (config.json) nor a "
                    "run directory (checkpoints/)")


def load_data(args, tokenizer, capacity: int) -> tuple[list[dict], dict[str, Any]]:
    """Records after deduplication, and the data report (also printed)."""
    from sparrow_jax.data.prompts import load_prompt_records
    from sparrow_jax.data.rows import expand_paths
    from sparrow_jax.evaluation.results import file_sha256
    records, skipped, rows, too_long = [], [], 0, 0
    try:
        files = expand_paths(args.data)
        # File by file: every DATA file is a benchmark and must hold usable rows, and a row
        # without `data_source` is reported under its file's name.
        for f in files:
            part, report = load_prompt_records(f, tokenizer, max_prompt_len=capacity)
            for r in part:
                r["data_source"] = str((r["meta"] or {}).get("data_source")
                                       or os.path.basename(f).split(".")[0])
            records += part
            skipped += report.skipped
            rows, too_long = rows + report.rows, too_long + len(report.too_long)
    except (OSError, ValueError) as e:
        raise EvalError(str(e)) from None
    reasons = collections.Counter(why for _, _, why in skipped)
    for why, count in reasons.most_common():
        first = next((f"{f}:{r}" for f, r, w in skipped if w == why))
        print(f"sparrow eval: skipped {count} row(s): {why} (first: {first})", file=sys.stderr)
    seen: dict[str, dict] = {}
    kept, dup, conflicting = [], 0, 0
    for r in records:
        first = seen.get(r["prompt"])
        if first is not None:
            dup += 1
            conflicting += first["answer"] != r["answer"]
            continue
        seen[r["prompt"]] = r
        kept.append(r)
    if dup:
        print(f"sparrow eval: dropped {dup} duplicate row(s) (prompt identical to an earlier "
              f"row; {conflicting} with a different answer; the first is kept)", file=sys.stderr)
    info = {"files": {f: file_sha256(f) for f in files}, "rows": rows,
            "loaded": len(records), "skipped": dict(reasons), "too_long": too_long,
            "duplicates_dropped": dup, "duplicates_conflicting": conflicting,
            "problems": len(kept)}
    return kept, info


def sampling_settings(args, model_dir: Path) -> dict[str, Any]:
    """temperature/top_p/top_k: the flag, else the model's generation_config.json (`do_sample:
    false` there = greedy), else None: gin's RolloutConfig (a training config's T = 1 for RL
    exploration is not how the model is meant to be evaluated, so it comes last)."""
    gen_file = model_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    out = {key: getattr(args, key) if getattr(args, key) is not None else gen.get(key)
           for key in ("temperature", "top_p", "top_k")}
    if gen.get("do_sample") is False and args.temperature is None:
        out["temperature"] = 0.0    # the model's generation config decodes greedily
    return out


def main(args: argparse.Namespace) -> int:
    from sparrow_jax.data.prompts import PromptFormat
    from sparrow_jax.evaluation import results, scorers
    from sparrow_jax.model import load_tokenizer, read_config
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.runtime.faults import RunError, check_vocabulary, prompt_capacity

    from sparrow_jax.model.dir_check import model_problems
    from sparrow_jax.runtime import output_dir

    ks = parse_ks(args.k, args.n)
    if args.problems_per_chunk < 1:
        raise EvalError(f"--problems_per_chunk must be >= 1, got {args.problems_per_chunk}")
    overwrite = getattr(args, "overwrite", False)
    try:    # never into a training run, a model or another command's output (issue 58)
        output_dir.check(args.out, "eval", {}, overwrite=overwrite, compare=False)
    except output_dir.OutputDirError as e:
        raise EvalError(str(e)) from None
    model_dir, step = _model_dirs(args.model, args.step)
    # The model directory as `sparrow train` checks it (config.json, tokenizer files, a real
    # vocabulary), before anything is written or the weights load.
    problems = model_problems(str(model_dir))
    if problems:
        raise EvalError("; ".join(p.replace("TrainConfig.model_path", "MODEL") for p in problems))
    if args.schedule == "run":
        args.schedule = _run_schedule(args.model, step)
    try:
        mcfg = read_config(model_dir)
        tokenizer = load_tokenizer(model_dir)
        check_vocabulary(tokenizer, mcfg.vocab_size, str(model_dir),
                         {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id})
        max_new = args.max_new_tokens or RolloutConfig().max_new_tokens
        capacity = prompt_capacity(mcfg.max_position_embeddings, max_new, None)
    except (OSError, ValueError, RunError) as e:
        raise EvalError(str(e)) from None
    if args.scorer:
        try:
            from sparrow_jax.data import synthetic  # noqa: F401 - the synthetic task's rewards
            from sparrow_jax.rewards.registry import get_reward
            get_reward(scorers.SCORER_REWARDS.get(args.scorer, args.scorer))
        except (KeyError, ImportError) as e:
            raise EvalError(f"--scorer {args.scorer!r}: {e}") from None
    records, data_info = load_data(args, tokenizer, capacity)
    for r in records:
        # By the row's own data_source only: a file's name says nothing about its prompt format.
        r["scorer"] = scorers.scorer_for((r["meta"] or {}).get("data_source"), args.scorer)
    print(f"sparrow eval: {len(records)} problems ({data_info['rows']} rows) x {args.n} samples; "
          f"scorers: {dict(collections.Counter(r['scorer'] for r in records))}", file=sys.stderr)

    from sparrow_jax.evaluation import run_samples
    sampling = sampling_settings(args, model_dir)
    fingerprint = results.model_fingerprint(model_dir)
    if step is not None:    # the base model's files + the step's own parameter checksums
        fingerprint = results.combine(fingerprint, step_checksums(args.model, step))
    settings = {"model": os.path.abspath(args.model), "step": step,
                "model_fingerprint": fingerprint,
                "data": data_info["files"], "n": args.n, "seed": args.seed,
                "sampling": sampling, "max_new_tokens": max_new, "schedule": args.schedule,
                "mode": args.mode, "engine": args.engine, "scorer": args.scorer,
                "problems_per_chunk": args.problems_per_chunk,
                "prompt_format": dataclasses.asdict(PromptFormat())}
    try:    # an earlier evaluation with other settings is refused, unless --overwrite
        output_dir.claim(args.out, "eval", settings, overwrite=overwrite)
        done = results.check_settings(args.out, settings)
    except ValueError as e:
        raise EvalError(str(e)) from None
    if done:
        print(f"sparrow eval: resuming: {done} chunk(s) of {args.problems_per_chunk} problems "
              f"already in {args.out}", file=sys.stderr)
    from sparrow_jax.runtime import compile_cache
    compile_cache.configure(args.compile_cache_dir)   # a resumed eval loads its programs
    export_dir = None
    try:
        if step is not None:    # a run's checkpoint: its policy (LoRA merged) as an HF directory
            from sparrow_jax.tools import export
            export_dir = tempfile.mkdtemp(prefix="sparrow-eval-")
            r = export.export(args.model, Path(export_dir) / "model", step=step,
                              merge_lora=_has_adapter(args.model, step))
            weights_dir = r.out
        else:
            weights_dir = model_dir
        problems, timing = run_samples.run(args, weights_dir, tokenizer, records, sampling,
                                           max_new, args.out)
    finally:
        if export_dir:
            shutil.rmtree(export_dir, ignore_errors=True)
    metrics = results.summarize(problems, args.n, ks)
    results.write_json_atomic(Path(args.out) / "eval.json", {
        "settings": settings, "k": ks, "data": data_info, "metrics": metrics,
        "problems": problems})
    results.write_json_atomic(Path(args.out) / "timing.json", timing)
    _tensorboard(args.out, results.tensorboard_scalars(metrics, args.n, ks), step or 0)
    _print_table(metrics, args.n, ks, timing)
    return 0


def _run_schedule(run_dir: str, step: int | None) -> str:
    """The controller's schedule saved with a run's checkpoint `step`, as JSON."""
    if step is None:
        raise EvalError("--schedule run needs MODEL to be a run directory (checkpoints/)")
    from sparrow_jax.runtime import checkpoint as ckpt
    from sparrow_jax.sparsity.controller import ControllerState
    with ckpt.CheckpointManager(Path(run_dir), read_only=True) as mngr:
        extra = mngr.restore(step)[2]
    return ControllerState.from_dict(extra["controller"]).schedule.to_json()


def step_checksums(run_dir: str, step: int) -> str:
    """The parameter checksums the train loop stored with checkpoint `step`, as JSON text."""
    from sparrow_jax.runtime import checkpoint as ckpt
    from sparrow_jax.runtime.faults import CHECKSUM_KEY
    with ckpt.CheckpointManager(Path(run_dir), read_only=True) as mngr:
        extra = mngr.restore(step)[2]
    return json.dumps((extra.get(CHECKSUM_KEY) or {}).get("params"), sort_keys=True, default=str)


def _has_adapter(run_dir: str, step: int) -> bool:
    from sparrow_jax.runtime import checkpoint as ckpt
    from sparrow_jax.runtime.base_model import operative_config
    from sparrow_jax.runtime.gin_files import gin_binding
    with ckpt.CheckpointManager(Path(run_dir), read_only=True) as mngr:
        rank = gin_binding(operative_config(mngr, step) or "", "DistillConfig", "rank")
    return isinstance(rank, int) and rank > 0


def _tensorboard(out: str, scalars: dict[str, float], step: int) -> None:
    from sparrow_jax.runtime.metrics import MetricsWriter
    with MetricsWriter(out, enabled=True) as mw:
        mw.scalars(step, scalars)


def _print_table(metrics: dict[str, Any], n: int, ks: list[int], timing: dict) -> None:
    cols = [f"avg@{n}"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks]
    print(f"{'data_source':<24} {'problems':>8} " + " ".join(f"{c:>16}" for c in cols)
          + f" {'length':>8} {'truncated':>9}")
    rows = list(metrics["by_source"].items()) + [("overall", metrics["overall"])]
    for name, m in rows:
        print(f"{name:<24} {m['problems']:>8} " + " ".join(
            f"{m[c]:>8.3f} ± {m[c + '_se']:<5.3f}" for c in cols)
            + f" {m['response_length_mean']:>8.1f} {m['truncated_share']:>9.3f}")
    print(f"generated {timing['tokens']} tokens in {timing['seconds']:.1f} s = "
          f"{timing['tokens_per_s']:.1f} tokens/s this invocation ({timing['chunks_run']} "
          f"chunk(s) run, {timing['chunks_resumed']} resumed)")
