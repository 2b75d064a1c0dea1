"""`sparrow bench rollout --workload rl`: an RL-shaped rollout on a run's own engine and
schedule, dense vs sparse, with its share of the bytes limit (issue 55).

Workload (`longtail.workload`): `--samples` rollouts, `--group` samples of each of
`--samples / --group` distinct random prompts of `--prompt_len / 2` .. `--prompt_len` tokens,
sampled at temperature 1 from a random model whose last `vocab / --mean_len` ids stop a sample:
response lengths are about geometric with mean `--mean_len`, capped at `--new_tokens` (a long
tail, as RL responses are: most short, a few at the cap). The measured lengths are printed.

Engine and budgets as a run of the gin files has them: `RolloutConfig` (the paged engine, which
`configs/qwen3_1p7b_gpu.gin` ships: its pool, slot and page ladders, chunk steps, overlap and
dense layers) and the schedule `make_schedule` binds there (budgets per length bin), or
`--schedule`. Dense mode runs the same engine at full attention.

Timing: tokens/s = generated tokens / the rollout's wall time (prefills and the host's
scheduling included); one untimed run per mode compiles its programs, then `--repeats` timed
runs, dense and sparse interleaved (median).

Bytes limit: what the rollout's decode work must read - the weights once per decode step the
engine ran (chunks x chunk_steps), each generated token's KV at its context (sparse layers: the
schedule's budget of its length bin; dense layers: whole), the centroids and the selection
metadata (`bench.bytes_limit.tokens_bytes`) - over the copy bandwidth measured in the same run.
"% limit" is that time over the measured wall time: a whole rollout's share, prefills and host
time counting against it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import numpy as np

from sparrow_jax.bench import bytes_limit
from sparrow_jax.bench.longtail import workload
from sparrow_jax.bench.rollout_runs import schedule_arg


def decode_contexts(prompt_lengths: np.ndarray, response_lengths: np.ndarray) -> np.ndarray:
    """The context of every decode step's token, all samples flattened: a sample's first token
    comes from its prefill, token t (1-based, t < its length) is fed at context prompt + t."""
    return np.concatenate([p + np.arange(1, r) for p, r in zip(prompt_lengths, response_lengths)]
                          + [np.zeros(0, np.int64)]).astype(np.int64)


def run(model, args, base_cfg, device: str, backend: str, bandwidth: float) -> int:
    from sparrow_jax.rollout import continuous, generate
    from sparrow_jax.rollout.config import padded_length
    if args.samples % args.group:
        raise SystemExit("sparrow bench rollout: --samples must be a multiple of --group")
    if base_cfg.engine != "paged":
        raise SystemExit("sparrow bench rollout: --workload rl runs a run's paged engine; bind "
                         "RolloutConfig.engine = 'paged' (configs/qwen3_1p7b_gpu.gin does)")
    mcfg = model.config
    tokens, lengths, stop_ids = workload(args, mcfg.vocab_size, base_cfg.block_size)
    try:
        sched = schedule_arg(args.schedule or "config")
    except (ValueError, OSError) as e:
        raise SystemExit(f"sparrow bench rollout: {e}") from None
    cap = args.new_tokens
    budgets = np.asarray(sched.budgets, np.int32)
    # The selection width: the largest budget the rollout's contexts reach (the trainer's rule).
    reach = budgets[:min((args.prompt_len + cap) // sched.bin_size, len(budgets) - 1) + 1]
    common = dict(max_new_tokens=cap, temperature=1.0, stop_token_ids=stop_ids)
    cfgs = {"dense": dataclasses.replace(base_cfg, mode="dense", **common)}
    sparse = dataclasses.replace(base_cfg, mode="sparse", **common, max_budget=max(
        base_cfg.max_budget, padded_length(int(reach.max()), base_cfg.block_size)))
    cfgs["sparse"], _ = sparse.fit_selection_width(reach)
    modes = [m for m in ("dense", "sparse") if m in args.modes]
    key = jax.random.key(args.seed)
    print(f"# rl: {args.samples} rollouts ({len(tokens)} prompts x {args.group}), prompts "
          f"{args.prompt_len // 2}-{args.prompt_len} tokens, new_tokens cap {cap}, "
          f"{len(stop_ids)} stop ids of {mcfg.vocab_size} (geometric lengths, mean ~"
          f"{args.mean_len}); paged engine (chunks of {base_cfg.chunk_steps} steps, "
          f"overlap {'on' if base_cfg.overlap_chunks else 'off'}), schedule {sched.name} (bins of "
          f"{sched.bin_size}: {' '.join(map(str, reach))} ...), dense layers "
          f"{','.join(map(str, base_cfg.dense_layers)) or 'none'}; backend {backend}, device "
          f"{device}, copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

    def go(mode: str):
        t0 = time.perf_counter()
        out = generate(model, tokens, lengths, cfg=cfgs[mode], budgets=budgets,
                       bin_size=sched.bin_size, group_size=args.group, rng=key)
        resp = np.asarray(jax.block_until_ready(out.response_lengths))
        return time.perf_counter() - t0, resp, dataclasses.replace(continuous.LAST_STATS)

    first = {m: go(m) for m in modes}                       # compiles every program
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:          # interleaved: background load affects dense and sparse alike
            walls[m].append(go(m)[0])
    header = (f"{'mode':>6} {'tok/s':>9} {'wall s':>8} {'ratio':>6} {'tokens':>8} "
              f"{'len mean':>8} {'len p90':>7} {'len max':>7} {'steps':>6} {'GB read':>9} "
              f"{'limit s':>8} {'% limit':>7}")
    print(header, flush=True)
    base = None
    plens = np.repeat(lengths, args.group)
    for m in modes:
        _, resp, stats = first[m]
        generated = int(resp.sum())
        wall = statistics.median(walls[m])
        steps = stats.chunks * cfgs[m].chunk_steps
        shape = bytes_limit.model_shape(mcfg, model.dtype, cfgs[m].dense_layers)
        read = bytes_limit.tokens_bytes(shape, decode_contexts(plens, resp),
                                        budgets if m == "sparse" else None, sched.bin_size,
                                        steps=steps, paged=True)
        limit = read.limit_seconds(bandwidth)
        rate = generated / wall
        base = base or rate
        print(f"{m:>6} {rate:>9.1f} {wall:>8.2f} {rate / base:>5.2f}x {generated:>8} "
              f"{resp.mean():>8.0f} {np.percentile(resp, 90):>7.0f} {resp.max():>7} "
              f"{steps:>6} {read.total / 1e9:>9.3f} {limit:>8.3f} {100 * limit / wall:>6.0f}%",
              flush=True)
        if args.json:
            print(json.dumps({
                "bench": "rollout", "workload": "rl", "mode": m, "tok_s": rate,
                "ratio": rate / base, "wall_s": walls[m], "generated_tokens": generated,
                "response_mean": float(resp.mean()), "response_p90": float(np.percentile(resp, 90)),
                "response_max": int(resp.max()), "decode_steps": steps, "chunks": stats.chunks,
                "preemptions": stats.preemptions, "samples": args.samples, "group": args.group,
                "prompt_len": args.prompt_len, "new_tokens": cap, "mean_len": args.mean_len,
                "schedule": sched.name, "bin_size": sched.bin_size,
                "dense_layers": list(cfgs[m].dense_layers), "chunk_steps": cfgs[m].chunk_steps,
                "copy_bw_gbs": bandwidth / 1e9,
                **{f"bytes_{k}": v for k, v in read.as_dict().items()},
                "limit_s": limit, "pct_of_limit": 100 * limit / wall,
                "device": device, "backend": backend}), flush=True)
    return 0
