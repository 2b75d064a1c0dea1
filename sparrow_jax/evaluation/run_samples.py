"""The sampling loop of `sparrow eval`: chunks of problems x n samples, scored, kept per chunk.

A chunk already on disk (an earlier, interrupted run) is read back instead of sampled again;
the others are sampled with fixed per-sample keys (`generate(..., first_sample=i*n)`) and the
same padded shapes as in an uninterrupted run, so resumed results are identical.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
from tqdm import tqdm

from sparrow_jax.evaluation import results, scorers
from sparrow_jax.data.prompts import PromptBatch

log = logging.getLogger(__name__)


def _config(args, schedule, stop_ids, pad_id: int, width: int, sampling: dict[str, Any]):
    from sparrow_jax.rollout.config import rollout_config
    try:
        cfg, budgets = rollout_config(schedule, stop_ids, pad_id, width,
                                      max_new_tokens=args.max_new_tokens, mode=args.mode)
    except ValueError as e:
        raise SystemExit(f"sparrow eval: {e}") from None
    overrides = {k: v for k, v in sampling.items() if v is not None}
    try:
        cfg = dataclasses.replace(cfg, engine=args.engine, record_topk=0, **overrides)
    except ValueError as e:
        raise SystemExit(f"sparrow eval: bad sampling settings {overrides}: {e}") from None
    return cfg, budgets


def _score(records: Sequence[dict], texts: list[list[str]], processes: int, timeout_s: float
           ) -> list[list[float]]:
    """Rewards [problems][n]; one RewardPool per reward name (timeouts score 0)."""
    from sparrow_jax.data import synthetic  # noqa: F401 - registers synthetic_exact (scorers)
    from sparrow_jax.rewards.pool import RewardPool
    out = [[0.0] * len(t) for t in texts]
    for name in sorted({r["scorer"] for r in records}):
        idx = [(p, j) for p, r in enumerate(records) if r["scorer"] == name
               for j in range(len(texts[p]))]
        items = [(texts[p][j], records[p]["answer"], records[p]["prompt"], records[p]["meta"])
                 for p, j in idx]
        with RewardPool(name, processes=processes, timeout_s=timeout_s) as pool:
            report = pool.score(items)
        if report.timeouts or report.errors:
            log.warning("scorer %s: %d timeouts, %d errors (scored 0)%s", name, report.timeouts,
                        report.errors, "" if report.first_error is None
                        else f"; first error: {report.first_error}")
        for (p, j), value in zip(idx, report.rewards):
            out[p][j] = float(value)
    return out


def run(args, weights_dir: Path, tokenizer, records: list[dict], sampling: dict[str, Any],
        max_new: int, out: str) -> tuple[list[dict], dict[str, Any]]:
    """Per-problem results for `records` (in order) and this invocation's timing."""
    import pallas_kernels
    from sparrow_jax.model import load_hf, stop_token_ids
    from sparrow_jax.rollout import generate
    from sparrow_jax.sparsity.schedule import resolve_schedule

    args.max_new_tokens = max_new
    try:
        schedule = resolve_schedule(args.schedule)
    except (ValueError, OSError) as e:
        raise SystemExit(f"sparrow eval: bad --schedule: {e}") from None
    if args.mode is None:   # dense unless --schedule names a sparse one (never a gin default)
        args.mode = "sparse" if args.schedule and not schedule.is_dense else "dense"
    stop_ids = stop_token_ids(tokenizer, weights_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(r["prompt_ids"]) for r in records)
    cfg, budgets = _config(args, schedule, stop_ids, pad_id, width, sampling)
    b, n = args.problems_per_chunk, args.n
    chunks = -(-len(records) // b)
    todo = [c for c in range(chunks) if results.load_chunk(out, c) is None]
    model = load_hf(weights_dir) if todo else None
    if todo:
        backend = pallas_kernels.resolve_backend(cfg.backend)
        print(f"sparrow eval: engine={cfg.engine} mode={cfg.mode} schedule="
              f"{schedule.name or 'custom'} backend={backend} temperature={cfg.temperature} "
              f"top_p={cfg.top_p} top_k={cfg.top_k} max_new_tokens={cfg.max_new_tokens} "
              f"stop ids {list(cfg.stop_token_ids)}", file=sys.stderr)
    rng = jax.random.key(args.seed)
    problems: list[dict] = []
    tokens, seconds = 0, 0.0
    with tqdm(total=len(records), unit="problem", desc="eval") as bar:
        for c in range(chunks):
            part = records[c * b:(c + 1) * b]
            done = results.load_chunk(out, c)
            if done is None:
                t0 = time.perf_counter()
                # Always b rows (the last chunk padded with its last problem): one shape, so a
                # resumed run compiles and computes exactly what an uninterrupted one did.
                batch = PromptBatch.from_records(part, pad_id, rows=b, filler=part[-1])
                traj = generate(model, batch.prompt_ids, batch.prompt_lengths, cfg=cfg,
                                budgets=budgets, bin_size=schedule.bin_size, group_size=n,
                                rng=rng, first_sample=c * b * n)
                host = jax.device_get({"t": traj.tokens, "n": traj.response_lengths})
                seconds += time.perf_counter() - t0
                texts, lens, finish = [], [], []
                stops = set(cfg.stop_token_ids)
                for p in range(len(part)):
                    rows = range(p * n, (p + 1) * n)
                    ids = [host["t"][i, :int(host["n"][i])].tolist() for i in rows]
                    texts.append([tokenizer.decode(x, skip_special_tokens=True) for x in ids])
                    lens.append([len(x) for x in ids])
                    finish.append(["stop" if x and x[-1] in stops else "length" for x in ids])
                tokens += int(sum(map(sum, lens)))
                rewards = _score(part, texts, args.reward_processes, args.reward_timeout_s)
                done = [_problem(c * b + p, r, texts[p], lens[p], finish[p], rewards[p])
                        for p, r in enumerate(part)]
                results.write_json_atomic(results.chunk_path(out, c), done)
            problems.extend(done)
            bar.update(len(part))
            bar.set_postfix(tokens=tokens, tok_s=f"{tokens / max(seconds, 1e-9):.1f}")
    return problems, {"tokens": tokens, "seconds": seconds,
                      "tokens_per_s": tokens / seconds if seconds else 0.0,
                      "chunks_run": len(todo), "chunks_resumed": chunks - len(todo)}


def _problem(index: int, record: dict, texts: list[str], lens: list[int], finish: list[str],
             rewards: list[float]) -> dict[str, Any]:
    return {"index": index, "id": record["id"], "data_source": record["data_source"],
            "scorer": record["scorer"], "answer": record["answer"], "prompt": record["prompt"],
            "responses": [{"text": t, "length": n, "finish": f, "reward": r, "correct": r > 0,
                           "answer": scorers.answer_key(record["scorer"], t)}
                          for t, n, f, r in zip(texts, lens, finish, rewards)]}
