"""Exact sparse rollout: measured tokens per verify pass vs the alpha prediction, per length bin,
on the demo model (issue 42's acceptance check).

    python -m sparrow_jax.bench.acceptance [--model checkpoints/demo_sft]
        [--prompts data/demo/eval.jsonl] [--num_prompts 32] [--samples 4] [--budgets 128 256]
        [--gamma 4] [--bin_size 128] [--max_new_tokens 1072] [--temperature 1.0]
        [--dense_layers 0,1] [--draft_scorer centroid verify] [--seed 0] [--json OUT.json]
        [--plot OUT.png]

Per budget (one exact-sparse rollout each, the same prompts and seed): `samples` sampled
continuations per prompt with `RolloutConfig.mode = "exact_sparse"` (drafts at that budget in
every bin, the demo's stop tokens), then `exact.acceptance_by_bin`: per bin of the cache length
at the start of a verify round, the mean measured tokens per verify pass beside the prediction
(1 - a^(gamma+1)) / (1 - a) from the bin's mean alpha, and their relative difference. Each row's
last round is left out (a stop or the length cap may cut it short). Rounds are weighted equally:
the overall row pools every round of every bin. Prints one table per budget; --plot draws
measured vs predicted per bin. --draft_scorer with several values runs each budget once per
scorer (`RolloutConfig.draft_scorer`: "centroid", or "verify" - drafts choosing blocks by the
last verify pass's attention, issue 57), the same prompts and seed: accepted tokens per pass at
equal budget, side by side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.data.prompts import PromptDataset
from sparrow_jax.data.prompts import PromptBatch
from sparrow_jax.model import load_hf, load_tokenizer, stop_token_ids
from sparrow_jax.rollout import RolloutConfig, exact, generate
from sparrow_jax.rollout.config import DraftScorer


def measure(model, batch, cfg: RolloutConfig, *, budget: int, samples: int, bin_size: int,
            seed: int) -> dict:
    """One exact-sparse rollout at `budget` -> per-bin acceptance rows and the pooled row."""
    t0 = time.perf_counter()
    traj = generate(model, batch.prompt_ids, batch.prompt_lengths, cfg=cfg,
                    budgets=np.full(64, budget, np.int32), bin_size=bin_size,
                    group_size=samples, rng=jax.random.key(seed))
    traj = jax.device_get(traj)
    seconds = time.perf_counter() - t0
    bins = exact.acceptance_by_bin(traj, gamma=cfg.gamma, bin_size=bin_size,
                                   drop_last_round=True)
    for b in bins:
        b["rel_diff"] = b["tokens_per_pass"] / b["predicted"] - 1.0
    rounds = sum(b["rounds"] for b in bins)
    measured = sum(b["rounds"] * b["tokens_per_pass"] for b in bins) / rounds
    predicted = sum(b["rounds"] * b["predicted"] for b in bins) / rounds
    alpha = np.asarray(traj.alpha)[np.asarray(traj.mask)]
    alpha = alpha[np.isfinite(alpha)]
    return {"budget": budget, "gamma": cfg.gamma, "draft_scorer": str(cfg.draft_scorer),
            "bins": bins, "rounds": rounds,
            "tokens_per_pass": measured, "predicted": predicted,
            "rel_diff": measured / predicted - 1.0, "mean_alpha": float(alpha.mean()),
            "within_10pct_bins": sum(abs(b["rel_diff"]) <= 0.10 for b in bins),
            "num_bins": len(bins), "rows": int(traj.tokens.shape[0]),
            "mean_length": float(np.asarray(traj.response_lengths).mean()), "seconds": seconds}


def table(res: dict, bin_size: int) -> str:
    lines = [f"budget {res['budget']}, gamma {res['gamma']}, drafts scored by "
             f"{res['draft_scorer']}: {res['rows']} rows, mean length "
             f"{res['mean_length']:.0f}, {res['rounds']} rounds, {res['seconds']:.0f} s",
             "| cache length | rounds | mean alpha | tokens / pass (+- s.e.) | alpha prediction | "
             "measured / predicted - 1 |", "|---|---|---|---|---|---|"]
    for b in res["bins"]:
        lo = b["bin"] * bin_size
        lines.append(f"| {lo}-{lo + bin_size} | {b['rounds']} | {b['mean_alpha']:.3f} | "
                     f"{b['tokens_per_pass']:.3f} +- {b['tokens_per_pass_se']:.3f} | "
                     f"{b['predicted']:.3f} | {100 * b['rel_diff']:+.1f}% |")
    lines.append(f"| all | {res['rounds']} | {res['mean_alpha']:.3f} | "
                 f"{res['tokens_per_pass']:.3f} | {res['predicted']:.3f} | "
                 f"{100 * res['rel_diff']:+.1f}% |")
    lines.append(f"bins within 10%: {res['within_10pct_bins']} of {res['num_bins']}")
    return "\n".join(lines)


def plot(results: list[dict], bin_size: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        x = [(b["bin"] + 0.5) * bin_size for b in res["bins"]]
        line, = ax.plot(x, [b["tokens_per_pass"] for b in res["bins"]], "o-",
                        label=f"measured, budget {res['budget']}, {res['draft_scorer']}")
        ax.plot(x, [b["predicted"] for b in res["bins"]], "--", color=line.get_color(),
                label=f"alpha prediction, budget {res['budget']}, {res['draft_scorer']}")
    ax.set_xlabel("cache length at the verify round's start (tokens)")
    ax.set_ylabel(f"tokens per verify pass (gamma {results[0]['gamma']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m sparrow_jax.bench.acceptance",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="checkpoints/demo_sft")
    p.add_argument("--prompts", default="data/demo/eval.jsonl")
    p.add_argument("--num_prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="continuations per prompt")
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--bin_size", type=int, default=128)
    p.add_argument("--max_new_tokens", type=int, default=1072)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dense_layers", default="0,1", help="comma-separated ids, or 'none'")
    p.add_argument("--draft_scorer", nargs="+", default=["centroid"],
                   choices=DraftScorer.values(),
                   help="how drafts choose their blocks; several: one run each, side by side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--plot", default=None, help="also draw measured vs predicted here (PNG)")
    args = p.parse_args(argv)
    layers = () if args.dense_layers.strip().lower() in ("", "none") else tuple(
        int(i) for i in args.dense_layers.split(","))
    tok = load_tokenizer(args.model)
    model = load_hf(args.model, dtype=jnp.float32)
    records = PromptDataset.from_files(args.prompts, tok).records[:args.num_prompts]
    batch = PromptBatch.from_records(records, tok.pad_token_id or 0)
    results = []
    for budget, scorer in itertools.product(args.budgets, args.draft_scorer):
        try:
            cfg = RolloutConfig(mode="exact_sparse", gamma=args.gamma, dense_layers=layers,
                                draft_scorer=scorer,
                                max_new_tokens=args.max_new_tokens, max_budget=budget,
                                temperature=args.temperature, record_topk=0, backend="xla",
                                stop_token_ids=stop_token_ids(tok, args.model),
                                pad_token_id=tok.pad_token_id or 0)
        except ValueError as e:
            raise SystemExit(f"python -m sparrow_jax.bench.acceptance: {e}") from None
        res = measure(model, batch, cfg, budget=budget, samples=args.samples,
                      bin_size=args.bin_size, seed=args.seed)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "bins"}), flush=True)
        print(table(res, args.bin_size) + "\n", flush=True)
    print(f"{len(records)} prompts x {args.samples} samples, temperature {args.temperature}, "
          f"dense layers {list(layers) or 'none'}, bins of {args.bin_size} tokens", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.bin_size, args.plot)


if __name__ == "__main__":
    main()
