"""`sparrow` command line: train, sft, rollout, calibrate, bench {kernel,rollout}.

Every subcommand takes gin files and `--gin_param 'Name.field = value'` overrides. Subcommands
live beside the stage they drive; this module only parses and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

import gin

# subcommand -> (module, function, help). Each function takes the parsed argparse namespace.
COMMANDS = {
    "train": ("sparrow_jax.train", "main", "sparse-rollout GRPO training (the main job)"),
    "sft": ("sparrow_jax.sft", "main", "supervised warm-up of the synthetic demo model"),
    "rollout": ("sparrow_jax.rollout.run", "main", "generate completions for a JSONL prompt file"),
    "calibrate": ("sparrow_jax.calibrate", "main", "offline per-bin budget sweep -> schedule"),
    "export": ("sparrow_jax.export", "main", "a training checkpoint -> Hugging Face directory"),
}
BENCHES = {
    "kernel": ("pallas_kernels.bench", "main", "dense vs block-sparse decode attention"),
    "rollout": ("sparrow_jax.rollout.bench", "main", "dense vs sparse rollout tokens/s"),
}


def parse_gin(config_files: Sequence[str], params: Sequence[str]) -> None:
    """Parses gin files + overrides; a bad file, unknown key or bad value exits with its message."""
    for f in config_files:
        if not os.path.exists(f):
            raise SystemExit(f"sparrow: gin file {f!r} does not exist")
    # Configurables must be registered before parsing: import every module that declares them.
    for module in ("sparrow_jax.train", "sparrow_jax.sft", "sparrow_jax.rollout.engine",
                   "sparrow_jax.rl.learner", "sparrow_jax.rl.grpo", "sparrow_jax.schedule",
                   "sparrow_jax.data.prompts", "sparrow_jax.rl.rewards", "sparrow_jax.sharding",
                   "sparrow_jax.model.config", "sparrow_jax.calibrate"):
        importlib.import_module(module)
    gin.clear_config()  # a fresh configuration per command, also when called twice in-process
    try:
        gin.parse_config_files_and_bindings(list(config_files), list(params))
    except (ValueError, KeyError, SyntaxError, TypeError) as e:
        raise SystemExit(f"sparrow: bad gin configuration: {e}") from None


def _add_gin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("gin_files", nargs="*", help="gin config files, applied in order")
    p.add_argument("--gin_param", action="append", default=[],
                   help="gin binding override, e.g. --gin_param 'TrainConfig.total_steps = 5'")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (to add its own flags)."""
    parser = argparse.ArgumentParser(prog="sparrow", description=__doc__.split("\n")[0])
    parser.add_argument("--log_level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, fn, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        _add_gin_args(p)
        if name == command:
            extra = getattr(importlib.import_module(module), "add_arguments", None)
            if extra is not None:
                extra(p)
        p.set_defaults(_sparrow_entry=(module, fn))
    bench = sub.add_parser("bench", help="benchmarks (print numbers; --json for JSON lines)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, fn, help_) in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(_sparrow_entry=(module, fn), passthrough=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
        # Benchmarks parse their own flags (argparse.REMAINDER rejects option-first arguments).
        logging.basicConfig(level="INFO", force=True,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        module, fn = BENCHES[argv[1]][:2]
        rest = argv[2:]
        return int(getattr(importlib.import_module(module), fn)(rest[1:] if rest[:1] == ["--"] else rest) or 0)
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module, fn = args._sparrow_entry
    func = getattr(importlib.import_module(module), fn)
    if getattr(args, "passthrough", False):
        return int(func(args.rest) or 0)
    parse_gin(args.gin_files, args.gin_param)
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
