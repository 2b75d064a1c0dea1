"""`sparrow bench rollout --workload exact`: dense vs approximate sparse vs exact sparse decode,
side by side in one run (issue 42).

    sparrow bench rollout -- --workload exact [--context 8192 16384 32768] [--budget 1024]
        [--gamma 4] [--dense_layers none 0,1] [--batch 4] [--new_tokens 64] [--repeats 3]

Per context: one random prompt of (context - new_tokens) tokens is prefilled once (with the
exact-sparse cache slack, which the dense and sparse programs decode too) and sampled `batch`
times at temperature 1. Each timed run decodes a fresh copy of that state (copy not timed),
programs compiled ahead of time, runs interleaved (dense, then per dense-layer set sparse and
exact for each gamma), median of --repeats. Stop tokens are off: every row decodes
new_tokens tokens; the exact loop runs until the slowest row is done (its idle rows included).

Reported per run: decode tokens/s (batch x (new_tokens - 1) / median seconds) and the ratio to
dense; for exact runs the measured tokens per verify pass (each row's last round left out: the
loop cuts it at new_tokens, `pass_stats`), mean alpha, verify rounds (loop iterations) and a
cost breakdown per round, measured: one more run of the exact program under
the JAX profiler (bench/xplane.py) gives each phase's share of its op time - draft (the gamma
sparse steps), verify (the dense pass), accept (the acceptance rule, records, rollback), other
(the loop's own ops) - scaled to the measured ms per round. `verify_alone_ms` is a verify pass
timed alone (gamma + 1 tokens, dense, in place), for comparison. --before adds, per gamma, the
exact program with the verify's prefix through the chunked dense decode kernel (as before
2026-11-27; rollout/dense_attention.py ONE_PASS_BYTES), and the dense engine through that
kernel (the baseline of every figure before 2026-11-28, issue 57), side by side; ratios stay
against the one-pass dense engine. KV bytes read
per generated token (per row, at the full context, K+V of every layer plus the sparse layers'
centroid scoring) follow from the shapes: dense reads the whole context every layer; sparse
reads the budget in sparse layers; exact reads gamma sparse steps + one dense pass per round,
divided by the measured tokens per round.

Per dense-layer set, a "plan" line: the gamma (or dense decoding) that the cost model
(`sparsity/exact_cost.choose_per_bin`) picks from costs measured alone (the sparse run's step
as the draft step, a verify pass per gamma, the dense step) and the exact runs' mean alpha,
with each gamma's predicted ratio to dense beside the measured one: per row (the planner's
rate) and in lock step (the batch runs rounds until its slowest row is done,
`exact_cost.lockstep_rounds`: the expected maximum of the rows' round counts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.bench import xplane
from sparrow_jax.rollout.config import RolloutMode

PHASES = ("exact_draft", "exact_verify", "exact_accept")     # rollout/exact.py's named scopes


def kv_bytes_per_token(mcfg, context: int, *, budget: int | None, dense_layers, block_size: int,
                       itemsize: int) -> float:
    """KV (+ centroid) bytes one decode step reads for one row at `context` tokens;
    budget None = dense. Layers in dense_layers read densely either way."""
    per_tok = 2 * mcfg.num_key_value_heads * mcfg.head_dim * itemsize
    n = mcfg.num_hidden_layers
    if budget is None or budget >= context:
        return float(n * per_tok * context)
    n_dense = sum(1 for i in range(n) if i in dense_layers)
    centroids = (context // block_size) * mcfg.num_key_value_heads * mcfg.head_dim * itemsize
    return float(n_dense * per_tok * context + (n - n_dense) * (per_tok * budget + centroids))


def pass_stats(traj, gamma: int) -> dict[str, Any]:
    """Pooled over an exact run's rows: ``tokens_per_pass``, its ``predicted`` value from the
    ``mean_alpha`` and the ``rounds`` counted (``exact.acceptance_by_bin`` in one bin).

    Each row's last round is left out: the bench stops every row at new_tokens, as a rule in
    the middle of a round, and a cut round counted as a full one lowers the mean (1-3% at 63
    decoded tokens per row, docs/benchmarks.md). ``rounds`` here are the rows' rounds counted,
    not the loop's iterations."""
    from sparrow_jax.rollout import exact
    return exact.acceptance_by_bin(traj, gamma=gamma, bin_size=1 << 30, drop_last_round=True)[0]


def _layer_sets(specs, default) -> list[tuple[int, ...]]:
    """--dense_layers values ("0,1", "none") -> layer tuples; None -> [default]."""
    if specs is None:
        return [tuple(default)]
    return [() if x.strip().lower() in ("", "none") else tuple(int(i) for i in x.split(","))
            for x in specs]


