"""Run a shipped training config for a few RL steps at its real model shape, on random weights.

    python -m sparrow_jax.tools.config_smoke configs/qwen3_1p7b_gpu.gin --preset qwen3-1.7b \
        [--layers N] [--steps 2] [--prompts 8] [--new_tokens 4096] [--out DIR] [--json] \
        [--gin_param ...]

What a new node can do with a config before any weights or data are copied to it: the same
programs, engine, mesh, kernels, learner and memory plan as the real run, at the preset's shape
(or `--model_config config.json`; `--layers N` keeps the widths and cuts the depth, for a
quicker compile). It writes a random Qwen3 of that shape to DIR/model with a word-level
tokenizer over the synthetic task's symbols, padded with placeholder tokens to the model's
vocabulary (sampled placeholder ids decode to text, as a real tokenizer's would), then runs
`sparrow train CONFIG` on the synthetic long-context task (`data/long/train.jsonl`) with:
`--steps` steps of `--prompts` prompts x the config's group size, generations of
`--new_tokens` (random weights rarely stop early: every sample runs to the cap), the
`synthetic_prefix` reward in-process, no chat template, no evaluation and no checkpoints. Its
logs (the compile plan, each compile, each step) print as the run goes; at the end one line
per step gives the step's split - seconds of rollout, reward, learner, controller replay
(`probe`), the warm-up, and the compile seconds inside each (`time/compile/<phase>`) - the
rollout's tokens/s and the learner's model FLOP/s with its share of the devices' bf16 peak
(`time/learner_flops_share`, where the cost model's table knows the device) (`--json`: JSON
lines, the metrics as `sparrow train` logs them).

`sparrow bench step` (`bench_step`): the same run once per `--modes` (default dense, then sparse;
`TrainConfig.rollout_mode`), same seed, prompts and random model, and each step's split side by
side with the ratio: sparse/dense per RL step, not only per decode step.

The numbers measure the machine and the code path, not learning: the weights are random.
`launch/device_check.sh` runs it as its `train_real` stage (docs/devices/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
# Per-step metrics worth a line (seconds by phase, throughput, KV read).
REPORTED = ("time/", "rollout/", "learner/", "kv/read_model", "reward/mean",
            "response/length_mean")
# A step's split, in the order the step runs them (time/<phase>, time/compile/<phase>).
PHASES = ("warmup", "data", "rollout", "reward", "probe", "learner", "distill")


def placeholder_tokenizer(vocab_size: int):
    """The synthetic task's word-level tokenizer, padded with `<x_i>` placeholders to exactly
    `vocab_size` ids, so every id a model of that vocabulary samples decodes."""
    from sparrow_jax.data.tokenizer import (SPECIAL_TOKENS, SYNTHETIC_SYMBOLS,
                                            build_word_level_tokenizer)
    real = len(SPECIAL_TOKENS) + len(SYNTHETIC_SYMBOLS)
    if vocab_size < real:
        raise ValueError(f"vocab_size {vocab_size} is below the synthetic task's {real} tokens")
    pad = tuple(f"<x{i}>" for i in range(vocab_size - real))
    return build_word_level_tokenizer(SYNTHETIC_SYMBOLS + pad)


def model_config(preset: str | None, model_config: str | None, layers: int | None):
    """The model's shape: a preset by name or a config.json; `layers` overrides the depth."""
    from sparrow_jax.model.config import Qwen3Config, qwen3_preset
    if (preset is None) == (model_config is None):
        raise SystemExit("config_smoke: give exactly one of --preset NAME or --model_config FILE")
    try:
        if preset is not None:
            cfg = qwen3_preset(preset)
        else:
            fields = {f.name for f in dataclasses.fields(Qwen3Config)}
            raw = json.loads(Path(model_config).read_text())
            cfg = Qwen3Config(**{k: v for k, v in raw.items() if k in fields})
    except (OSError, ValueError, TypeError) as e:     # an unknown preset, a bad config.json
        raise SystemExit(f"config_smoke: {'--preset' if preset else '--model_config'}: "
                         f"{e}") from None
    if layers is not None:
        if layers < 1:
            raise SystemExit(f"config_smoke: --layers must be >= 1, got {layers}")
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    return cfg


