"""Process CPU seconds per whole-sequence `sparrow sft` step, dense vs sparsity-aware, side by side.

    python -m sparrow_jax.bench.sft_step --model checkpoints/long_sft --steps 2

runs the warm-up's training step (`train.sft.train_step`, the optimiser `run_sft` builds) on
whole-sequence batches of the long task (`--batch` problems with K in `--k_range`, padded to
`--width` tokens so every step reuses one program), first with `sparse_loss_coef = 0`, then with
the sparse term (`--budget`, `--dense_layers`, `--block_size`), each from the same start and on
the same batches. The first step of each (compile included) is reported apart; the others give
the CPU seconds per step (user + system of this process, all its threads) and their ratio.
Nothing is written. An empty --model times a random model of `--layers` layers (tests).
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax.data import synthetic
from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
from sparrow_jax.model import Qwen3ForCausalLM, load_hf, load_tokenizer
from sparrow_jax.train import sft


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _model(path: str, layers: int):
    if path:
        return load_tokenizer(path), load_hf(path, dtype=jnp.float32)
    tok = build_synthetic_tokenizer()
    cfg = sft.SFTConfig(hidden_size=32, intermediate_size=64, num_layers=layers, head_dim=16)
    return tok, Qwen3ForCausalLM(sft.demo_model_config(cfg, tok), dtype=jnp.float32,
                                 rngs=nnx.Rngs(0))


def _batches(tok, n: int, batch: int, k_range: tuple[int, int], width: int, seed: int):
    """n whole-sequence batches as `run_sft` packs them, padded to `width` tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pairs = synthetic.sft_examples(
            tok, problems=[synthetic.make_problem(rng, k_range) for _ in range(batch)])
        tokens, weights = sft.pack(pairs, tok.pad_token_id)
        if tokens.shape[1] > width:
            raise ValueError(f"--width {width} is shorter than a batch ({tokens.shape[1]} "
                             f"tokens with --k_range {k_range})")
        pad = ((0, 0), (0, width - tokens.shape[1]))
        out.append((jnp.asarray(np.pad(tokens, pad, constant_values=tok.pad_token_id)),
                    jnp.broadcast_to(jnp.arange(width), (batch, width)),
                    jnp.asarray(np.pad(weights, pad)), jnp.ones((batch, width), jnp.int32),
                    jnp.asarray([len(p) for p, _ in pairs], jnp.int32)))
    return out


def time_steps(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{"dense"|"sparse": {first_s, cpu_s, cpu_sd, wall_s, loss, sparse_loss}}: seconds per
    step (first_s: the first, compile included) and the first step's dense and sparse CE."""
    tok, _ = _model(args.model, args.layers)
    batches = _batches(tok, args.steps + 1, args.batch, tuple(args.k_range), args.width,
                       args.seed)
    results = {}
    for name, sparse in (("dense", None), ("sparse", (1.0, args.budget, tuple(args.dense_layers),
                                                      args.block_size))):
        _, model = _model(args.model, args.layers)        # the same start for both
        optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                     optax.adamw(args.learning_rate)),
                                  wrt=nnx.Param)
        times, metrics = [], []
        for batch in batches:
            cpu, wall = _cpu_seconds(), time.perf_counter()
            metrics.append(jax.block_until_ready(sft.train_step(
                model, optimizer, *batch, attention_chunk=args.chunk, sparse=sparse)))
            times.append((_cpu_seconds() - cpu, time.perf_counter() - wall))
        per = np.asarray(times[1:])
        # The losses of the first step: the start model's, the same dense CE for both.
        results[name] = dict(first_s=times[0][0], cpu_s=float(per[:, 0].mean()),
                             cpu_sd=float(per[:, 0].std()), wall_s=float(per[:, 1].mean()),
                             loss=float(metrics[0][0]), sparse_loss=float(metrics[0][2]))
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparrow_jax.bench.sft_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/long_sft",
                   help="HF directory ('' = a random model of --layers layers)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--k_range", type=int, nargs=2, default=(46, 58))
    p.add_argument("--width", type=int, default=5120, help="tokens per row (padded)")
    p.add_argument("--chunk", type=int, default=256, help="SFTConfig.attention_chunk")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--dense_layers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 1])
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=22)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    res = time_steps(args)
    for name, r in res.items():
        print(f"{name}: first step {r['first_s']:.1f} CPU s (compile included); "
              f"{r['cpu_s']:.2f} +- {r['cpu_sd']:.2f} CPU s/step, {r['wall_s']:.2f} s wall; "
              f"first step's loss {r['loss']:.4f} sparse loss {r['sparse_loss']:.4f}")
    print(f"sparse / dense CPU s per step: {res['sparse']['cpu_s'] / res['dense']['cpu_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
