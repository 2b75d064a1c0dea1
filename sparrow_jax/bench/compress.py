"""Block top-k vs R-KV vs SnapKV rollout on the CPU demo task: one table, one command.

    python -m sparrow_jax.bench.compress [--model checkpoints/demo_sft]
        [--prompts data/demo/eval.jsonl] [--num_prompts 32] [--budgets 256 512]
        [--max_new_tokens 1072] [--bin_size 256] [--json OUT.json]

For each arm (dense; block top-k, R-KV and SnapKV at every budget) the held-out prompts are
decoded greedily (group size 1, the demo's stop tokens) through the real engine:
- reward: mean `synthetic_exact` reward of the completions (the demo's held-out metric);
- decode tok/s: generated tokens / seconds of the decode program alone (`rollout.decode` on the
  prefill state; the program is compiled ahead, untimed);
- alpha: exact full-vocabulary acceptance rate of every generated token of those rollouts, from a
  teacher-forced replay of the arm's attention (block selection, or the recorded evictions) vs
  the dense policy, both at temperature 1 (the training distribution) - tail = 5th percentile
  per bin of total cached length (`--bin_size`), and p1 / mean over all tokens;
- keys/token: keys each generated token's attention read, mean over layers and tokens (block
  top-k: dense layers read the whole context, the others min(budget, context) in blocks);
- KV bytes/sample: the bytes of the cache arrays the prefill allocated per row (K, V and block
  centroids; compress mode adds its window-query ring).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.data import synthetic  # noqa: F401 - registers synthetic_exact
from sparrow_jax.data.prompts import PromptDataset
from sparrow_jax.data.prompts import PromptBatch
from sparrow_jax.model import load_hf, load_tokenizer, stop_token_ids
from sparrow_jax.model.attention import chunked_causal_attention
from sparrow_jax.rewards.pool import RewardPool
from sparrow_jax.rewards.scoring import decode_responses, score
from sparrow_jax.rollout import RolloutConfig, decode, start
from sparrow_jax.rollout import compress, static
from sparrow_jax.rollout.teacher_forced import sparse_attention_fn, trajectory_hidden
from sparrow_jax.sparsity import mismatch


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    mode: str            # dense | sparse | compress
    budget: int = 0
    scorer: str = "rkv"


def arms(budgets) -> list[Arm]:
    out = [Arm("dense", "dense")]
    for b in budgets:
        out += [Arm(f"block top-k {b}", "sparse", b), Arm(f"R-KV {b}", "compress", b, "rkv"),
                Arm(f"SnapKV {b}", "compress", b, "snapkv")]
    return out


def arm_config(arm: Arm, base: RolloutConfig) -> RolloutConfig:
    if arm.mode == "sparse":
        return dataclasses.replace(base, mode="sparse", max_budget=arm.budget)
    if arm.mode == "compress":
        return dataclasses.replace(base, mode="compress", kv_budget=arm.budget,
                                   compress_scorer=arm.scorer)
    return dataclasses.replace(base, mode="dense")


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "max_selected", "block_size",
                                             "dense_layers"))
def _alpha(graphdef, state, traj, budgets, *, mode, max_selected, block_size, dense_layers):
    """Full-vocabulary alpha [B, T] of the rollout's tokens: the arm's attention replayed vs dense,
    at temperature 1."""
    model = nnx.merge(graphdef, state)
    chunk = 64                                          # causal query chunks: small score blocks
    dense = chunked_causal_attention(chunk)
    hidden_d = trajectory_hidden(model, traj, attention_fn=dense, block_size=block_size)
    if mode == "compress":
        fn = compress.replay_attention_fn(traj.evicted_at, query_chunk=chunk)
    elif mode == "sparse":
        fn = sparse_attention_fn(budgets=budgets, bin_size=1 << 30,
                                 prompt_lengths=traj.prompt_lengths, max_selected=max_selected,
                                 block_size=block_size, dense_layers=dense_layers,
                                 query_chunk=chunk)
    else:
        fn = dense
    hidden_s = trajectory_hidden(model, traj, attention_fn=fn, block_size=block_size)
    return mismatch.acceptance_rate(model.logits(hidden_s), model.logits(hidden_d))


def kv_bytes_per_row(state, cfg: RolloutConfig, mcfg) -> int:
    cache = state.cache
    total = sum(x.nbytes for x in cache.k + cache.v + cache.centroids)
    if cfg.mode == "compress":
        total += (mcfg.num_hidden_layers * cfg.window * mcfg.num_attention_heads * mcfg.head_dim
                  * jnp.dtype(cache.k[0].dtype).itemsize * state.tokens.shape[0])
    return int(total // state.tokens.shape[0])


def keys_per_token(traj, arm: Arm, cfg: RolloutConfig, n_layers: int) -> float:
    mask = np.asarray(traj.mask).copy()
    mask[:, 0] = False                                  # the prefill's token
    ctx = np.asarray(traj.cached_lengths)[mask].astype(np.float64)
    if arm.mode == "compress":
        return float(np.asarray(traj.budgets)[mask].mean())
    if arm.mode == "dense":
        return float(ctx.mean())
    blocks = np.ceil(ctx / cfg.block_size) * cfg.block_size
    sparse = np.minimum(blocks, arm.budget)
    n_dense = len([i for i in cfg.dense_layers if i < n_layers])
    return float(((n_dense * ctx + (n_layers - n_dense) * sparse) / n_layers).mean())


def _precompile(model, state, cfg: RolloutConfig, budgets) -> None:
    """Compiles the arm's decode program for `state` without running it (as `rollout.decode`
    will call it, so the timed call reuses the executable)."""
    graphdef, params = nnx.split(model)
    if cfg.mode == "compress":
        compress.compressed_decode_program.lower(graphdef, params, state, cfg=cfg,
                                                 spec=None).compile()
    else:
        static.decode_program.lower(graphdef, params, state, jnp.asarray(budgets, jnp.int32),
                                     cfg=cfg, bin_size=2000, spec=None).compile()


def run_arm(model, batch, arm: Arm, base: RolloutConfig, tokenizer, pool, bin_size: int,
            num_bins: int) -> dict:
    cfg = arm_config(arm, base)
    budgets = np.full(20, max(arm.budget, cfg.block_size * 3), np.int32)
    ids, lens = batch.prompt_ids, batch.prompt_lengths

    state = jax.block_until_ready(start(model, ids, lens, cfg=cfg, rng=jax.random.key(0)))
    kv = kv_bytes_per_row(state, cfg, model.config)
    _precompile(model, state, cfg, budgets)             # not timed; decode() hits it
    t0 = time.perf_counter()
    traj = jax.block_until_ready(decode(model, state, cfg=cfg, budgets=budgets))
    seconds = time.perf_counter() - t0
    texts = decode_responses(tokenizer, traj)
    rewards = score(pool, texts, batch.answers, batch.prompts, batch.metas).rewards
    resp = np.asarray(traj.response_lengths)
    graphdef, state = nnx.split(model)
    alpha = _alpha(graphdef, state, traj, jnp.asarray(budgets), mode=cfg.mode,
                   max_selected=cfg.max_budget // cfg.block_size, block_size=cfg.block_size,
                   dense_layers=tuple(cfg.dense_layers))
    mask = np.asarray(traj.mask).copy()
    mask[:, 0] = False                                  # prefill token: dense in every arm
    tail, counts = mismatch.tail_by_bin(alpha, traj.cached_lengths, jnp.asarray(mask),
                                        bin_size=bin_size, quantile=0.05, num_bins=num_bins)
    a = np.asarray(alpha)[mask]
    return {"arm": arm.name, "mode": arm.mode, "budget": arm.budget,
            "reward": float(np.mean(rewards)), "response_length": float(resp.mean()),
            "decode_tok_s": float((resp - 1).sum() / seconds), "decode_s": seconds,
            "kv_bytes_per_sample": kv,
            "keys_per_token": keys_per_token(traj, arm, cfg, model.config.num_hidden_layers),
            "alpha_tail_p5": [None if np.isnan(x) else float(x) for x in np.asarray(tail)],
            "alpha_counts": [int(c) for c in np.asarray(counts)],
            "alpha_p1": float(np.quantile(a, 0.01)), "alpha_mean": float(a.mean()),
            "max_context": int(np.asarray(traj.cached_lengths)[np.asarray(traj.mask)].max())}


def table(rows: list[dict], bin_size: int, num_bins: int) -> str:
    bins = [f"{i * bin_size}-{(i + 1) * bin_size}" for i in range(num_bins - 1)]
    bins.append(f"{(num_bins - 1) * bin_size}+")
    head = (["arm", "reward", "decode tok/s", "KV KiB/sample", "keys/token"]
            + [f"p5 alpha {b}" for b in bins] + ["p1 alpha", "mean alpha"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tails = ["-" if t is None else f"{t:.3f}" for t in r["alpha_tail_p5"]]
        lines.append("| " + " | ".join(
            [r["arm"], f"{r['reward']:.3f}", f"{r['decode_tok_s']:.0f}",
             f"{r['kv_bytes_per_sample'] / 1024:.0f}", f"{r['keys_per_token']:.0f}", *tails,
             f"{r['alpha_p1']:.3f}", f"{r['alpha_mean']:.4f}"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m sparrow_jax.bench.compress",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="checkpoints/demo_sft")
    p.add_argument("--prompts", default="data/demo/eval.jsonl")
    p.add_argument("--num_prompts", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    p.add_argument("--max_new_tokens", type=int, default=1072)
    p.add_argument("--compress_every", type=int, default=128)
    p.add_argument("--bin_size", type=int, default=256)
    p.add_argument("--num_bins", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.model)
    model = load_hf(args.model, dtype=jnp.float32)
    records = PromptDataset.from_files(args.prompts, tok).records[:args.num_prompts]
    batch = PromptBatch.from_records(records, tok.pad_token_id or 0)
    base = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, backend="xla",
                         stop_token_ids=stop_token_ids(tok, args.model),
                         pad_token_id=tok.pad_token_id or 0, compress_every=args.compress_every)
    pool = RewardPool("synthetic_exact", processes=0)
    rows = []
    for arm in arms(args.budgets):
        rows.append(run_arm(model, batch, arm, base, tok, pool, args.bin_size, args.num_bins))
        print(json.dumps(rows[-1]), flush=True)
    pool.close()
    print(f"\n{len(records)} prompts, greedy, max {args.max_new_tokens} new tokens; "
          f"compress_every {args.compress_every}, window {base.window}, R-KV lambda "
          f"{base.rkv_lambda}; alpha at temperature 1, bins of total cached length\n")
    print(table(rows, args.bin_size, args.num_bins))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