def _time(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def bench_context(model, context: int, args, base_cfg) -> list[dict[str, Any]]:
    from sparrow_jax.rollout import dense_attention, static, exact, start
    from sparrow_jax.rollout.config import padded_length
    budget = (args.budget or [1024])[0]
    gammas = args.gamma
    if context <= args.new_tokens + 1 or budget >= context:
        raise SystemExit(f"sparrow bench rollout: --context {context} must exceed --new_tokens "
                         f"{args.new_tokens} + 1 and --budget {budget}")
    plen = context - args.new_tokens
    rng = np.random.default_rng(args.seed)
    prompt = np.zeros((1, padded_length(plen, base_cfg.block_size)), np.int32)
    prompt[0, :plen] = rng.integers(1, model.config.vocab_size, plen)
    common = dict(max_new_tokens=args.new_tokens, temperature=1.0, max_budget=budget)
    pre_cfg = dataclasses.replace(base_cfg, mode="exact_sparse", gamma=max(gammas), **common)
    state = jax.block_until_ready(start(model, prompt, np.asarray([plen], np.int32), cfg=pre_cfg,
                                        group_size=args.batch, rng=jax.random.key(args.seed)))
    budgets = jnp.asarray(np.full(20, budget, np.int32))
    graphdef, params = nnx.split(model)
    progs: dict[str, tuple[Any, Any]] = {
        "dense": (dataclasses.replace(base_cfg, mode="dense", **common), static.decode_program)}
    if args.before:        # the former dense baseline: attention through the chunked kernel
        progs["dense:kernel"] = progs["dense"]
    for layers in _layer_sets(args.dense_layers, base_cfg.dense_layers):
        tag = ",".join(map(str, layers)) or "none"
        progs[f"sparse:{tag}"] = (dataclasses.replace(base_cfg, mode="sparse", dense_layers=layers,
                                                      **common), static.decode_program)
        for g in gammas:
            progs[f"exact:{tag}:{g}"] = (dataclasses.replace(
                base_cfg, mode="exact_sparse", dense_layers=layers, gamma=g, **common),
                exact.decode_program)
            if args.before:        # the verify's prefix through the chunked dense decode kernel
                progs[f"exact:{tag}:{g}:kernel"] = progs[f"exact:{tag}:{g}"]
    compiled = {}
    for name, (cfg, prog) in progs.items():
        t0 = time.perf_counter()
        one_pass, kernel = dense_attention.ONE_PASS_BYTES, name.endswith(":kernel")
        if kernel:         # read when traced: a fresh trace, not the cached one-pass program
            dense_attention.ONE_PASS_BYTES = 0
            jax.clear_caches()
        try:
            compiled[name] = prog.lower(graphdef, params, state, budgets, cfg=cfg,
                                        bin_size=2000, spec=None).compile()
        finally:
            dense_attention.ONE_PASS_BYTES = one_pass
            if kernel:
                jax.clear_caches()
        print(f"#   compiled {name} at {context} in {time.perf_counter() - t0:.1f}s", flush=True)

    outputs: dict[str, Any] = {}

    def run(name):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))

        def call():
            outputs[name] = compiled[name](params, fresh, budgets)
            return outputs[name]
        return call

    wall: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name in progs:
            wall.setdefault(name, []).append(_time(run(name)))
    verify_ms = {g: _verify_ms(model, state, g, args.repeats) for g in gammas}
    shares = {}
    for name, (cfg, _) in progs.items():
        if cfg.mode == RolloutMode.EXACT_SPARSE:        # untimed: the profiler slows the run down
            shares[name] = xplane.profile(run(name), compiled[name].as_text(), PHASES)

    steps = args.batch * (args.new_tokens - 1)
    med = {k: statistics.median(v) for k, v in wall.items()}
    itemsize = jnp.dtype(model.dtype).itemsize
    mcfg, bs = model.config, base_cfg.block_size
    dense_kv = kv_bytes_per_token(mcfg, context, budget=None, dense_layers=(), block_size=bs,
                                  itemsize=itemsize)
    results = [{"context": context, "mode": "dense", "tok_s": steps / med["dense"], "ratio": 1.0,
                "ms_per_step": 1e3 * med["dense"] / (args.new_tokens - 1),
                "kv_bytes_per_token": dense_kv}]
    for name, (cfg, _) in progs.items():
        if name == "dense":
            continue
        layers = cfg.dense_layers
        sparse_kv = kv_bytes_per_token(mcfg, context, budget=budget, dense_layers=layers,
                                       block_size=bs, itemsize=itemsize)
        suffix = " (chunked kernel)" if cfg.mode == RolloutMode.DENSE else " (kernel prefix)"
        row = {"context": context, "mode": cfg.mode + (suffix if name.endswith(":kernel")
                                                       else ""), "budget": budget,
               "dense_layers": list(layers), "tok_s": steps / med[name],
               "ratio": med["dense"] / med[name]}
        if cfg.mode == RolloutMode.DENSE:        # --before: the chunked-kernel dense engine
            row.update(budget=None, dense_layers=[], ms_per_step=1e3 * med[name] / (
                args.new_tokens - 1), kv_bytes_per_token=dense_kv)
        elif cfg.mode == RolloutMode.SPARSE:
            row.update(ms_per_step=1e3 * med[name] / (args.new_tokens - 1),
                       kv_bytes_per_token=sparse_kv)
        else:
            traj, carry = outputs[name]
            rounds = int(carry[1]) - 1                  # loop iterations (step starts at 1)
            stats = pass_stats(traj, cfg.gamma)
            per_pass = stats["tokens_per_pass"]
            sparse_ms = 1e3 * med[f"sparse:{','.join(map(str, layers)) or 'none'}"] / (
                args.new_tokens - 1)
            round_ms = 1e3 * med[name] / rounds
            phase = {f"{k.removeprefix('exact_')}_ms": round_ms * v
                     for k, v in shares[name].items()}
            row.update(gamma=cfg.gamma, tokens_per_pass=per_pass, mean_alpha=stats["mean_alpha"],
                       predicted_tokens_per_pass=stats["predicted"], rounds=rounds,
                       ms_per_round=round_ms, **phase, verify_alone_ms=verify_ms[cfg.gamma],
                       sparse_step_ms=sparse_ms,
                       kv_bytes_per_token=(cfg.gamma * sparse_kv + dense_kv) / per_pass)
        results.append(row)
    return results + plan_rows(results, dense_ms=1e3 * med["dense"] / (args.new_tokens - 1),
                               verify_ms=verify_ms, rows=args.batch, tokens=args.new_tokens - 1)


