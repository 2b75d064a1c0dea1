"""How much of the sparse/dense mismatch is the block scorer's? Teacher-forced alpha on reference
solutions, per block scorer, budget and set of dense layers (issue 41's "what limits it").

    python -m sparrow_jax.bench.selection_quality [--model checkpoints/long_sft]
        [--data data/long/heldout64.jsonl] [--rows 4] [--budgets 256 512]
        [--scorers centroid quest oracle] [--dense_layers 0,1 0] [--report_bin 512]
        [--threshold 0.9] [--query_chunk 256] [--json OUT.json]

Each reference row (prompt + its `solution` + <eos>) is run once with dense attention and once
per (dense layers, scorer, budget) with the rollout's block selection replayed at every response
position (`rollout.teacher_forced.sparse_attention_fn`, the same budget in every bin). Per
response token, alpha = sum_v min(p_sparse, p_dense) over the full vocabulary at T = 1. Scorers:
"centroid" (what the rollout decodes with), "quest" (per-block key bounds) and "oracle" (each
block's true attention mass: no block scorer can keep more of it at that budget). Printed per
setting: the fraction of tokens with alpha < threshold (what the controller bounds by q) overall
and per `report_bin` tokens of cache length, and the mean alpha.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.data.prompts import PromptDataset
from sparrow_jax.evaluation.reference import reference_batch
from sparrow_jax.model import load_hf, load_tokenizer
from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.rollout.teacher_forced import (REPLAY_SCORERS, map_time_chunks, replay_hidden,
                                                token_logprobs)
from sparrow_jax.sparsity.mismatch import acceptance_rate
from sparrow_jax.train.schedule_step import kv_read


@functools.partial(jax.jit, static_argnames=("graphdef", "scorer", "budget", "dense_layers",
                                             "block_size", "query_chunk"))
def hidden_states(graphdef, state, traj: Trajectories, *, scorer: str | None, budget: int,
                  dense_layers: tuple[int, ...], block_size: int, query_chunk: int) -> jax.Array:
    """[B, T, H] final hidden states predicting each response token: dense when scorer is None,
    else with `scorer`'s block selection at `budget` tokens in the sparse layers."""
    model = nnx.merge(graphdef, state)
    return replay_hidden(model, traj,
                         None if scorer is None else jnp.full((1,), budget, jnp.int32),
                         bin_size=1 << 30, max_selected=budget // block_size,
                         block_size=block_size, dense_layers=dense_layers,
                         query_chunk=query_chunk, scorer=scorer or "centroid")


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _reference_logp(graphdef, state, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
    """[B, T] log p of the reference tokens under the policy whose hidden states are given."""
    model = nnx.merge(graphdef, state)
    return token_logprobs(model, hidden, tokens)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _alpha(graphdef, state, hidden_sparse: jax.Array, hidden_dense: jax.Array) -> jax.Array:
    """[B, T] alpha at T = 1 from the two runs' hidden states, 256 positions at a time."""
    model = nnx.merge(graphdef, state)
    return map_time_chunks(lambda hs, hd: acceptance_rate(model.logits(hs), model.logits(hd)),
                           256, hidden_sparse, hidden_dense)


def tail_table(alpha: np.ndarray, cached: np.ndarray, mask: np.ndarray, *, report_bin: int,
               threshold: float) -> dict:
    """alpha/cached/mask [B, T] -> the overall and per-bin fraction of tokens below threshold."""
    a, c = alpha[mask], cached[mask]
    bins = []
    for lo in range(0, int(c.max()) + 1, report_bin):
        sel = (c >= lo) & (c < lo + report_bin)
        if sel.any():
            bins.append({"from": lo, "tokens": int(sel.sum()),
                         "below": float((a[sel] < threshold).mean()),
                         "mean_alpha": float(a[sel].mean())})
    return {"tokens": int(a.size), "below": float((a < threshold).mean()),
            "mean_alpha": float(a.mean()), "bins": bins}


def run(model, batch: Trajectories, *, budgets, scorers, dense_sets, block_size: int = 16,
        query_chunk: int = 256, report_bin: int = 512, threshold: float = 0.9,
        log=print) -> list[dict]:
    """One row per (dense layers, scorer, budget): tail_table's numbers plus the settings. The
    dense policy's own fit is logged first: mean over rows of the references' summed log p."""
    graphdef, state = nnx.split(model)
    kw = dict(block_size=block_size, query_chunk=query_chunk)
    dense = hidden_states(graphdef, state, batch, scorer=None, budget=0, dense_layers=(), **kw)
    cached, mask = np.asarray(batch.cached_lengths), np.asarray(batch.mask)
    row_logp = np.where(mask, np.asarray(_reference_logp(graphdef, state, dense, batch.tokens)),
                        0).sum(1)
    se = row_logp.std(ddof=1) / np.sqrt(row_logp.size) if row_logp.size > 1 else float("nan")
    log(f"dense policy: log p(reference) {row_logp.mean():.3f} per row (+- {se:.3f})")
    num_layers = len(model.layers)
    rows = []
    for dense_layers in dense_sets:
        for scorer in scorers:
            for budget in budgets:
                t0 = time.perf_counter()
                hs = hidden_states(graphdef, state, batch, scorer=scorer, budget=int(budget),
                                   dense_layers=tuple(dense_layers), **kw)
                alpha = np.asarray(_alpha(graphdef, state, hs, dense))
                kv = kv_read(np.full(mask.shape, budget), cached, mask, num_layers=num_layers,
                             num_sparse_layers=num_layers - len(dense_layers),
                             bin_size=report_bin, num_bins=1)
                row = {"dense_layers": list(dense_layers), "scorer": scorer,
                       "budget": int(budget), "sparse_kv_read": kv["kv/read_sparse_layers"],
                       "model_kv_read": kv["kv/read_model"],
                       **tail_table(alpha, cached, mask, report_bin=report_bin,
                                    threshold=threshold),
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                log(f"dense layers {tuple(dense_layers)} {scorer:>8} budget {budget:>5}: "
                    f"alpha < {threshold} on {row['below']:.4f} of {row['tokens']} tokens, "
                    f"mean alpha {row['mean_alpha']:.4f}  ({row['seconds']:.0f} s)")
    return rows


def print_table(rows: list[dict], threshold: float) -> None:
    """Markdown: one line per setting, the per-bin fractions below threshold in its last column."""
    print(f"\n| dense layers | scorer | budget | whole-model KV read | mean alpha | "
          f"alpha < {threshold} | per bin of cache length |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per_bin = " ".join(f"{b['below']:.3f}" for b in r["bins"])
        print(f"| {','.join(map(str, r['dense_layers']))} | {r['scorer']} | {r['budget']} | "
              f"{r['model_kv_read']:.2f} | {r['mean_alpha']:.4f} | {r['below']:.4f} | {per_bin} |")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring); raises SystemExit on a budget the replay cannot use."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="checkpoints/long_sft")
    ap.add_argument("--data", default="data/long/heldout64.jsonl")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--scorers", nargs="+", default=list(REPLAY_SCORERS), choices=REPLAY_SCORERS)
    ap.add_argument("--dense_layers", nargs="+", default=["0,1", "0"],
                    help="comma-separated layer sets, e.g. 0,1 0 (empty string: none dense)")
    ap.add_argument("--block_size", type=int, default=16)
    ap.add_argument("--query_chunk", type=int, default=256)
    ap.add_argument("--report_bin", type=int, default=512)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for b in args.budgets:
        if b <= 0 or b % args.block_size or b < 3 * args.block_size:
            raise SystemExit(f"--budgets: {b} must be a positive multiple of block_size="
                             f"{args.block_size} and >= 3 blocks (sink + 2 local)")
    args.dense_sets = [tuple(int(x) for x in s.split(",") if x.strip())
                       for s in args.dense_layers]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    tok = load_tokenizer(args.model)
    model = load_hf(args.model)
    records = PromptDataset.from_files(args.data, tok).records[:args.rows]
    if not records:
        raise SystemExit(f"--data {args.data}: no records")
    batch = reference_batch(records, tok, eos_id=tok.eos_token_id, block_size=args.block_size)
    print(f"{len(records)} reference rows of {args.data}, "
          f"{int(np.asarray(batch.response_lengths).mean())} response tokens on average; "
          f"model {args.model}")
    rows = run(model, batch, budgets=args.budgets, scorers=args.scorers,
               dense_sets=args.dense_sets, block_size=args.block_size, query_chunk=args.query_chunk,
               report_bin=args.report_bin, threshold=args.threshold)
    print_table(rows, args.threshold)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "data": args.data, "rows": len(records),
                       "threshold": args.threshold, "report_bin": args.report_bin,
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
