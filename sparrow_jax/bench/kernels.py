"""Dense vs block-sparse decode attention timings.

    python -m sparrow_jax.bench.kernels [--json] [--backend auto|xla|pallas_tpu|pallas_triton|jax_triton[,...]]
        [--contexts 8192,32768,131072] [--budgets 1024,2048,4096] [--models 1.7b,8b]
        [--batch N] [--dtype bfloat16|float32] [--iters N]
    python -m sparrow_jax.bench.kernels --selection [--blocks 2048] [--select 512] [--batch 8]

For each model head shape (Qwen3-1.7B: 8 KV / 16 query heads, D=128; Qwen3-8B: 8 KV / 32 query
heads, D=128), context length and token budget it reports the median time of one decode step of
attention (one layer), dense and block-sparse, the speedup, and each kernel's share of its bytes
limit ("% limit"): the bytes the kernel must move - K and V of the attended tokens, the queries
read and the outputs written (and the selected block ids, sparse) - over the copy bandwidth
measured in the same run (`runtime.bandwidth.copy_bandwidth`), divided by the measured time.
The JSON lines also carry `*_bw_frac` (the KV bytes alone over the time, as a fraction of the
copy bandwidth: the column of the reports before issue 55). "select" is the centroid scoring +
block selection that sparse decode adds per step. `--backend a,b`: each backend in turn; one
that cannot run here (jax_triton without the `triton` package) is reported as unavailable, with
the reason, not skipped silently.
On CPU the defaults are smaller (batch 1, f32) so the run takes well under two minutes.
Timing: on CPU the median wall time of a call; on an accelerator the device time per call from
16 chained calls in one program minus one (`seconds_per_call`): a single call's host dispatch
and sync (tens of microseconds) would otherwise be most of a 0.1 ms kernel.

--selection times block selection alone (scores -> ids, the 1.7B head shape: 8 KV heads) at
P = --blocks blocks per row and K = --select selected, the sort-free `select_from_scores` beside
the former top_k + sort (`select_from_scores_reference`), at each radix width, and on a GPU the
one-kernel Pallas Triton selection (`pallas_kernels.pallas_triton_select`), in one run.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from sparrow_jax.runtime.bandwidth import copy_bandwidth, median_wall_seconds
from sparrow_jax.sparsity import block_scores, selection

MODELS = {"1.7b": ("qwen3-1.7b", 16, 8, 128), "8b": ("qwen3-8b", 32, 8, 128)}
BLOCK = 16


def chained(fn, reps: int):
    """One jitted program of `reps` dependent calls of fn (fn's first argument is nudged by 0 x
    the previous call's first output, in floating point, so XLA can neither fold nor merge the
    calls). Arguments as fn's."""
    def many(*args):
        out = fn(*args)
        for _ in range(reps - 1):
            first = jax.tree.leaves(out)[0]
            nudge = first.reshape(-1)[0].astype(jnp.float32) * 0.0
            args = (args[0] + nudge.astype(args[0].dtype),) + tuple(args[1:])
            out = fn(*args)
        return out
    return jax.jit(many)


class TimingUnresolved(RuntimeError):
    """A chained timing whose difference is inside the noise: there is no time to report."""