def plan_rows(results: list[dict], *, dense_ms: float, verify_ms: dict[int, float],
              rows: int = 1, tokens: int = 0) -> list[dict]:
    """Per dense-layer set: the gamma `exact_cost.choose_per_bin` picks (dense included) from
    costs measured alone - a sparse step at the budget (the draft step), a verify pass per
    gamma, a dense step - and the mean alpha of the exact runs, with each gamma's predicted
    ratio to dense beside its measured one (the check that the cost model picks the gamma
    that measures best). `predicted_ratio` is per row (the planner's rate); with `tokens`,
    `predicted_lockstep_ratio` also counts the rounds the batch of `rows` runs in lock step
    until its slowest row has `tokens` tokens (`exact_cost.lockstep_rounds`), as the bench's
    loop does."""
    from sparrow_jax.sparsity.exact_cost import choose_per_bin, lockstep_rounds, tokens_per_pass
    out = []
    for layers in sorted({tuple(r["dense_layers"]) for r in results if r["mode"] == "sparse"}):
        runs = [r for r in results if r["mode"] == "exact_sparse"
                and tuple(r["dense_layers"]) == layers]
        if not runs:
            continue
        alpha = float(np.mean([r["mean_alpha"] for r in runs]))
        draft_ms = runs[0]["sparse_step_ms"]
        plan = choose_per_bin([runs[0]["budget"]], [[alpha]], [draft_ms],
                              {r["gamma"]: verify_ms[r["gamma"]] for r in runs}, dense_ms)
        predicted = {r["gamma"]: float(tokens_per_pass(alpha, r["gamma"])) * dense_ms / (
            r["gamma"] * draft_ms + verify_ms[r["gamma"]]) for r in runs}
        lockstep = {r["gamma"]: tokens * dense_ms / (
            lockstep_rounds(alpha, r["gamma"], tokens, rows)
            * (r["gamma"] * draft_ms + verify_ms[r["gamma"]])) for r in runs} if tokens else {}
        best = max(runs, key=lambda r: r["ratio"])
        out.append({"context": runs[0]["context"], "mode": "plan", "dense_layers": list(layers),
                    "alpha": alpha, "draft_ms": draft_ms, "dense_ms": dense_ms,
                    "verify_ms": {g: verify_ms[g] for g in predicted},
                    "chosen_gamma": plan.gammas[0], "chosen_predicted": plan.speedup[0],
                    "predicted_ratio": predicted, "predicted_lockstep_ratio": lockstep,
                    "measured_ratio": {r["gamma"]: r["ratio"] for r in runs},
                    "measured_best_gamma": best["gamma"]})
    return out


