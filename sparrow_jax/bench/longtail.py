"""`sparrow bench rollout --workload longtail`: the static engine vs the paged continuous one on
an RL-like workload, at equal KV memory, dense and sparse, in one run.

Workload: `--samples` samples (`--group` per prompt, GRPO style) of prompts of `--prompt_len`
tokens (uniform in [prompt_len / 2, prompt_len]), sampled at temperature 1 from a random model
with `vocab / --mean_len` stop tokens: response lengths are then about geometric with mean
`--mean_len`, truncated at `--new_tokens` (a long tail, like RL responses: most short, a few
at the cap). The measured length distribution is printed. Both engines key every token by
(sample, index), so they generate exactly the same samples (checked): the same work.

Equal memory: the static engine gets `--static_batch` rows at a time (its cache: rows x
(prompt width + new_tokens) tokens) and runs the samples in waves, each until its longest row
ends; the paged engine gets a page pool of exactly those bytes and `--samples` slots, admitting
samples while pages last (continuous batching, preemption when the pool runs out).

Timing: tokens/s = generated tokens / wall time of the whole rollout (prefills included); one
untimed warm-up run per engine compiles its programs first; then `--repeats` timed runs,
engines interleaved (median); `cpu s`: the median run's process CPU seconds (every thread;
steadier than wall time where other jobs share the cores). `host ms/chunk`: the paged engine's host time per decode chunk
with no program in flight (the device waiting for the scheduler's bookkeeping,
`PagedStats.host_seconds`); `--before` adds each paged run without the overlap
(`RolloutConfig.overlap_chunks = False`: every chunk read back before the next is dispatched);
`--ladders S P M [N]` adds each paged run at `RolloutConfig.slot_ladder` S, `page_ladder` P,
`min_table_pages` M (and `min_slots` N); repeated, one arm each (coarser shape buckets: fewer
programs). `programs`: the distinct program
shapes the engine's warm-up compiled (`COMPILES`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import jax
import numpy as np


def workload(args, vocab: int, block_size: int):
    """(prompt tokens [P, prompt_len], their lengths [P], stop ids): `--samples / --group`
    random prompts of prompt_len / 2 .. prompt_len tokens and the vocabulary's last
    vocab / mean_len ids as stop tokens (the module docstring's long tail)."""
    rng = np.random.default_rng(args.seed)
    prompts = args.samples // args.group
    lengths = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, prompts)
    tokens = np.zeros((prompts, args.prompt_len), np.int32)
    stop = max(1, round(vocab / args.mean_len))
    stop_ids = tuple(range(vocab - stop, vocab))
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(1, vocab - stop, n)
    return tokens, lengths.astype(np.int32), stop_ids


def ladder(cap: int, per_octave: int, smallest: int = 64) -> tuple[int, ...]:
    """Response-length buckets up to cap: the default two per octave, or powers of two."""
    from sparrow_jax.runtime.shapes import default_buckets
    if per_octave == 2:
        return default_buckets(cap, multiple=16, smallest=smallest)
    out, b = [], smallest
    while b < cap:
        out.append(b)
        b *= 2
    return tuple(out) + (cap,)


def learner_padding(prompt_lengths, response_lengths, prompt_width: int, buckets, bs: int
                    ) -> float:
    """The share of padding in the learner's batch: every row padded to prompt width + the
    longest response rounded up to a bucket (`trim_to_bucket`), then to a block multiple."""
    from sparrow_jax.rollout.config import padded_length
    from sparrow_jax.runtime.shapes import bucket_length
    t = min(bucket_length(int(max(response_lengths)), buckets), max(buckets))
    seq = padded_length(prompt_width + t, bs)
    real = float(np.sum(prompt_lengths) + np.sum(response_lengths))
    return 1.0 - real / (len(response_lengths) * seq)


def _static_rollout(model, tokens, lengths, cfg, budgets, group: int, wave_prompts: int, key):
    """Waves of `wave_prompts` prompts (the static engine's memory), one after the other."""
    from sparrow_jax.rollout import generate
    outs = [generate(model, tokens[w:w + wave_prompts], lengths[w:w + wave_prompts], cfg=cfg,
                     budgets=budgets, group_size=group, rng=key, first_sample=w * group)
            for w in range(0, len(tokens), wave_prompts)]
    return (np.concatenate([np.asarray(o.tokens) for o in outs]),
            np.concatenate([np.asarray(o.response_lengths) for o in outs]))