def seconds_per_call(fn, *args, iters: int, reps: int | None = None) -> float:
    """Seconds per call of fn(*args). On CPU (reps 1): the median wall time of one call. On an
    accelerator a ~0.1 ms kernel is shorter than a jit call's host dispatch and sync, so it is
    timed on the device's own clock: (t(reps chained calls) - t(1 call)) / (reps - 1), each t a
    median of `iters` wall times, which cancels the fixed dispatch and sync cost."""
    reps = reps or (1 if jax.default_backend() == "cpu" else 16)
    if reps == 1:
        return median_wall_seconds(fn, *args, iters=iters)
    t_one = median_wall_seconds(chained(fn, 1), *args, iters=iters)
    t_many = median_wall_seconds(chained(fn, reps), *args, iters=iters)
    if t_many <= t_one:
        # Not a zero-time kernel: the difference is inside the timer's noise (seen on a loaded
        # 2-core CI machine at reps 2). A 0 here would print as a time and divide ratios by 0.
        raise TimingUnresolved(
            f"{reps} chained calls took no longer than one ({t_many * 1e3:.4f} ms vs "
            f"{t_one * 1e3:.4f} ms): the call is below the timer's noise; raise --reps or --iters")
    return (t_many - t_one) / (reps - 1)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _backends(s: str) -> list[str]:
    names = [v for v in s.split(",") if v]
    unknown = [v for v in names if v not in pk.BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from "
                                         f"{', '.join(pk.BACKENDS)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cpu = jax.default_backend() == "cpu"
    ap = argparse.ArgumentParser(description="Dense vs block-sparse decode attention benchmark")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per row")
    ap.add_argument("--backend", default="auto", type=_backends,
                    help="comma-separated, each in turn: " + ",".join(pk.BACKENDS))
    ap.add_argument("--contexts", type=_ints, default=[8192, 32768, 131072])
    ap.add_argument("--budgets", type=_ints, default=[1024, 2048, 4096])
    ap.add_argument("--models", default="1.7b,8b", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--batch", type=int, default=1 if cpu else 8)
    ap.add_argument("--dtype", default="float32" if cpu else "bfloat16",
                    choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=10 if cpu else 20)
    ap.add_argument("--selection", action="store_true",
                    help="time block selection alone: top_k + sort, the sort-free XLA form and, "
                         "on a GPU, the one-kernel Pallas Triton form")
    ap.add_argument("--blocks", type=int, default=2048, help="--selection: blocks per row (P)")
    ap.add_argument("--select", type=int, default=512, help="--selection: selected blocks (K)")
    return ap.parse_args(argv)


def bench_shape(model: str, hq: int, hkv: int, d: int, ctx: int, args, copy_bw: float,
                backend: str) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    b = args.batch
    key = jax.random.PRNGKey(ctx + hq)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, hq, d), dtype)
    k = jax.random.normal(kk, (b, hkv, ctx, d), dtype)
    v = jax.random.normal(kv, (b, hkv, ctx, d), dtype)
    lengths = jnp.full((b,), ctx, jnp.int32)
    dense = jax.jit(lambda q, k, v, ln: pk.dense_decode(q, k, v, ln, backend=backend))
    t_dense = seconds_per_call(dense, q, k, v, lengths, iters=args.iters)
    kv_token_bytes = 2 * hkv * d * dtype.itemsize          # K and V of one token, all KV heads
    dense_bytes = b * ctx * kv_token_bytes
    q_out_bytes = 2 * b * hq * d * dtype.itemsize          # the queries read, the outputs written
    cents = block_scores.block_centroids(k, BLOCK)
    rows = []
    for budget in args.budgets:
        nsel = budget // BLOCK
        bud = jnp.full((b,), nsel, jnp.int32)
        select = jax.jit(lambda q, c, ln, bb, nsel=nsel: selection.select_blocks(
            q, c, ln, bb, max_selected=nsel, block_size=BLOCK, backend=backend))
        t_select = seconds_per_call(select, q, cents, lengths, bud, iters=args.iters)
        bi, nb = select(q, cents, lengths, bud)
        sparse = jax.jit(lambda *a: pk.block_sparse_decode(*a, block_size=BLOCK,
                                                           backend=backend))
        t_sparse = seconds_per_call(sparse, q, k, v, bi, nb, lengths, iters=args.iters)
        sparse_bytes = b * min(budget, ctx) * kv_token_bytes
        ids_bytes = b * hkv * nsel * 4                     # the selected block ids (int32)
        moved = {"dense": dense_bytes + q_out_bytes,
                 "sparse": sparse_bytes + q_out_bytes + ids_bytes}
        limit = {k: v / copy_bw for k, v in moved.items()}
        rows.append(dict(
            backend=backend, device=jax.devices()[0].device_kind, model=model, batch=b, hq=hq,
            hkv=hkv, head_dim=d, dtype=dtype.name, context=ctx, budget=budget,
            dense_ms=t_dense * 1e3, sparse_ms=t_sparse * 1e3, select_ms=t_select * 1e3,
            speedup=t_dense / t_sparse, speedup_with_select=t_dense / (t_sparse + t_select),
            dense_bw_frac=dense_bytes / t_dense / copy_bw,
            sparse_bw_frac=sparse_bytes / t_sparse / copy_bw,
            copy_bw_gbs=copy_bw / 1e9,
            dense_bytes=moved["dense"], sparse_bytes=moved["sparse"],
            dense_limit_ms=limit["dense"] * 1e3, sparse_limit_ms=limit["sparse"] * 1e3,
            dense_pct_of_limit=100 * limit["dense"] / t_dense,
            sparse_pct_of_limit=100 * limit["sparse"] / t_sparse))
    return rows