def write_random_model(cfg, path: Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A random Qwen3 of shape `cfg` with the placeholder tokenizer, as a Hugging Face
    directory (weights stored in `dtype`)."""
    from flax import nnx

    from sparrow_jax.model import Qwen3ForCausalLM, save_hf
    tok = placeholder_tokenizer(cfg.vocab_size)
    cfg = dataclasses.replace(cfg, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    save_hf(model, path, tokenizer=tok, dtype=dtype)
    log.info("config_smoke: random %d-layer Qwen3 (hidden %d, vocab %d) written to %s in %.0f s",
             cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, path,
             time.perf_counter() - t0)
    return path


def train_overrides(model_dir: Path, run_dir: Path, *, steps: int, prompts: int,
                    new_tokens: int) -> list[str]:
    """The gin bindings that turn a real config into the smoke run (module docstring)."""
    data = REPO / "data" / "long" / "train.jsonl"
    return [f"TrainConfig.model_path = '{model_dir}'", f"TrainConfig.run_dir = '{run_dir}'",
            f"TrainConfig.train_data = '{data}'", "TrainConfig.eval_data = ''",
            "TrainConfig.reward = 'synthetic_prefix'", "TrainConfig.diagnostic_rewards = ()",
            "TrainConfig.reward_processes = 0", f"TrainConfig.total_steps = {steps}",
            f"TrainConfig.prompts_per_step = {prompts}", "TrainConfig.eval_at_start = False",
            "TrainConfig.checkpoint_every = 1000000", f"RolloutConfig.max_new_tokens = {new_tokens}",
            "PromptFormat.use_chat_template = False", "LearnerConfig.ppo_mini_batch_size = 0"]


def step_rows(run_dir: Path) -> list[dict[str, float]]:
    """Each step's reported metrics from the run's metrics.jsonl."""
    rows = []
    path = run_dir / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        row = json.loads(line)
        if "time/step" in row:
            rows.append({k: v for k, v in row.items() if k == "step" or k.startswith(REPORTED)})
    return rows


def split_line(row: dict[str, float]) -> str:
    """A step's seconds by phase (compile seconds inside each in brackets), the whole step, and
    the learner's FLOP/s and share of the peak where logged."""
    parts = []
    for phase in PHASES:
        if f"time/{phase}" in row:
            c = row.get(f"time/compile/{phase}")
            parts.append(f"{phase} {row[f'time/{phase}']:.3g} s"
                         + (f" (compile {c:.3g})" if c else ""))
    line = ", ".join(parts) + f"; step {row.get('time/step', float('nan')):.3g} s"
    if "time/learner_flops_per_s" in row:
        line += f"; learner {row['time/learner_flops_per_s'] / 1e12:.3g} TFLOP/s"
        if "time/learner_flops_share" in row:
            line += f", {row['time/learner_flops_share']:.1%} of the bf16 peak"
    return line


# This process only writes the random model; `sparrow train` runs in a child that needs the
# accelerator's memory. jax's defaults would keep 75% of a GPU's memory here until this process
# exits: while the model is written it allocates on demand and frees at once instead.
ON_DEMAND = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}


