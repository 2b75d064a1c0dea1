"""Launch settings of the Pallas Triton decode kernel, side by side on one GPU.

    python -m sparrow_jax.bench.kernel_sweep [--contexts 8192,32768] [--budget 1024] [--batch 8]
        [--warps 4,8] [--stages 2,3] [--tokens 64,128,256] [--splits auto,2x] [--json]

For each context, dense decode (64-token tiles, every tile selected) and block-sparse decode
(16-token blocks, `--budget` tokens chosen by the centroid rule) at Qwen3-1.7B heads (16 query /
8 KV heads, D = 128, bf16), under every combination of num_warps, num_stages, tokens gathered per
loop iteration and split-K factor ("auto" = `pallas_kernels.pallas_triton.choose_splits`, "2x" twice
that, capped at one iteration per split). Each setting is timed on the device's clock
(`bench.kernels.seconds_per_call`: chained calls minus one) and printed as it finishes, so a
run cut short keeps what it measured; a setting the GPU cannot compile (too much shared memory)
is reported as such. The shipped defaults are marked: the table says what they cost against the best setting.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import pallas_triton as pk_triton
from pallas_kernels.reference import all_blocks_selection, contiguous_as_pages
from sparrow_jax.bench.kernels import seconds_per_call
from sparrow_jax.sparsity import block_scores, selection

HQ, HKV, D = 16, 8, 128        # Qwen3-1.7B attention heads
SPARSE_BLOCK, DENSE_TILE = 16, 64

def _shipped_default() -> dict:
    """The setting the kernel runs with when nobody chooses (its signature's defaults)."""
    params = inspect.signature(pk_triton.paged_block_sparse_decode_triton).parameters
    tokens = pk_triton.default_blocks_per_step(jnp.bfloat16, SPARSE_BLOCK) * SPARSE_BLOCK
    return {"warps": params["num_warps"].default, "stages": params["num_stages"].default,
            "tokens": tokens, "splits": "auto"}


DEFAULT = _shipped_default()


def _csv(kind):
    return lambda s: [kind(v) for v in s.split(",") if v]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=_csv(int), default=[8192, 32768])
    ap.add_argument("--budget", type=int, default=1024, help="sparse budget in tokens")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warps", type=_csv(int), default=[4, 8])
    ap.add_argument("--stages", type=_csv(int), default=[2, 3])
    ap.add_argument("--tokens", type=_csv(int), default=[64, 128, 256],
                    help="tokens gathered per loop iteration (a power of two)")
    ap.add_argument("--splits", type=_csv(str), default=["auto", "2x"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=8, help="chained calls per timing")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU tests)")
    args = ap.parse_args(argv)
    for s in args.splits:
        if s not in ("auto", "2x") and not s.isdigit():
            ap.error(f"--splits takes auto, 2x or a number, got {s!r}")
    return args