def bench_selection(args) -> list[dict]:
    """Selection alone, old (top_k + sort) vs new (radix select + prefix-sum compaction)."""
    b, hkv, p, k = args.batch, 8, args.blocks, args.select
    key = jax.random.PRNGKey(p + k)
    scores = jax.random.normal(key, (b, hkv, p), jnp.float32)
    # Rows at full length (the sparse regime) with per-row budgets between K/2 and K.
    lengths = jnp.full((b, hkv), p * BLOCK, jnp.int32)
    budgets = jnp.broadcast_to(jnp.linspace(k // 2, k, b).astype(jnp.int32)[:, None], (b, hkv))
    ref = jax.jit(lambda s, ln, bb: selection.select_from_scores_reference(
        s, ln, bb, max_selected=k, block_size=BLOCK))
    t_old = seconds_per_call(ref, scores, lengths, budgets, iters=args.iters)
    want = ref(scores, lengths, budgets)
    rows = []
    # The XLA sort-free form at each radix width, and on a GPU the one-kernel Triton form at
    # each (its digits per pass in registers).
    variants = [(bits, "xla") for bits in (1, 2, 4)]
    if jax.default_backend() == "gpu":
        variants += [(bits, "pallas_triton") for bits in (1, 2, 4)]
    for bits, backend in variants:
        new = jax.jit(lambda s, ln, bb, bits=bits, backend=backend: selection.select_from_scores(
            s, ln, bb, max_selected=k, block_size=BLOCK, radix_bits=bits, backend=backend))
        got = new(scores, lengths, budgets)
        t_new = seconds_per_call(new, scores, lengths, budgets, iters=args.iters)
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(got, want))
        rows.append(dict(device=jax.devices()[0].device_kind, rows=b * hkv, blocks=p, select=k,
                         radix_bits=bits, backend=backend, old_ms=t_old * 1e3,
                         new_ms=t_new * 1e3,
                         speedup=t_old / t_new, identical=same))
    return rows


def format_selection(rows: list[dict]) -> str:
    head = (f"{'rows':>5} {'P':>6} {'K':>5} {'radix':>6} {'top_k+sort ms':>13} "
            f"{'sort-free ms':>12} {'ratio':>7} {'identical':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        radix = (str(r["radix_bits"]) if r.get("backend", "xla") == "xla"
                 else f"k{r['radix_bits']}")
        lines.append(f"{r['rows']:>5} {r['blocks']:>6} {r['select']:>5} {radix:>6} "
                     f"{r['old_ms']:>13.3f} {r['new_ms']:>12.3f} {r['speedup']:>6.2f}x "
                     f"{str(r['identical']):>9}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = (f"{'backend':<13} {'model':<11} {'ctx':>7} {'budget':>6} {'dense ms':>9} "
            f"{'sparse ms':>9} {'select ms':>9} {'speedup':>7} {'w/ sel':>6} {'dense MB':>9} "
            f"{'sparse MB':>9} {'dense % limit':>13} {'sparse % limit':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['backend']:<13} {r['model']:<11} {r['context']:>7} {r['budget']:>6} "
            f"{r['dense_ms']:>9.3f} {r['sparse_ms']:>9.3f} {r['select_ms']:>9.3f} "
            f"{r['speedup']:>6.1f}x {r['speedup_with_select']:>5.1f}x "
            f"{r['dense_bytes'] / 1e6:>9.2f} {r['sparse_bytes'] / 1e6:>9.2f} "
            f"{r['dense_pct_of_limit']:>12.0f}% {r['sparse_pct_of_limit']:>13.0f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.selection:
        rows = bench_selection(args)
        print(f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
              f"block selection alone, batch {args.batch} x 8 KV heads", flush=True)
        if args.json:
            for r in rows:
                print(json.dumps(r), flush=True)
        print(format_selection(rows), flush=True)
        return 0
    backends, unavailable = [], {}
    for name in args.backend:
        try:
            backends.append(pk.resolve_backend(name))
        except pk.BackendUnavailableError as e:
            unavailable[name] = str(e)
    if not backends:
        raise SystemExit("bench: " + "; ".join(unavailable.values()))
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    copy_bw = copy_bandwidth(iters=args.iters)
    print(f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), backends: "
          f"{', '.join(backends)}, batch {args.batch}, {args.dtype}, copy bandwidth "
          f"{copy_bw / 1e9:.1f} GB/s (the bytes limit = bytes moved / this)", flush=True)
    for name, why in unavailable.items():    # said, not skipped silently (no `triton` here)
        print(f"# backend {name}: unavailable here: {why}", flush=True)
        if args.json:
            print(json.dumps({"backend": name, "device": jax.devices()[0].device_kind,
                              "unavailable": why}), flush=True)
    rows = []
    for backend in backends:
        for m in models:
            name, hq, hkv, d = MODELS[m]
            for ctx in args.contexts:
                new = bench_shape(name, hq, hkv, d, ctx, args, copy_bw, backend)
                rows += new
                if args.json:
                    for r in new:
                        print(json.dumps(r), flush=True)
    print(format_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
