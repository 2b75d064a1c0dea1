"""`sparrow rollout`: sample completions for a JSONL prompt file and write them as JSONL.

    sparrow rollout [gin files] --model DIR --prompts FILE.jsonl --out OUT.jsonl \
        [--schedule NAME_OR_JSON] [--group_size N] [--batch_size B] [--seed S] [--mode sparse|dense]

Sampling settings (temperature, top_p, max_new_tokens, max_budget, backend, ...) come from the
gin-configurable `RolloutConfig`; the flags above override the most common ones. Each output row
is one sample: prompt id, sample index, prompt text, completion text, token ids, logprobs,
response length, finish reason and a summary of the KV budgets used.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import pallas_kernels
from sparrow_jax.data.prompts import PromptBatch
from sparrow_jax.model import stop_token_ids
from sparrow_jax.rollout import RolloutConfig, Trajectories, generate
from sparrow_jax.rollout.config import RolloutMode, padded_length, rollout_config
from sparrow_jax.runtime import output_dir
from sparrow_jax.sparsity.schedule import resolve_schedule

log = logging.getLogger(__name__)

_DTYPES = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


class RolloutError(SystemExit):
    """A user-facing configuration/input error: printed as one line, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"sparrow rollout: {message}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `sparrow rollout` (called by sparrow_jax.cli.build_parser)."""
    parser.add_argument("--model", required=True, help="local Hugging Face Qwen3 directory")
    parser.add_argument("--prompts", required=True,
                        help="JSONL file (or glob) of rows with 'prompt' or 'messages' + 'answer'")
    parser.add_argument("--out", required=True, help="output JSONL, one row per sample")
    parser.add_argument("--schedule", default=None,
                        help="budget schedule: a paper name (e.g. qwen3-1.7b-0.86), 'dense', a "
                             "JSON file or inline JSON ('[512, 1024]'); default: gin "
                             "make_schedule (dense unless configured)")
    parser.add_argument("--group_size", type=int, default=1, help="samples per prompt")
    parser.add_argument("--batch_size", type=int, default=4, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("sparse", "dense"), default=None,
                        help="default: RolloutConfig.mode, or dense when the schedule is dense")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="override RolloutConfig.max_new_tokens")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="auto",
                        help="compute dtype (auto: bf16 on accelerators, f32 on CPU)")
    parser.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                        help="shard over a device mesh, e.g. 2x4 (default: one device)")
    parser.add_argument("--on_error", choices=("skip", "raise"), default="raise",
                        help="malformed prompt rows: stop with the row number, or skip them")
    parser.add_argument("--chat_template", action="store_true",
                        help="render plain 'prompt' rows with the tokenizer's chat template too")
    parser.add_argument("--overwrite", action="store_true",
                        help="let --out replace an existing file inside a model or run "
                             "directory (never the prompts it reads)")


def check_out(out: str, prompts: Any, model: str, overwrite: bool) -> None:
    """Refuses, before anything loads, an --out that is a directory, one of the inputs (the
    prompt files, the model's files), or an existing file of a model or run directory unless
    --overwrite (issue #45: `--out` used to replace whatever it named)."""
    from sparrow_jax.data.rows import expand_paths
    path = os.path.realpath(os.path.abspath(out))
    if os.path.isdir(path):
        raise RolloutError(f"--out {out!r} is a directory; name a file (e.g. "
                           f"{os.path.join(out, 'samples.jsonl')})")
    try:
        inputs = [os.path.realpath(p) for p in expand_paths(prompts)]
    except (OSError, ValueError):
        inputs = []                  # reported with the prompts below
    if path in inputs:
        raise RolloutError(f"--out {out!r} is the prompt file it reads (--prompts); write the "
                           f"samples elsewhere")
    if os.path.dirname(path) == os.path.realpath(model):
        raise RolloutError(f"--out {out!r} is inside the model directory {model!r} it loads; "
                           f"write the samples elsewhere")
    # A model, a training run or another command's output (sparrow_jax.runtime.output_dir),
    # the file's directory or a few levels up.
    owner = output_dir.enclosing(path) if os.path.exists(path) else None
    if owner and not overwrite:
        raise RolloutError(f"--out {out!r} exists in {owner[1].what} ({owner[0]}): writing "
                           f"would replace that directory's file. Choose another --out (or "
                           f"pass --overwrite)")


