"""`sparrow` command line: training, rollout, evaluation, checks and benchmarks (subcommands below).

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

from tqdm import tqdm

from sparrow_jax.runtime import backend, config_check, gin_files, interrupts

# subcommand -> (module, function, help). Each function takes the parsed argparse namespace.
COMMANDS = {
    "train": ("sparrow_jax.train.command", "main", "sparse-rollout GRPO training (the main job)"),
    "sft": ("sparrow_jax.train.sft", "main", "supervised warm-up of the synthetic demo model"),
    "rollout": ("sparrow_jax.tools.generate", "main", "generate completions for a JSONL prompt file"),
    "calibrate": ("sparrow_jax.experiment.calibrate", "main", "offline per-bin budget sweep -> schedule"),
    "dryrun": ("sparrow_jax.dryrun.run", "main", "compile one RL step for a TPU slice / GPU node: fits?"),
    "export": ("sparrow_jax.tools.export", "main", "a training checkpoint -> Hugging Face directory"),
    "experiment": ("sparrow_jax.experiment.runner", "main", "training arms side by side -> comparison"),
    "promise": ("sparrow_jax.experiment.promise", "main",
                "warm-up + dense/controller/exact RL arms on one GPU in one call -> report"),
    "data": ("sparrow_jax.tools.data_check", "main", "data check FILE --model DIR: rows, reasons, a prompt"),
    "eval": ("sparrow_jax.tools.evaluate", "main", "eval MODEL DATA...: avg@n, pass@k, maj@k on math data"),
    "doctor": ("sparrow_jax.tools.doctor", "main", "kernels vs the XLA reference + a rollout, on this device"),
}
BENCHES = {
    "kernel": ("sparrow_jax.bench.kernels", "main", "dense vs block-sparse decode attention"),
    "rollout": ("sparrow_jax.bench.rollout", "main", "dense vs sparse rollout tokens/s"),
    "step": ("sparrow_jax.tools.config_smoke", "bench_step",
             "dense vs sparse RL steps of a config on random weights, seconds by phase"),
}


# Libraries that narrate their internals at INFO (orbax: a dozen absl lines per checkpoint save).
# They print WARNING and above only, unless --log_level DEBUG.
QUIET_LOGGERS = ("absl", "orbax", "jax", "jaxlib", "etils", "grain", "tensorstore", "torch")


class ConsoleFormatter(logging.Formatter):
    """`time logger: message`; WARNING and above start with their level (bold colour on a tty)."""

    def __init__(self, color: bool):
        super().__init__("%(asctime)s %(name)s: %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if record.levelno < logging.WARNING:
            return line
        tag = record.levelname
        if self.color:
            tag = f"\033[1;{31 if record.levelno >= logging.ERROR else 33}m{tag}\033[0m"
        return f"{tag} {line}"


class _ConsoleHandler(logging.StreamHandler):
    """Writes through tqdm, so a log line never lands in the middle of a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(level: str = "INFO") -> None:
    """Console logging for the `sparrow` command: ours at `level`, QUIET_LOGGERS at WARNING+."""
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise SystemExit(f"sparrow: unknown --log_level {level!r} (DEBUG, INFO, WARNING, ERROR)")
    handler = _ConsoleHandler(sys.stderr)
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    handler.setFormatter(ConsoleFormatter(color=color))
    logging.basicConfig(level=level_no, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings get the same WARNING prefix, above the bar
    quiet = logging.NOTSET if level_no <= logging.DEBUG else max(logging.WARNING, level_no)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


# Every module that declares a gin configurable a command's files may bind (gin knows a
# configurable only once its module is imported).
CONFIGURABLE_MODULES = (
    "sparrow_jax.train.trainer", "sparrow_jax.train.sft", "sparrow_jax.rollout.config",
    "sparrow_jax.rl.learner", "sparrow_jax.rl.grpo", "sparrow_jax.sparsity.schedule",
    "sparrow_jax.data.prompts", "sparrow_jax.rewards.registry", "sparrow_jax.rewards.pool",
    "sparrow_jax.runtime.sharding", "sparrow_jax.model.config",
    "sparrow_jax.experiment.calibrate",
    # ExperimentConfig: `sparrow experiment --parallel` runs each arm as `sparrow train` on the
    # experiment's own gin files
    "sparrow_jax.experiment.runner",
    # PromiseConfig: `sparrow promise` runs `sparrow sft` and `sparrow train` on its own gin files
    "sparrow_jax.experiment.promise")


def parse_gin(config_files: Sequence[str], params: Sequence[str]) -> None:
    """A command's configuration: every configurable registered (CONFIGURABLE_MODULES), then the
    gin files + overrides parsed (sparrow_jax.runtime.gin_files.parse_gin)."""
    for module in CONFIGURABLE_MODULES:
        importlib.import_module(module)
    gin_files.parse_gin(config_files, params)


def _add_gin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("gin_files", nargs="*", help="gin config files, applied in order")
    p.add_argument("--gin_param", action="append", default=[],
                   help="gin binding override, e.g. --gin_param 'TrainConfig.total_steps = 5'")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (to add its own flags)."""
    parser = argparse.ArgumentParser(prog="sparrow", description=__doc__.split("\n")[0])
    parser.add_argument("--log_level", default="INFO",
                        help="our loggers' level; DEBUG also shows orbax/absl/jax INFO lines")
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


# Commands that run on a device: a JAX_PLATFORMS that cannot start is one line before they load
# anything (sparrow_jax.runtime.backend). `train` asks itself, once its processes have met.
ON_DEVICE = ("rollout", "eval", "doctor", "calibrate", "sft", "export", "bench")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args`, but positionals may also follow the options (`sparrow data check
    --model DIR CONFIG.gin`, `sparrow eval --out DIR MODEL DATA`): argparse leaves those over."""
    args, extra = parser.parse_known_args(argv)
    flags = [a for a in extra if a.startswith("-")]
    if flags or not hasattr(args, "gin_files"):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    args.gin_files = [*args.gin_files, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS or a == "bench"), None)
    # From the first line, Ctrl-C and SIGTERM end the command at once with one line
    # (sparrow_jax.runtime.interrupts): a KeyboardInterrupt raised inside a C extension's import
    # or an XLA call is a traceback or an abort (issue 58). `sparrow train`'s loop replaces the
    # handler (it saves at the step's end); `sparrow experiment` and `sparrow promise` stop
    # their arms on a KeyboardInterrupt (their children run in sessions of their own: a parent
    # that left at once would orphan them), reported below.
    message = (interrupts.TRAIN_STARTUP_MESSAGE if command == "train" else
               f"sparrow{' ' + command if command else ''}: interrupted ({{signal}}) before it "
               f"finished")
    previous = {} if command in ("experiment", "promise") else interrupts.install(message)
    try:
        return _main(argv, command)
    except KeyboardInterrupt:
        logging.getLogger(__name__).debug("interrupted", exc_info=True)
        print(f"sparrow{' ' + command if command else ''}: interrupted (Ctrl-C) before it "
              f"finished", file=sys.stderr)
        return 130
    finally:
        interrupts.restore(previous)


