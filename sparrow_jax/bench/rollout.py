"""`sparrow bench rollout`: dense vs block-sparse rollout decode throughput on a random model.
(`--workload longtail`: static vs paged engine at equal memory, see `longtail_bench`;
`--workload exact`: dense vs approximate vs exact sparse, sparrow_jax.bench.exact;
`--workload rl`: an RL rollout on the config's paged engine and schedule, sparrow_jax.bench.rl.)

    sparrow bench rollout [gin files] [--gin_param ...] [--json] [--preset qwen3-1.7b]
        [--layers 4 --hidden 512 --heads 8 --kv_heads 2 --head_dim 64 --vocab 4096]
        [--context 8192 16384] [--budget 1024] [--schedule NAME|config] [--batch 4 [N ...]]
        [--new_tokens 64] [--engine static|paged] [--before] [--xla_selection] [--profile DIR]

Bytes limit (issue 55): every row also gives, dense and sparse, the bytes one decode step must
read (weights once, each row's KV as attended, centroids, selection metadata;
`sparsity.cost_model.decode_step_bytes`), the copy bandwidth measured at the start of the run on
the same device, the bytes-limit time (bytes / bandwidth) and the measured step's % of it
(`sparrow_jax.bench.bytes_limit`). `--schedule config` takes the gin files' `make_schedule` (a
shipped config's schedule); `--batch` takes one value or one per `--context`; `--engine paged`
times the paged engine's decode chunks instead (`sparrow_jax.bench.paged_decode`).

For each context length, one random prompt of (context - new_tokens) tokens is prefilled once and
sampled `batch` times (group sampling, as in GRPO), in dense and in sparse mode, through the real
engine (`sparrow_jax.rollout.start` + `decode`, which `generate` chains).

Timing method. The engine runs two compiled programs, prefill (`rollout.start`) and the decode
loop (`rollout.decode`). Prefill runs once per context (its state is mode-independent); each
timed run decodes a fresh copy of that state (the copy is not timed), so decode time is measured
directly: decode tokens/s = batch x (new_tokens - 1) / t_decode (median of --repeats). Programs
are compiled ahead of time (not timed); dense and sparse runs are interleaved so load from other
processes hits both alike. Stop tokens are disabled: every row decodes exactly new_tokens
tokens. The JSON lines also carry `ratio_cpu_time`, the ratio of decode tokens per process-CPU-
second: steadier under other processes' load than wall time, but not a throughput (dense decode
spreads over more threads than the sparse gather does).

--before adds, for every sparse run, the same run with the former per-step work (issue 30):
block selection by `lax.top_k` + sort (`selection.select_from_scores_reference`) and a top-20
vocabulary record every step; the other runs record the top-k only if LearnerConfig.alpha_mode
reads it (`RolloutConfig.for_alpha_mode`), so one run prints tokens/s before and after.

The engine's per-step cost depends only on the cache capacity (static shapes: dense decode reads
the whole buffer, sparse decode gathers max_budget tokens), not on the live length, so a short
--new_tokens at a fixed --context measures the same per-step cost as a long one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.bench import bytes_limit
from sparrow_jax.bench.rollout_runs import (BEFORE_TOPK, SparseRun, former_selection,
                                          selection_path, sparse_config, sparse_runs)
from sparrow_jax.model.config import QWEN3_PRESETS

_DTYPES = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparrow bench rollout", description=__doc__.split("\n")[0])
    p.add_argument("gin_files", nargs="*", help="gin config files (e.g. RolloutConfig settings)")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding override")
    p.add_argument("--json", action="store_true", help="also print one JSON line per run")
    p.add_argument("--preset", choices=sorted(QWEN3_PRESETS), default=None,
                   help="model shape preset (overrides the size flags; too big for CPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x hidden)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, nargs="+", default=[8192, 16384],
                   help="total tokens per row at the end of generation (prompt + new tokens)")
    p.add_argument("--budget", type=int, nargs="*", default=None,
                   help="fixed KV budgets in tokens (default 1024 when no --schedule)")
    p.add_argument("--schedule", default=None,
                   help="also run a per-bin schedule (name, JSON, or 'config': the gin files' "
                        "make_schedule)")
    p.add_argument("--batch", type=int, nargs="+", default=[4],
                   help="decode rows (samples of the prompt): one value, or one per --context")
    p.add_argument("--engine", choices=("static", "paged"), default="static",
                   help="fixed workload: the engine timed (paged: its decode chunks, "
                        "RolloutConfig's paged settings)")
    p.add_argument("--new_tokens", type=int, default=None,
                   help="tokens per row (fixed workload, default 64); the cap (longtail, 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per program (median)")
    p.add_argument("--backend", default=None, help="kernel backend (default RolloutConfig.backend)")
    p.add_argument("--dense_layers", nargs="+", default=None,
                   help="sparse-mode dense layers: comma-separated ids or 'none'; several sets "
                        "run side by side, e.g. --dense_layers 0,1 none (default: "
                        "RolloutConfig.dense_layers)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, run each decode program once more under the JAX "
                        "profiler: DIR/<context>-<program>/ holds its trace and optimized HLO "
                        "(`python -m sparrow_jax.bench.xplane DIR/...` breaks it down by phase)")
    p.add_argument("--xla_selection", action="store_true",
                   help="also run every sparse variant with block selection in XLA "
                        "(RolloutConfig.selection = 'xla'), beside the default that runs it "
                        "where attention runs (one Pallas Triton kernel on a GPU)")
    p.add_argument("--before", action="store_true",
                   help="also time each sparse run with the former top_k + sort selection and "
                        "per-step top-20 record (tokens/s before/after in one run); longtail: "
                        "each paged run without the host loop overlap")
    p.add_argument("--gamma", type=int, nargs="+", default=[4],
                   help="--workload exact: tokens drafted per verify pass (one run each)")
    p.add_argument("--workload", choices=("fixed", "longtail", "exact", "rl"), default="fixed",
                   help="fixed: dense vs sparse decode at given contexts; longtail: static vs "
                        "paged engine on long-tailed responses at equal KV memory "
                        "(sparrow_jax.bench.longtail); rl: distinct prompts x --group samples, "
                        "long-tailed lengths, the config's paged engine and schedule, dense vs "
                        "sparse (sparrow_jax.bench.rl)")
    lt = p.add_argument_group("longtail and rl workloads")
    lt.add_argument("--samples", type=int, default=64, help="rollouts (prompts x --group)")
    lt.add_argument("--ladders", type=int, nargs="+", action="append", default=None,
                    metavar="N",
                    help="SLOT PAGE MIN_PAGES [MIN_SLOTS]: also run each paged config at these "
                         "RolloutConfig.slot_ladder, page_ladder, min_table_pages (and "
                         "min_slots); MIN_PAGES above a sample's page cap: one table width; repeat "
                         "the flag for more arms (interleaved; 'programs' counts shapes)")
    lt.add_argument("--no_static", action="store_true",
                    help="paged runs only (the first paged config is the ratios' reference)")
    lt.add_argument("--group", type=int, default=8, help="samples per prompt")
    lt.add_argument("--prompt_len", type=int, default=128)
    lt.add_argument("--mean_len", type=int, default=256, help="mean response length")
    lt.add_argument("--static_batch", type=int, default=16,
                    help="static engine rows at once (sets both engines' KV memory)")
    lt.add_argument("--chunk_steps", type=int, nargs="+", default=[32],
                    help="paged engine decode steps per compiled chunk (one run each)")
    lt.add_argument("--modes", nargs="+", choices=("dense", "sparse"),
                    default=["dense", "sparse"])
    lt.add_argument("--processes", type=int, default=1,
                    help="N > 1: the paged engine across N local JAX processes on the CPU, "
                         "overlapped vs sync (sparrow_jax.bench.processes)")
    lt.add_argument("--devices_per_process", type=int, default=1,
                    help="with --processes: CPU devices per process (the mesh's model axis)")
    return p


def model_config(args: argparse.Namespace):
    from sparrow_jax.model import Qwen3Config
    from sparrow_jax.model.config import qwen3_preset
    # Long contexts need positions beyond the HF default; RoPE itself has no limit.
    positions = max(args.context) + 16
    if args.preset:      # the public checkpoint's exact shape (`sparrow dryrun --preset` too)
        return dataclasses.replace(qwen3_preset(args.preset), max_position_embeddings=positions)
    return Qwen3Config(num_hidden_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       head_dim=args.head_dim, intermediate_size=args.intermediate or 3 * args.hidden,
                       vocab_size=args.vocab, max_position_embeddings=positions)


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - w0, time.process_time() - c0


def _precompile(model, state, cfg, budgets, bin_size: int) -> tuple[float, Any]:
    """Compiles the decode program for `state` without running it; returns (seconds, the
    compiled program). Arguments mirror what `rollout.decode` passes, so the timed calls hit
    this compilation."""
    from flax import nnx
    from sparrow_jax.rollout import static
    graphdef, params = nnx.split(model)
    t0 = time.perf_counter()
    compiled = static.decode_program_for(cfg).lower(graphdef, params, state,
                                                    jnp.asarray(budgets, jnp.int32), cfg=cfg,
                                                    bin_size=bin_size, spec=None).compile()
    return time.perf_counter() - t0, compiled


def _profile(run, name: str, context: int, directory: str, compiled) -> str:
    """One more (untimed) run of program `name` under the JAX profiler, saved with its
    optimized HLO in directory/<context>-<name>/ (`xplane.save_profile`). Returns the folder."""
    import re
    from sparrow_jax.bench import xplane
    folder = f"{directory}/{context}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}"
    return xplane.save_profile(run(name), folder, compiled.as_text())


def bench_context(model, context: int, args: argparse.Namespace, base_cfg,
                  variants: Sequence[SparseRun], bandwidth: float) -> list[dict[str, Any]]:
    """Dense + every sparse variant at one context length; one result dict per variant, with
    the bytes-limit fields of both (`bench.bytes_limit`; `bandwidth`: the copy bandwidth)."""
    from sparrow_jax.rollout import decode, start
    from sparrow_jax.rollout.config import padded_length
    from sparrow_jax.rollout.kv_cache import check_cache_fits
    if context <= args.new_tokens + 1:
        raise SystemExit(f"sparrow bench rollout: --context {context} must exceed --new_tokens "
                         f"{args.new_tokens} + 1")
    rng = np.random.default_rng(args.seed)
    plen = context - args.new_tokens
    prompt = np.zeros((1, padded_length(plen, base_cfg.block_size)), np.int32)
    prompt[0, :plen] = rng.integers(1, model.config.vocab_size, plen)
    lengths = np.asarray([plen], np.int32)
    key = jax.random.key(args.seed)
    try:    # the prefilled cache (copied for every timed run) + the copy a run consumes
        slots = dataclasses.replace(base_cfg, mode="dense", max_new_tokens=args.new_tokens
                                    ).cache_slots(prompt.shape[1])
        check_cache_fits(model.config, 2 * args.batch, slots,
                         model.dtype, block_size=base_cfg.block_size)
    except MemoryError as e:
        raise SystemExit(f"sparrow bench rollout: at --context {context} --batch {args.batch} "
                         f"the bench holds two KV caches (the prefilled one and a timed run's "
                         f"copy), counted here as one of batch {2 * args.batch}: {e}") from None

    # name -> (cfg, budgets, bin_size) of each decode program; names of the --before ones.
    progs: dict[str, tuple[Any, np.ndarray, int]] = {}
    before = {v.key for v in variants if v.before}
    dense_cfg = dataclasses.replace(base_cfg, mode="dense", max_new_tokens=args.new_tokens)
    progs["dense"] = (dense_cfg, np.full(20, 1 << 20, np.int32), 2000)  # budgets unused
    for v in variants:
        cfg, budgets = sparse_config(base_cfg, v, context, args.new_tokens)
        if v.before:   # a distinct static config: its own compiled program, traced swapped
            if cfg.record_topk == BEFORE_TOPK:
                raise SystemExit("sparrow bench rollout: --before compares against a top-20 "
                                 "record; this configuration records it already (alpha_mode "
                                 "'topk')")
            cfg = dataclasses.replace(cfg, record_topk=BEFORE_TOPK)
        progs[v.key] = (cfg, budgets, v.bin_size)

    # One prefill for every mode; its time includes compiling the prefill program.
    t0 = time.perf_counter()
    state = jax.block_until_ready(start(model, prompt, lengths, cfg=dense_cfg,
                                        group_size=args.batch, rng=key))
    pre_w = time.perf_counter() - t0
    # The --before programs record a wider top-k: the same state with wider (zero) buffers.
    states = {k: state if k == dense_cfg.record_topk else dataclasses.replace(
        state, topk_logprobs=jnp.zeros(state.tokens.shape + (k,), jnp.float32),
        topk_ids=jnp.zeros(state.tokens.shape + (k,), jnp.int32))
        for k in {c.record_topk for c, _, _ in progs.values()}}
    compile_s, compiled = {}, {}
    for name, (cfg, budgets, bin_size) in progs.items():
        with former_selection(name in before):
            compile_s[name], compiled[name] = _precompile(model, states[cfg.record_topk], cfg,
                                                          budgets, bin_size)

    def run(name: str):
        cfg, budgets, bin_size = progs[name]
        # decode consumes its state (donated): a fresh copy per run, not timed.
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, states[cfg.record_topk]))

        def call():
            with former_selection(name in before):
                return decode(model, fresh, cfg=cfg, budgets=budgets, bin_size=bin_size)
        return call

    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name in progs:  # interleaved: background load affects dense and sparse alike
            w, c = _timed(run(name))
            wall.setdefault(name, []).append(w)
            cpu.setdefault(name, []).append(c)

    if getattr(args, "profile", None):
        for name in progs:
            print(f"sparrow bench rollout: profile of {name} at {context} in "
                  f"{_profile(run, name, context, args.profile, compiled[name])}", flush=True)

    steps = args.batch * (args.new_tokens - 1)

    def decode_rate(name: str) -> dict[str, float]:
        dt, dc = statistics.median(wall[name]), statistics.median(cpu[name])
        return {"tok_s": steps / dt, "cpu_tok_s": steps / dc,
                "ms_per_step": 1e3 * dt / (args.new_tokens - 1),
                "s_per_step": dt / (args.new_tokens - 1)}

    dense = decode_rate("dense")
    # The timed steps feed tokens 1 .. new_tokens - 1: contexts plen + 1 .. plen + new_tokens - 1.
    ctx = plen + 1 + np.repeat(np.arange(args.new_tokens - 1)[:, None], args.batch, axis=1)
    results = []
    for v in variants:
        sparse = decode_rate(v.key)
        shape = bytes_limit.model_shape(model.config, model.dtype, v.dense_layers)
        results.append({
            "engine": "static",
            "context": context, "prompt_tokens": plen,
            "budget": int(v.budgets[0]) if v.fixed else None,
            "schedule": None if v.fixed else v.label, "bin_size": v.bin_size,
            "dense_layers": list(v.dense_layers), "before": v.before,
            "xla_selection": v.xla_selection,
            "selection": selection_path(progs[v.key][0]),
            "record_topk": progs[v.key][0].record_topk,
            "dense_tok_s": dense["tok_s"], "sparse_tok_s": sparse["tok_s"],
            "ratio": sparse["tok_s"] / dense["tok_s"],
            "ratio_cpu_time": sparse["cpu_tok_s"] / dense["cpu_tok_s"],
            "dense_ms_per_step": dense["ms_per_step"], "sparse_ms_per_step": sparse["ms_per_step"],
            "prefill_s": pre_w,
            "compile_s": {name: round(t, 2) for name, t in compile_s.items()
                          if name in ("dense", v.key)},
            "copy_bw_gbs": bandwidth / 1e9,
            **bytes_limit.limit_fields("dense", bytes_limit.mean_step_bytes(
                shape, ctx, None, v.bin_size, paged=False), bandwidth, dense["s_per_step"]),
            **bytes_limit.limit_fields("sparse", bytes_limit.mean_step_bytes(
                shape, ctx, progs[v.key][1], v.bin_size, paged=False), bandwidth,
                sparse["s_per_step"]),
        })
    return results


def _fmt(x: float, width: int, spec: str) -> str:
    return f"{x:>{width}{spec}}"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    # `sparrow bench rollout -- --json ...`: argparse's REMAINDER in the dispatcher only takes
    # option-first arguments after a `--`, which reaches us verbatim; drop it.
    if argv[:1] == ["--"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    from sparrow_jax.bench import processes
    spec = None
    if args.processes < 1 or args.devices_per_process < 1:
        raise SystemExit(f"sparrow bench rollout: --processes ({args.processes}) and "
                         f"--devices_per_process ({args.devices_per_process}) must be >= 1")
    if args.processes > 1:
        if args.workload != "longtail":
            raise SystemExit("sparrow bench rollout: --processes needs --workload longtail")
        if not processes.is_child():
            return processes.launch(argv, args.processes, args.devices_per_process)
        spec = processes.join()          # before anything touches the devices
    if args.new_tokens is None:
        args.new_tokens = 1024 if args.workload == "longtail" else 64
    from sparrow_jax.runtime import compile_cache
    from sparrow_jax.runtime.gin_files import parse_gin
    from sparrow_jax.train import trainer  # noqa: F401 - the configurables a run's files bind
    parse_gin(args.gin_files, args.gin_param)
    compile_cache.log_compiles()       # each compile's seconds (>= 1 s at INFO; device_check)

    import pallas_kernels
    from flax import nnx
    from sparrow_jax.model import Qwen3ForCausalLM, default_dtype
    from sparrow_jax.rollout import RolloutConfig

    batches = list(args.batch)
    if min(batches) < 1 or args.new_tokens < 2 or args.repeats < 1:
        raise SystemExit("sparrow bench rollout: need --batch >= 1, --new_tokens >= 2, "
                         "--repeats >= 1")
    if len(batches) > 1 and (args.workload != "fixed" or len(batches) != len(args.context)):
        raise SystemExit(f"sparrow bench rollout: --batch takes one value, or one per --context "
                         f"(fixed workload); got {len(batches)} for {len(args.context)} contexts")
    args.batch = batches[0]      # the other workloads' (and a single context's) batch
    overrides: dict[str, Any] = {"stop_token_ids": ()}
    if args.backend is not None:
        overrides["backend"] = args.backend
    try:
        from sparrow_jax.rl.learner import LearnerConfig
        # The top-k record only where the learner reads it, as the trainer does.
        base_cfg = dataclasses.replace(RolloutConfig(), **overrides).for_alpha_mode(
            LearnerConfig().alpha_mode)
        backend = pallas_kernels.resolve_backend(base_cfg.backend)
        variants = sparse_runs(args, base_cfg.dense_layers)
        mcfg = model_config(args)
    except (ValueError, OSError, pallas_kernels.BackendUnavailableError) as e:
        raise SystemExit(f"sparrow bench rollout: {e}") from None
    dtype = jnp.dtype(_DTYPES[args.dtype] or default_dtype())
    model = Qwen3ForCausalLM(mcfg, dtype=dtype, rngs=nnx.Rngs(args.seed))
    dev = jax.devices()[0]
    device = f"{dev.platform}:{dev.device_kind} x{jax.device_count()}"
    if spec is not None:
        from sparrow_jax.runtime.sharding import shard_model
        # Every process built the same random weights; each places its devices' slices.
        nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
        shard_model(model, spec.mesh, spec.rules)
        device += f" over {jax.process_count()} processes"
    if args.workload == "longtail":
        from sparrow_jax.bench import longtail as longtail_bench
        return longtail_bench.run(model, args, base_cfg, device, backend, spec)
    if args.workload == "exact":
        from sparrow_jax.bench import exact as exact_bench
        return exact_bench.run(model, args, base_cfg, device, backend)
    from sparrow_jax.runtime.bandwidth import copy_bandwidth
    bandwidth = copy_bandwidth()       # the bytes limit's denominator, this run, this device
    if args.workload == "rl":
        from sparrow_jax.bench import rl as rl_bench
        return rl_bench.run(model, args, base_cfg, device, backend, bandwidth)
    shape = {k: getattr(mcfg, k) for k in ("num_hidden_layers", "hidden_size",
                                             "num_attention_heads", "num_key_value_heads",
                                             "head_dim", "intermediate_size", "vocab_size")}
    paged = args.engine == "paged"
    method = ("paged decode chunks timed one at a time (median), prefill excluded" if paged
              else "decode program timed alone (median), prefill excluded")
    print(f"# model {args.preset or 'custom'} {shape} {dtype.name}, batch "
          f"{' '.join(map(str, batches))}, new_tokens {args.new_tokens}, engine {args.engine}"
          f"{f' (chunks of {base_cfg.chunk_steps} steps)' if paged else ''}, backend {backend}, "
          f"device {device}, repeats {args.repeats}, copy bandwidth {bandwidth / 1e9:.1f} GB/s",
          flush=True)
    header = (f"{'context':>8} {'batch':>5} {'budget/schedule':>16} {'dense layers':>12} "
              f"{'dense tok/s':>12} {'sparse tok/s':>13} {'ratio':>6} {'dense ms/step':>14} "
              f"{'sparse ms/step':>15} {'prefill s':>10} {'dense % limit':>13} "
              f"{'sparse % limit':>14}")
    print(header, flush=True)
    for context, batch in zip(args.context, batches * len(args.context)
                              if len(batches) == 1 else batches):
        ctx_args = argparse.Namespace(**{**vars(args), "batch": batch})
        if paged:
            from sparrow_jax.bench import paged_decode
            rows = paged_decode.bench_context(model, context, ctx_args, base_cfg, variants,
                                              bandwidth)
        else:
            rows = bench_context(model, context, ctx_args, base_cfg, variants, bandwidth)
        for r in rows:
            label = str(r["budget"]) if r["budget"] is not None else r["schedule"]
            label += " (before)" if r["before"] else ""
            label += " (xla sel.)" if r["xla_selection"] else ""
            layers = ",".join(map(str, r["dense_layers"])) or "none"
            cells = [_fmt(r[k], w, f) for k, w, f in (
                ("dense_tok_s", 12, ".1f"), ("sparse_tok_s", 13, ".1f"), ("ratio", 5, ".2f"),
                ("dense_ms_per_step", 14, ".2f"), ("sparse_ms_per_step", 15, ".2f"),
                ("prefill_s", 10, ".2f"), ("dense_pct_of_limit", 12, ".1f"),
                ("sparse_pct_of_limit", 13, ".1f"))]
            cells[2] += "x"
            cells[6] += "%"
            cells[7] += "%"
            print(f"{context:>8} {batch:>5} {label:>16} {layers:>12} " + " ".join(cells),
                  flush=True)
            unit = "GB" if r["dense_bytes_total"] >= 1e9 else "MB"
            print(f"{'':>8} bytes/step {bytes_limit.bytes_line(r, ('dense', 'sparse'), unit)}",
                  flush=True)
            if args.json:
                record = {"bench": "rollout", "model": args.preset or "custom", "config": shape,
                          "dtype": dtype.name, "batch": batch,
                          "new_tokens": args.new_tokens, "repeats": args.repeats,
                          "device": device, "backend": backend, "method": method, **r}
                print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