@contextlib.contextmanager
def allocating_on_demand():
    """ON_DEMAND's settings (where not set) while the block runs; the environment as it was
    after (the child inherits that). jax reads them when it first starts its backend."""
    saved = {k: os.environ.get(k) for k in ON_DEMAND}
    for k, v in ON_DEMAND.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_parser(modes: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                prog="sparrow bench step" if modes else None)
    p.add_argument("config", help="the training config (gin)")
    p.add_argument("--preset", default=None, help="model shape by name, e.g. qwen3-1.7b")
    p.add_argument("--model_config", default=None, help="model shape from a config.json")
    p.add_argument("--layers", type=int, default=None, help="override the depth (widths kept)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--new_tokens", type=int, default=4096, help="tokens generated per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="model and run directory (default: a temporary one)")
    p.add_argument("--gin_param", action="append", default=[], help="more gin bindings (last)")
    p.add_argument("--json", action="store_true", help="one JSON line per step")
    if modes:
        p.add_argument("--modes", nargs="+", choices=("dense", "sparse", "exact_sparse"),
                       default=["dense", "sparse"],
                       help="TrainConfig.rollout_mode of each run (the first is the ratios' "
                            "reference)")
    return p


def prepare(args: argparse.Namespace, what: str) -> tuple[object, Path]:
    """Checks the arguments, writes the random model; (its shape, the output folder)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    if not Path(args.config).is_file():
        raise SystemExit(f"{what}: no config file {args.config}")
    from sparrow_jax.runtime.gin_files import bound_configurables
    try:
        bound = bound_configurables(args.config)
    except (SyntaxError, ValueError) as e:
        raise SystemExit(f"{what}: {args.config} does not parse: {e}") from None
    if "TrainConfig" not in bound:
        # It would run `sparrow train`'s defaults at the preset's shape (issue 58).
        raise SystemExit(f"{what}: {args.config} sets no training (it binds no "
                         f"TrainConfig setting; it binds {', '.join(sorted(bound)) or 'nothing'})"
                         f": give a training config, e.g. configs/qwen3_1p7b_gpu.gin")
    for name in ("steps", "prompts", "new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"{what}: --{name} must be >= 1, got {getattr(args, name)}")
    cfg = model_config(args.preset, args.model_config, args.layers)
    out = Path(args.out or tempfile.mkdtemp(prefix="sparrow-config-smoke-"))
    with allocating_on_demand():
        write_random_model(cfg, out / "model", seed=args.seed)
    return cfg, out


def run_train(args: argparse.Namespace, out: Path, run_dir: Path, extra: Sequence[str] = ()
              ) -> tuple[int, float, list[dict[str, float]]]:
    """`sparrow train CONFIG` with the smoke overrides (+ `extra` bindings, then --gin_param);
    (exit code, wall seconds, the logged steps' rows)."""
    cmd = [sys.executable, "-m", "sparrow_jax.cli", "train", args.config]
    for binding in (*train_overrides(out / "model", run_dir, steps=args.steps,
                                     prompts=args.prompts, new_tokens=args.new_tokens),
                    *extra, *args.gin_param):
        cmd += ["--gin_param", binding]
    log.info("config_smoke: %s", " ".join(cmd))
    t0 = time.perf_counter()
    code = subprocess.call(cmd, cwd=REPO)
    return code, time.perf_counter() - t0, step_rows(run_dir)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, out = prepare(args, "config_smoke")
    code, wall, rows = run_train(args, out, out / "run")
    for row in rows:
        record = {"bench": "config_smoke", "config": args.config,
                  "model": args.preset or args.model_config,
                  "layers": cfg.num_hidden_layers, "prompts": args.prompts,
                  "new_tokens": args.new_tokens, **row}
        if args.json:
            print(json.dumps(record), flush=True)
        print("config_smoke step {}: {}".format(row.get("step"), ", ".join(
            f"{k} {v:.3g}" for k, v in row.items() if k != "step" and isinstance(v, float))),
            flush=True)
        print(f"config_smoke step {row.get('step')} split: {split_line(row)}", flush=True)
    print(f"config_smoke: `sparrow train` exited {code} after {wall:.0f} s (compiles included), "
          f"{len(rows)} of {args.steps} steps logged; model and run in {out}", flush=True)
    return code if code else (0 if len(rows) == args.steps else 1)


def bench_step(argv: Sequence[str]) -> int:
    """`sparrow bench step CONFIG ...`: the module docstring's per-mode runs, side by side."""
    argv = list(argv)
    args = build_parser(modes=True).parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    cfg, out = prepare(args, "sparrow bench step")
    runs: dict[str, list[dict[str, float]]] = {}
    for mode in args.modes:
        code, wall, rows = run_train(args, out, out / f"run-{mode}",
                                     (f"TrainConfig.rollout_mode = '{mode}'",))
        print(f"sparrow bench step: {mode}: `sparrow train` exited {code} after {wall:.0f} s, "
              f"{len(rows)} of {args.steps} steps logged", flush=True)
        if code or len(rows) != args.steps:
            return code or 1
        runs[mode] = rows
    ref = args.modes[0]
    keys = [k for k in (*(f"time/{p}" for p in PHASES), "time/step",
                        *(f"time/compile/{p}" for p in PHASES), "rollout/tokens_per_s",
                        "time/learner_flops_per_s", "time/learner_flops_share")
            if any(k in r for rows in runs.values() for r in rows)]
    print(f"# sparrow bench step: {args.config}, {cfg.num_hidden_layers} layers, {args.prompts} "
          f"prompts x the config's group, {args.new_tokens} new tokens, {args.steps} steps per "
          f"mode, same seed and prompts; ratio = mode / {ref} (times: < 1 is faster)", flush=True)
    for i in range(args.steps):
        print(f"step {i + 1}" + ("  (compiles included)" if i == 0 else ""), flush=True)
        print(f"  {'metric':<30}" + "".join(f"{m:>14}" for m in args.modes)
              + "".join(f"{m + '/' + ref:>20}" for m in args.modes[1:]), flush=True)
        for k in keys:
            vals = [runs[m][i].get(k) for m in args.modes]
            cells = "".join(f"{v:>14.4g}" if v is not None else f"{'-':>14}" for v in vals)
            ratios = "".join(f"{v / vals[0]:>19.3f}x" if v and vals[0] else f"{'-':>20}"
                             for v in vals[1:])
            print(f"  {k:<30}{cells}{ratios}", flush=True)
        if args.json:
            for m in args.modes:
                row = runs[m][i]
                print(json.dumps({
                    "bench": "step", "mode": m, "config": args.config,
                    "model": args.preset or args.model_config, "layers": cfg.num_hidden_layers,
                    "prompts": args.prompts, "new_tokens": args.new_tokens, **row,
                    **{f"ratio/{k}": row[k] / runs[ref][i][k] for k in keys
                       if row.get(k) and runs[ref][i].get(k)}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