def _verify_ms(model, state, gamma: int, repeats: int) -> float:
    """Median ms of one verify pass alone (gamma + 1 tokens per row, dense, cache donated)."""
    from sparrow_jax.rollout.exact import verify_forward
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1, 2))     # in place, as inside the loop
    def one(params, ks, vs, starts, seq):
        return verify_forward(nnx.merge(graphdef, params), ks, vs, starts, seq)

    ks, vs = list(jax.tree.map(jnp.copy, state.cache.k)), list(jax.tree.map(jnp.copy,
                                                                            state.cache.v))
    b = state.tokens.shape[0]
    seq = jnp.ones((b, gamma + 1), jnp.int32)
    starts = state.cache.lengths
    ks, vs, _, _ = jax.block_until_ready(one(params, ks, vs, starts, seq))     # compile
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        ks, vs, logits, _ = jax.block_until_ready(one(params, ks, vs, starts, seq))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(model, args, base_cfg, device: str, backend: str) -> int:
    shape = {k: getattr(model.config, k) for k in ("num_hidden_layers", "hidden_size",
                                                   "num_key_value_heads", "head_dim",
                                                   "vocab_size")}
    print(f"# exact-sparse bench: model {shape} {jnp.dtype(model.dtype).name}, batch "
          f"{args.batch}, new_tokens {args.new_tokens}, budget {(args.budget or [1024])[0]}, "
          f"backend {backend}, device {device}, repeats {args.repeats}", flush=True)
    print(f"{'context':>8} {'mode':>13} {'dense lyr':>9} {'g':>2} {'tok/s':>8} {'ratio':>6} "
          f"{'tok/pass':>8} {'pred':>5} {'alpha':>6} {'KV MB/tok':>9} {'round ms':>9} "
          f"{'draft':>7} {'verify':>7} {'accept':>7} {'other':>7}", flush=True)
    for context in args.context:
        for r in bench_context(model, context, args, base_cfg):
            if r["mode"] == "plan":
                layers = ",".join(map(str, r["dense_layers"])) or "none"
                pairs = ", ".join(f"gamma {g}: {r['predicted_ratio'][g]:.2f}x predicted "
                                  f"({r['predicted_lockstep_ratio'][g]:.2f}x in lock step) / "
                                  f"{r['measured_ratio'][g]:.2f}x measured"
                                  for g in r["predicted_ratio"])
                what = (f"gamma {r['chosen_gamma']}" if r["chosen_gamma"] else "dense decoding")
                print(f"# plan at {context} (dense layers {layers}, alpha {r['alpha']:.3f}; "
                      f"costs alone: dense {r['dense_ms']:.1f} ms, draft {r['draft_ms']:.1f} ms "
                      f"a step, verify {r['verify_ms']} ms): chooses {what} "
                      f"({r['chosen_predicted']:.2f}x predicted); {pairs}; measured best: gamma "
                      f"{r['measured_best_gamma']}", flush=True)
                if args.json:
                    print(json.dumps({"bench": "rollout_exact_plan", **r}), flush=True)
                continue
            def f(key, spec, width):
                return f"{r[key]:>{width}{spec}}" if key in r else " " * width
            layers = ",".join(map(str, r.get("dense_layers", []))) or (
                "all" if r["mode"].startswith("dense") else "none")
            print(f"{context:>8} {r['mode']:>13} {layers:>9} {f('gamma', 'd', 2)} "
                  f"{f('tok_s', '.1f', 8)} {r['ratio']:>5.2f}x {f('tokens_per_pass', '.2f', 8)} "
                  f"{f('predicted_tokens_per_pass', '.2f', 5)} {f('mean_alpha', '.3f', 6)} "
                  f"{r['kv_bytes_per_token'] / 2**20:>9.2f} {f('ms_per_round', '.1f', 9)} "
                  f"{f('draft_ms', '.1f', 7)} {f('verify_ms', '.1f', 7)} "
                  f"{f('accept_ms', '.1f', 7)} {f('other_ms', '.1f', 7)}",
                  flush=True)
            if args.json:
                print(json.dumps({"bench": "rollout_exact", "device": device, "backend": backend,
                                  "batch": args.batch, "new_tokens": args.new_tokens,
                                  "repeats": args.repeats, **r}), flush=True)
    return 0
