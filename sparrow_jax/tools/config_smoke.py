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
per step gives the step's seconds by phase and the rollout's tokens/s (`--json`: JSON lines).

The numbers measure the machine and the code path, not learning: the weights are random.
`launch/device_check.sh` runs it as its `train_real` stage (docs/devices/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    if not Path(args.config).is_file():
        raise SystemExit(f"config_smoke: no config file {args.config}")
    from sparrow_jax.runtime.gin_files import bound_configurables
    try:
        bound = bound_configurables(args.config)
    except (SyntaxError, ValueError) as e:
        raise SystemExit(f"config_smoke: {args.config} does not parse: {e}") from None
    if "TrainConfig" not in bound:
        # It would run `sparrow train`'s defaults at the preset's shape (issue 58).
        raise SystemExit(f"config_smoke: {args.config} sets no training (it binds no "
                         f"TrainConfig setting; it binds {', '.join(sorted(bound)) or 'nothing'})"
                         f": give a training config, e.g. configs/qwen3_1p7b_gpu.gin")
    for name in ("steps", "prompts", "new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"config_smoke: --{name} must be >= 1, got {getattr(args, name)}")
    cfg = model_config(args.preset, args.model_config, args.layers)
    out = Path(args.out or tempfile.mkdtemp(prefix="sparrow-config-smoke-"))
    model_dir, run_dir = out / "model", out / "run"
    write_random_model(cfg, model_dir, seed=args.seed)
    cmd = [sys.executable, "-m", "sparrow_jax.cli", "train", args.config]
    for binding in (*train_overrides(model_dir, run_dir, steps=args.steps, prompts=args.prompts,
                                     new_tokens=args.new_tokens), *args.gin_param):
        cmd += ["--gin_param", binding]
    log.info("config_smoke: %s", " ".join(cmd))
    t0 = time.perf_counter()
    code = subprocess.call(cmd, cwd=REPO)
    wall = time.perf_counter() - t0
    rows = step_rows(run_dir)
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
    print(f"config_smoke: `sparrow train` exited {code} after {wall:.0f} s (compiles included), "
          f"{len(rows)} of {args.steps} steps logged; model and run in {out}", flush=True)
    return code if code else (0 if len(rows) == args.steps else 1)


if __name__ == "__main__":
    sys.exit(main())