def _paged_rollout(model, tokens, lengths, cfg, budgets, group: int, wave_prompts: int, key,
                   spec=None):
    """Every prompt in one call: the pool admits what fits (same sample keys as the waves).
    With `spec` (several processes): this process's prompts; its rows come back."""
    from sparrow_jax.rollout import generate
    from sparrow_jax.runtime import multihost
    out = generate(model, tokens, lengths, cfg=cfg, budgets=budgets, group_size=group, rng=key,
                   spec=spec)
    return multihost.local_rows(out.tokens), multihost.local_rows(out.response_lengths)


def run(model, args, base_cfg, device: str, backend: str, spec=None) -> int:
    """spec: several processes (`--processes`, sparrow_jax.bench.processes): the paged engine
    only, overlapped vs sync, each process passing its block of the prompts."""
    from sparrow_jax.rollout.kv_cache import cache_bytes
    from sparrow_jax.rollout import continuous
    from sparrow_jax.runtime import multihost
    from sparrow_jax.runtime.shapes import COMPILES
    mcfg = model.config
    if args.samples % args.group or args.static_batch % args.group:
        raise SystemExit("sparrow bench rollout: --samples and --static_batch must be multiples "
                         "of --group")
    tokens, lengths, stop_ids = workload(args, mcfg.vocab_size, base_cfg.block_size)
    if spec is not None:
        from sparrow_jax.bench import processes
        tokens, lengths = processes.my_prompts(tokens, lengths)
    t = args.new_tokens
    key = jax.random.key(args.seed)
    wave_prompts = args.static_batch // args.group
    budget = args.budget[0] if args.budget else 256
    budgets = np.full(20, budget, np.int32)
    width = base_cfg.prompt_width(args.prompt_len)
    bs = base_cfg.block_size
    static_bytes = cache_bytes(mcfg, args.static_batch, -(-(width + t) // bs) * bs, model.dtype,
                               bs)
    print(f"# longtail: {args.samples} samples ({args.group} per prompt), prompts "
          f"{args.prompt_len // 2}-{args.prompt_len} tokens, new_tokens cap {t}, "
          f"{len(stop_ids)} stop ids of {mcfg.vocab_size} (geometric lengths, mean ~"
          f"{args.mean_len}), sparse budget {budget}, backend {backend}, device {device}, "
          f"KV memory {static_bytes / 2**20:.1f} MiB for both engines (static: "
          f"{args.static_batch} rows x {width + t} tokens)"
          + (f"; paged only, {jax.process_count()} processes, a pool that size on each"
             if spec else ""), flush=True)
    header = (f"{'mode':>6} {'engine':>21} {'tok/s':>9} {'wall s':>8} {'ratio':>6} "
              f"{'KV alloc MiB':>13} {'KV peak MiB':>12} {'preempt':>8} {'same samples':>13} "
              f"{'chunks':>7} {'host ms/chunk':>14} {'programs':>9} {'cpu s':>8}")
    print(header, flush=True)
    for mode in args.modes:
        cfg = dataclasses.replace(base_cfg, mode=mode, max_new_tokens=t, temperature=1.0,
                                  stop_token_ids=stop_ids, max_budget=max(budget, 48))
        # Several processes: the paged engine alone (one pool per process, each of the static
        # engine's bytes), compared with its own sync loop.
        engines: dict[str, Any] = ({} if spec or args.no_static
                                   else {"static": (cfg, _static_rollout)})
        for c in args.chunk_steps:
            for overlap in (True, False) if args.before or spec else (True,):
                engines[f"paged/chunk{c}" + ("" if overlap else "/sync")] = (dataclasses.replace(
                    cfg, engine="paged", pool_bytes=static_bytes, max_slots=args.samples,
                    chunk_steps=c, overlap_chunks=overlap), _paged_rollout)
            for lad in args.ladders or ():   # the same paged run at other ladders, interleaved
                if len(lad) not in (3, 4):
                    raise SystemExit(f"--ladders takes SLOT PAGE MIN_PAGES [MIN_SLOTS], got {lad}")
                sl, pl, mp, ms = (*lad, 1)[:4]
                name = f"paged/chunk{c}/L{sl}x{pl}" + (f"s{ms}" if len(lad) == 4 else "")
                name += f"m{mp}" if name in engines else ""
                engines[name] = (dataclasses.replace(
                    cfg, engine="paged", pool_bytes=static_bytes, max_slots=args.samples,
                    chunk_steps=c, slot_ladder=sl, page_ladder=pl, min_table_pages=mp,
                    min_slots=ms), _paged_rollout)

        def go(name):
            ecfg, fn = engines[name]
            kw = {"spec": spec} if spec else {}
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn(model, tokens, lengths, ecfg, budgets, args.group, wave_prompts, key, **kw)
            cpu[name].append(time.process_time() - c0)
            return time.perf_counter() - t0, out, dataclasses.replace(continuous.LAST_STATS)

        warm, programs = {}, {}
        cpu: dict[str, list[float]] = {name: [] for name in engines}   # process CPU s per run
        for name in engines:                                         # compiles every program
            COMPILES.clear()
            warm[name] = go(name)
            programs[name] = sum(COMPILES.counts().values())         # distinct program shapes
        reference = next(iter(engines))                   # ratios and samples relative to it
        ref_tokens, resp = warm[reference][1]
        resp = multihost.all_rows(resp)                   # every process's rows
        generated = int(resp.sum())
        if mode == args.modes[0]:
            print(f"# response lengths: mean {resp.mean():.0f}, p50 {np.median(resp):.0f}, "
                  f"p90 {np.percentile(resp, 90):.0f}, max {resp.max()}, at cap "
                  f"{(resp >= t).mean():.0%}; {generated} tokens", flush=True)
            plens = np.repeat(lengths, args.group)[:len(resp)]
            two, one = (learner_padding(plens, resp, width, ladder(t, k), bs) for k in (2, 1))
            print(f"# learner padded-token share of one batch of these samples (prompt width "
                  f"{width}): {two:.3f} at two response buckets per octave, {one:.3f} at "
                  "one (powers of two)", flush=True)
        walls: dict[str, list[float]] = {name: [] for name in engines}
        stats: dict[str, list] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name in engines:
                w, _, st = go(name)
                walls[name].append(w)
                stats[name].append(st)
        base = generated / statistics.median(walls[reference])
        for name in engines:
            rate = generated / statistics.median(walls[name])
            same = bool(multihost.all_rows(np.asarray(
                [np.array_equal(ref_tokens, warm[name][1][0])])).all())
            chunks = host_ms = overlapped = None
            if name == "static":
                alloc = peak = static_bytes
                pre = 0
            else:
                st = stats[name][-1]
                alloc, peak, pre = st.pages_per_pool * st.page_bytes, st.peak_bytes, st.preemptions
                chunks, overlapped = st.chunks, st.overlapped_chunks
                host_ms = statistics.median(s.host_ms_per_chunk for s in stats[name])
            cells = (("-", "-") if chunks is None else
                     (f"{chunks}", f"{host_ms:.2f}", f"{programs[name]}"))
            print(f"{mode:>6} {name:>21} {rate:>9.1f} {statistics.median(walls[name]):>8.2f} "
                  f"{rate / base:>5.2f}x {alloc / 2**20:>13.1f} {peak / 2**20:>12.1f} "
                  f"{pre:>8} {'yes' if same else 'NO':>13} {cells[0]:>7} {cells[1]:>14} "
                  f"{cells[-1]:>9} {statistics.median(cpu[name][1:]):>8.2f}",
                  flush=True)
            if args.json:
                print(json.dumps({"bench": "rollout", "workload": "longtail", "mode": mode,
                                  "processes": jax.process_count(),
                                  "guard_ms_per_chunk": None if chunks is None else
                                  1e3 * st.guard_seconds / max(chunks, 1),
                                  "engine": name, "tok_s": rate, "ratio": rate / base,
                                  "wall_s": walls[name], "cpu_s": cpu[name][1:],
                                  "generated_tokens": generated,
                                  "kv_alloc_bytes": alloc, "kv_peak_bytes": peak,
                                  "preemptions": pre, "same_samples": same,
                                  "chunks": chunks, "overlapped_chunks": overlapped,
                                  "host_ms_per_chunk": host_ms,
                                  "programs": None if chunks is None else programs[name],
                                  "samples": args.samples, "group": args.group,
                                  "new_tokens": t, "mean_len": args.mean_len,
                                  "static_batch": args.static_batch, "budget": budget,
                                  "device": device, "backend": backend}), flush=True)
    return 0