# -- setup ---------------------------------------------------------------------------------------
def _mesh_spec(mesh_arg: str | None):
    if mesh_arg is None:
        return None, None
    from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh
    try:
        data, model = (int(x) for x in mesh_arg.lower().split("x"))
        mesh = make_mesh(data, model)
    except ValueError as e:
        raise RolloutError(f"bad --mesh {mesh_arg!r} (want DATAxMODEL, e.g. 2x4): {e}") from None
    return mesh, ShardingSpec.create(mesh)


# -- batches and output rows --------------------------------------------------------------------
def _batches(dataset, batch_size: int) -> Iterator[tuple[PromptBatch, int]]:
    """(batch padded to batch_size rows, number of real rows). Short final batches repeat their
    last prompt so the compiled program keeps one batch shape; the copies are dropped later.
    Widths are left to the engine, which pads them up to RolloutConfig.prompt_buckets."""
    it = dataset.iterator(batch_size=batch_size, shuffle=False, num_epochs=1,
                          drop_remainder=False, shard_index=0, shard_count=1)
    for batch in it:
        yield batch.padded_to(batch_size), len(batch)


def _budget_summary(budgets: np.ndarray, cached: np.ndarray, block_size: int, mode: str
                    ) -> dict[str, Any]:
    """Per-sample summary. A token is really sparse when its budget held fewer blocks than the
    context it attended to (otherwise block selection picks every block: exact dense)."""
    if mode == RolloutMode.DENSE:
        return {"mode": "dense"}
    live = budgets[budgets > 0]  # 0 = the first token, sampled from the dense prefill
    blocks = -(-cached // block_size)
    sparse = int(np.sum((budgets > 0) & (budgets // block_size < blocks)))
    return {"mode": "sparse", "min": int(live.min()) if live.size else 0,
            "max": int(live.max()) if live.size else 0,
            "mean": round(float(live.mean()), 1) if live.size else 0.0,
            "sparse_tokens": sparse, "dense_tokens": int(len(budgets) - sparse)}


def sample_rows(traj: Trajectories, batch: PromptBatch, real: int, group_size: int,
                tokenizer: Any, cfg: RolloutConfig) -> list[dict[str, Any]]:
    """One JSON-ready dict per real sample of a finished batch."""
    host = jax.device_get({"tokens": traj.tokens, "logprobs": traj.logprobs,
                           "budgets": traj.budgets, "cached": traj.cached_lengths,
                           "n": traj.response_lengths})
    stops = set(cfg.stop_token_ids)
    rows = []
    for row in range(real * group_size):
        p, j = divmod(row, group_size)
        n = int(host["n"][row])
        ids = host["tokens"][row, :n].tolist()
        rows.append({
            "prompt_id": batch.ids[p], "sample_index": j, "prompt": batch.prompts[p],
            "answer": batch.answers[p],
            "completion": tokenizer.decode(ids, skip_special_tokens=True),
            "token_ids": ids,
            "logprobs": [round(float(x), 6) for x in host["logprobs"][row, :n]],
            "response_length": n,
            "finish_reason": "stop" if ids and ids[-1] in stops else "length",
            "budgets": _budget_summary(host["budgets"][row, :n], host["cached"][row, :n],
                                       cfg.block_size, cfg.mode),
        })
    return rows


# -- main ----------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    from sparrow_jax.data.prompts import PromptDataset, PromptFormat
    from sparrow_jax.model import load_hf, load_tokenizer, read_config

    if args.group_size < 1 or args.batch_size < 1:
        raise RolloutError("--group_size and --batch_size must be >= 1")
    if not os.path.isdir(args.model):
        raise RolloutError(f"model directory {args.model!r} does not exist")
    check_out(args.out, args.prompts, args.model, getattr(args, "overwrite", False))
    # The model directory as `sparrow train` checks it (config.json, tokenizer files, a real
    # vocabulary), before the weights load.
    from sparrow_jax.model.dir_check import model_problems
    problems = model_problems(args.model)
    if problems:
        raise RolloutError("; ".join(p.replace("TrainConfig.model_path", "--model")
                                     for p in problems))
    try:
        schedule = resolve_schedule(args.schedule)
    except (ValueError, OSError) as e:
        raise RolloutError(f"bad --schedule: {e}") from None
    from sparrow_jax.runtime.faults import RunError, check_vocabulary
    try:
        mcfg = read_config(args.model)
        tokenizer = load_tokenizer(args.model)
        # A tokenizer larger than the model's vocabulary (ids with no embedding row) said only
        # `top_k` deep in sampling (issue 58).
        check_vocabulary(tokenizer, mcfg.vocab_size, args.model,
                         {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id})
    except RunError as e:
        raise RolloutError(str(e)) from None
    except (OSError, ValueError) as e:
        raise RolloutError(f"cannot load model/tokenizer from {args.model!r}: {e}") from None
    try:
        dataset = PromptDataset.from_files(
            args.prompts, tokenizer, fmt=PromptFormat(use_chat_template=args.chat_template),
            on_error=args.on_error)
    except (FileNotFoundError, ValueError) as e:
        raise RolloutError(str(e)) from None

    stop_ids = stop_token_ids(tokenizer, args.model)
    if not stop_ids:
        log.warning("tokenizer has no eos token: every sample runs to max_new_tokens")
    longest = max(len(r["prompt_ids"]) for r in dataset.records)
    try:
        cfg, budgets = rollout_config(schedule, stop_ids, dataset.pad_id, longest,
                                      max_new_tokens=args.max_new_tokens, mode=args.mode)
    except ValueError as e:
        raise RolloutError(str(e)) from None
    longest = padded_length(longest, cfg.block_size)
    if longest + cfg.max_new_tokens > mcfg.max_position_embeddings:
        log.warning("prompt + max_new_tokens = %d exceeds max_position_embeddings=%d",
                    longest + cfg.max_new_tokens, mcfg.max_position_embeddings)
    mesh, spec = _mesh_spec(args.mesh)
    if spec is not None and (args.batch_size * args.group_size) % mesh.shape["data"]:
        raise RolloutError(f"batch_size x group_size = {args.batch_size * args.group_size} is not "
                           f"divisible by the mesh data axis {mesh.shape['data']}")
    try:
        model = load_hf(args.model, dtype=_DTYPES[args.dtype], mesh=mesh)
        backend = pallas_kernels.resolve_backend(cfg.backend)
    except (OSError, ValueError, pallas_kernels.BackendUnavailableError) as e:
        raise RolloutError(str(e)) from None
    # Printed, not only logged: which kernel ran decides every speed number the user sees, and
    # the root logger may sit at WARNING when a dependency installed a handler first.
    print(f"sparrow rollout: {len(dataset)} prompts x {args.group_size} samples, mode={cfg.mode}, "
          f"schedule={schedule.name or 'custom'}, kernel backend={backend} (requested "
          f"{cfg.backend!r}, platform {jax.default_backend()}), max_new_tokens="
          f"{cfg.max_new_tokens}, stop ids {list(cfg.stop_token_ids)}", file=sys.stderr)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    partial = args.out + ".partial"  # renamed on success: a crashed run never looks complete
    rng = jax.random.key(args.seed)
    total_tokens, samples, first_batch_s = 0, 0, None
    start = time.perf_counter()
    with open(partial, "w") as out, tqdm(total=len(dataset), unit="prompt",
                                         desc="rollout") as bar:
        for i, (batch, real) in enumerate(_batches(dataset, args.batch_size)):
            t0 = time.perf_counter()
            try:
                traj = generate(model, batch.prompt_ids, batch.prompt_lengths, cfg=cfg,
                                budgets=budgets, bin_size=schedule.bin_size,
                                group_size=args.group_size, rng=jax.random.fold_in(rng, i),
                                spec=spec)
                rows = sample_rows(traj, batch, real, args.group_size, tokenizer, cfg)
            except (ValueError, MemoryError) as e:
                raise RolloutError(str(e)) from None
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - t0
            for r in rows:
                out.write(json.dumps(r) + "\n")
            out.flush()
            total_tokens += sum(r["response_length"] for r in rows)
            samples += len(rows)
            bar.update(real)
            bar.set_postfix(tok_s=f"{total_tokens / (time.perf_counter() - start):.1f}")
    os.replace(partial, args.out)
    elapsed = time.perf_counter() - start
    print(f"sparrow rollout: wrote {samples} samples to {args.out}; generated {total_tokens} "
          f"tokens in {elapsed:.1f} s = {total_tokens / elapsed:.1f} tokens/s (including compile: "
          f"first batch took {first_batch_s:.1f} s); mode={cfg.mode}, backend={backend}")
    return 0