def _splits(choice: str, b: int, kk: int, p_blocks: int) -> int:
    """The split-K factor of a choice, for kk entries walked p_blocks at a time."""
    steps = -(-kk // min(p_blocks, pk_triton.next_pow2(kk)))
    auto = pk_triton.choose_splits(b, HKV, steps)
    if choice == "auto":
        return auto
    if choice == "2x":
        return max(1, min(2 * auto, steps))
    return max(1, min(int(choice), steps))


def sweep(args: argparse.Namespace):
    """Yields one row per (context, mode, setting)."""
    dtype = jnp.bfloat16
    b = args.batch
    for ctx in args.contexts:
        kq, kk_, kv = jax.random.split(jax.random.PRNGKey(ctx), 3)
        q = jax.random.normal(kq, (b, HQ, D), dtype)
        k = jax.random.normal(kk_, (b, HKV, ctx, D), dtype)
        v = jax.random.normal(kv, (b, HKV, ctx, D), dtype)
        lengths = jnp.full((b,), ctx, jnp.int32)
        nsel = args.budget // SPARSE_BLOCK
        ids, num = selection.select_blocks(q, block_scores.block_centroids(k, SPARSE_BLOCK), lengths,
                                           jnp.full((b,), nsel, jnp.int32), max_selected=nsel,
                                           block_size=SPARSE_BLOCK)
        dense_ids, dense_num = all_blocks_selection(b, HKV, ctx, lengths, DENSE_TILE)
        modes = {
            "dense": (DENSE_TILE, contiguous_as_pages(k, DENSE_TILE),
                      contiguous_as_pages(v, DENSE_TILE), dense_ids, dense_num, ctx),
            "sparse": (SPARSE_BLOCK, contiguous_as_pages(k, SPARSE_BLOCK),
                       contiguous_as_pages(v, SPARSE_BLOCK), ids, num, min(args.budget, ctx)),
        }
        for mode, (bs, kp, vp, bi, nb, attended) in modes.items():
            kk = bi.shape[-1]
            seen = set()
            for warps, stages, tokens, split in itertools.product(
                    args.warps, args.stages, args.tokens, args.splits):
                p_blocks = max(1, tokens // bs)
                n_split = _splits(split, b, kk, p_blocks)
                if (warps, stages, p_blocks, n_split) in seen:   # "2x" capped to "auto"
                    continue
                seen.add((warps, stages, p_blocks, n_split))
                setting = {"warps": warps, "stages": stages, "tokens": tokens, "splits": split}
                fn = jax.jit(lambda q, kp, vp, bi, nb, ln, p_blocks=p_blocks, n_split=n_split,
                             warps=warps, stages=stages: pk_triton.paged_block_sparse_decode_triton(
                                 q, kp, vp, bi, bi, nb, ln, blocks_per_step=p_blocks,
                                 num_splits=n_split, num_warps=warps, num_stages=stages,
                                 interpret=args.interpret))
                row = {"device": jax.devices()[0].device_kind, "mode": mode, "context": ctx,
                       "budget": attended, "batch": b, **setting, "num_splits": n_split,
                       "default": setting == DEFAULT}
                try:
                    t = seconds_per_call(fn, q, kp, vp, bi, nb, lengths, iters=args.iters,
                                         reps=args.reps)
                except Exception as e:          # reported: e.g. out of shared memory
                    row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:160]}")
                else:
                    kv_bytes = b * attended * 2 * HKV * D * jnp.dtype(dtype).itemsize
                    row.update(ms=t * 1e3, gbs=kv_bytes / t / 1e9 if t > 0 else None)
                yield row


def best_vs_default(rows: list[dict]) -> list[str]:
    """Per (context, mode): the fastest setting and what the default costs beside it."""
    lines = []
    for key in sorted({(r["context"], r["mode"]) for r in rows}):
        ok = [r for r in rows if (r["context"], r["mode"]) == key and r.get("ms") is not None]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["ms"])
        default = next((r for r in ok if r["default"]), None)
        lines.append(
            f"{key[1]:<6} {key[0]:>6}: best {best['ms']:.4f} ms (warps {best['warps']}, stages "
            f"{best['stages']}, tokens {best['tokens']}, splits {best['num_splits']})"
            + (f"; default {default['ms']:.4f} ms = {default['ms'] / best['ms']:.2f}x the best"
               if default else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if pk_triton.status()[0] == "unavailable" and not args.interpret:
        raise SystemExit(f"kernel_sweep: {pk_triton.status()[1]}")
    print(f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), batch "
          f"{args.batch}, Qwen3-1.7B heads, bf16, budget {args.budget}", flush=True)
    rows = []
    for row in sweep(args):
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            took = f"{row['ms']:.4f} ms" if row.get("ms") is not None else row["error"]
            print(f"{row['mode']:<6} {row['context']:>6} warps {row['warps']} stages "
                  f"{row['stages']} tokens {row['tokens']:>3} splits {row['num_splits']:>2}: "
                  f"{took}", flush=True)
    print("\n".join(best_vs_default(rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