def _main(argv: list[str], command: str | None) -> int:
    if command in ON_DEVICE and os.environ.get("JAX_PLATFORMS"):
        problem = backend.backend_problem()
        if problem:
            raise SystemExit(f"sparrow {command}: {problem}")
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
        # Benchmarks parse their own flags (argparse.REMAINDER rejects option-first arguments).
        setup_logging("INFO")
        module, fn = BENCHES[argv[1]][:2]
        rest = argv[2:]
        return int(getattr(importlib.import_module(module), fn)(rest[1:] if rest[:1] == ["--"] else rest) or 0)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv) if command == "bench" else parse_args(parser, argv)
    setup_logging(args.log_level)
    module, fn = args._sparrow_entry
    func = getattr(importlib.import_module(module), fn)
    if getattr(args, "passthrough", False):
        return int(func(args.rest) or 0)
    # Commands whose positionals are not all gin files (`sparrow data check FILE`) sort them.
    split = getattr(importlib.import_module(module), "split_positionals", None)
    if split is not None:
        split(args)
    parse_gin(args.gin_files, args.gin_param)
    try:    # a gin value of the wrong type, or not finite, before anything runs
        config_check.check_bindings()
    except TypeError as e:
        raise SystemExit(f"sparrow {args.command}: {e}") from None
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
