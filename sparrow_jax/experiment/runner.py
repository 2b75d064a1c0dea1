"""`sparrow experiment`: several training arms side by side on one task.

    sparrow experiment CONFIG.gin [--gin_param ...] [--arms a,b] [--report_only] [--parallel N]

Each arm is the base configuration (the gin files and overrides) plus its own gin bindings
(`ExperimentConfig.arms`), run with `sparrow train` semantics in `output_dir/<arm>/` - same
initial model, data order and seeds, since those come from the shared base. Arms run one after
another in this process, or with `ExperimentConfig.parallel` / `--parallel N` > 1 as `sparrow
train` subprocesses, at most N at a time, each logging to `output_dir/<arm>.log`; re-running the
command resumes an interrupted arm from its last checkpoint and skips finished ones. Then it
writes, from every (finished) arm's metrics.jsonl:

  comparison.png   per arm vs step: training reward, held-out reward under dense decoding, the
                   minimum per-bin tail alpha and the fraction of tokens with alpha < 0.9, the
                   mean budget, rollout tokens/s
  comparison.md    the same as a table of final values (held-out reward with its standard error)

Each arm keeps its own TensorBoard run (`tensorboard --logdir output_dir` shows them together).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import gin
import numpy as np

# Registers PreregConfig with gin, so an experiment's gin file can bind it.
from sparrow_jax.experiment import figure, prereg
from sparrow_jax.runtime import output_dir
from sparrow_jax.runtime.faults import RunStopped

log = logging.getLogger(__name__)

# `sparrow train`'s exit status after it saved a step and stopped on Ctrl-C / SIGTERM (RunStopped).
STOPPED_EXIT_CODES = (130, 143)

# (metric key in metrics.jsonl, plot title) of comparison.png, in panel order.
PANELS = (
    ("reward/mean", "training reward"),
    ("eval_dense/reward", "held-out reward (dense decoding)"),
    ("alpha/tail_min", "min per-bin tail alpha"),
    ("alpha/frac_below_0.9", "fraction of tokens with alpha < 0.9"),
    ("budget_mean", "mean budget (tokens)"),
    ("rollout/tokens_per_s", "rollout tokens/s"),
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    output_dir: str = "runs/experiment"
    # arm name -> gin bindings applied on top of the base configuration.
    arms: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    threshold: float = 0.86           # the tail threshold drawn on the plot
    report: str = "comparison"        # file stem of the report: <output_dir>/<report>.md/.png
    # Arms run at once: 1 = one after another in this process; N > 1 = `sparrow train`
    # subprocesses, at most N at a time (--parallel overrides it).
    parallel: int = 1

    def __post_init__(self):
        if not isinstance(self.parallel, int) or self.parallel < 1:
            raise ValueError(f"ExperimentConfig.parallel must be an integer >= 1 (arms run at "
                             f"once), got {self.parallel!r}")
        if not self.arms:
            raise ValueError("ExperimentConfig.arms is empty: bind at least one arm, e.g. "
                             "ExperimentConfig.arms = {'dense': [\"TrainConfig.rollout_mode = "
                             "'dense'\"]}")
        for name, bindings in self.arms.items():
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"bad arm name {name!r}: it names a directory")
            if isinstance(bindings, str):
                raise ValueError(f"arm {name!r}: bindings must be a list of strings, got one "
                                 f"string {bindings!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", default=None,
                        help="comma-separated subset of ExperimentConfig.arms to run (default all)")
    parser.add_argument("--report_only", action="store_true",
                        help="only (re)write comparison.md/png from the arms' metrics")
    parser.add_argument("--parallel", type=int, default=None, metavar="N",
                        help="run the arms as `sparrow train` subprocesses, at most N at a time, "
                             "each logging to <output_dir>/<arm>.log (ExperimentConfig.parallel)")


# -- per-arm data --------------------------------------------------------------------------------
def budget_mean(row: Mapping[str, float]) -> float:
    """The step's schedule budget averaged over its generated tokens (token counts per bin
    weight the per-bin budgets); NaN for dense rollout (no tail measured)."""
    num = den = 0.0
    for key, count in row.items():
        if key.startswith("alpha_count/bin_"):
            b = key.rsplit("_", 1)[1]
            budget = row.get(f"budget/bin_{b}")
            if budget is not None:
                num += budget * count
                den += count
    return num / den if den else math.nan


def arm_series(rows: Sequence[Mapping[str, float]]) -> dict[str, tuple[list[int], list[float]]]:
    """metrics.jsonl rows -> {panel key: (steps, values)} (missing values skipped)."""
    out: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k, _ in PANELS}
    for row in rows:
        step = int(row["step"])
        values = dict(row, budget_mean=budget_mean(row))
        for key, _ in PANELS:
            v = values.get(key)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                out[key][0].append(step)
                out[key][1].append(float(v))
    return out


def final_values(rows: Sequence[Mapping[str, float]], eval_prompts: int,
                 last_k: int = 5) -> dict[str, float]:
    """Table row of one arm: the step-0 (if evaluated) and last held-out rewards (with the
    standard error of a mean of `eval_prompts` 0/1 rewards, sqrt(p(1-p)/n)), and means over the
    last `last_k` training steps of the other panels."""
    series = arm_series(rows)
    out: dict[str, float] = {}
    steps, evals = series["eval_dense/reward"]
    if evals:
        p = evals[-1]
        out.update(eval_last=p, eval_se=math.sqrt(max(p * (1 - p), 0.0) / max(eval_prompts, 1)))
        if steps[0] == 0:
            out["eval_first"] = evals[0]
    for key, _ in PANELS:
        if key == "eval_dense/reward":
            continue
        vals = series[key][1][-last_k:]
        out[key] = float(np.mean(vals)) if vals else math.nan
    out["steps"] = float(max(series["reward/mean"][0], default=0))
    return out


# -- report --------------------------------------------------------------------------------------
def write_report(output_dir: Path, arms: Mapping[str, Sequence[Mapping[str, float]]], *,
                 eval_prompts: int, threshold: float, stem: str = "comparison"
                 ) -> tuple[Path, Path]:
    """<stem>.png and <stem>.md for `arms` (name -> metrics.jsonl rows)."""
    png = figure.plot_comparison(output_dir / f"{stem}.png",
                                 {name: arm_series(rows) for name, rows in arms.items()},
                                 PANELS, threshold)

    header = ("| arm | steps | held-out reward (dense): first -> last (+- s.e.) | training reward"
              " | min tail alpha | frac alpha < 0.9 | mean budget | rollout tokens/s |")
    lines = ["# Experiment comparison", "",
             f"Final values: held-out reward at the first and last evaluation ({eval_prompts} "
             "prompts; s.e. = sqrt(p(1-p)/n)); the other columns are means over each arm's last "
             "5 training steps. Mean budget = schedule budget weighted by generated tokens per "
             "length bin (blank for dense rollout).", "", header,
             "|" + "---|" * 8]
    finals = {name: final_values(rows, eval_prompts) for name, rows in arms.items()}
    # Arms start from the same checkpoint: one without a step-0 evaluation starts from another's.
    shared = next((f["eval_first"] for f in finals.values() if "eval_first" in f), math.nan)
    for name, f in finals.items():
        first = f"{f['eval_first']:.3f}" if "eval_first" in f else f"{shared:.3f}*"
        held = (f"{first} -> {f['eval_last']:.3f} (+- {f['eval_se']:.3f})"
                if "eval_last" in f else "")

        def num(key: str, spec: str) -> str:
            v = f.get(key, math.nan)
            return "" if math.isnan(v) else format(v, spec)
        lines.append(f"| {name} | {f['steps']:.0f} | {held} | {num('reward/mean', '.3f')} | "
                     f"{num('alpha/tail_min', '.3f')} | {num('alpha/frac_below_0.9', '.4f')} | "
                     f"{num('budget_mean', '.0f')} | {num('rollout/tokens_per_s', '.0f')} |")
    if any("eval_first" not in f and "eval_last" in f for f in finals.values()):
        lines += ["", "\\* no step-0 evaluation in this arm (`TrainConfig.eval_at_start = "
                  "False`): the first value is another arm's - every arm starts from the same "
                  "checkpoint."]
    md = output_dir / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    return png, md


# -- running the arms ----------------------------------------------------------------------------
def arm_bindings(cfg: ExperimentConfig, name: str) -> list[str]:
    """One arm's gin bindings: the arm's own, then its run directory under the output dir."""
    run_dir = Path(cfg.output_dir).resolve() / name
    return [*cfg.arms[name], f"TrainConfig.run_dir = '{run_dir}'"]


def arm_command(gin_files: Sequence[str], gin_params: Sequence[str], bindings: Sequence[str],
                log_level: str | None = None) -> list[str]:
    """One arm's `sparrow train` command line (what --parallel runs per arm)."""
    argv = [sys.executable, "-m", "sparrow_jax.cli"]
    if log_level:
        argv += ["--log_level", log_level]
    argv += ["train", *gin_files]
    for binding in (*gin_params, *bindings):
        argv += ["--gin_param", binding]
    return argv


def log_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log (of a progress bar's redraws, the last one)."""
    try:
        text = path.read_bytes().decode(errors="replace")    # not read_text: it turns \r to \n
    except OSError:
        return ""
    # Split on newlines only: a progress bar's \r redraws stay on their line.
    return "\n".join(([seg for seg in line.split("\r") if seg.strip()] or [""])[-1]
                     for line in text.rstrip("\n").split("\n")[-lines:])


def parallel_env(parallel: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The arms' environment when `parallel` of them share this host's accelerators. A JAX
    process takes 75% of each GPU's memory at start, so a second arm on the same GPU would fail
    to allocate: each gets 0.9 / parallel of it (XLA_PYTHON_CLIENT_MEM_FRACTION), unless the
    user set the fraction or turned preallocation off. TPU chips open in one process only: there
    `parallel` > 1 is refused (a TPU VM has /dev/accel* or /dev/vfio)."""
    env = dict(environ)
    if parallel <= 1:
        return env
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/*"):
        raise SystemExit(f"sparrow experiment: --parallel {parallel} on a TPU host: a TPU chip "
                         "opens in one process only, so arms cannot share it; run them one "
                         "after another (--parallel 1)")
    if not {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"} & set(env):
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{int(90 / parallel) / 100:.2f}"
        log.info("%d arms at a time share each GPU: XLA_PYTHON_CLIENT_MEM_FRACTION=%s per arm "
                 "(set it, or XLA_PYTHON_CLIENT_PREALLOCATE, to choose)", parallel,
                 env["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    return env


def run_parallel(commands: Mapping[str, Sequence[str]], log_dir: Path, parallel: int, *,
                 poll_s: float = 0.5, env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Runs each arm's command, at most `parallel` at once, stdout+stderr appended to
    log_dir/<arm>.log; returns every arm's exit code. A failing arm is logged with the end of its
    log and the others go on. Ctrl-C (or SIGTERM to this process) sends SIGTERM to the running
    arms - `sparrow train` then saves a checkpoint and stops - and waits for them (a second
    Ctrl-C kills them)."""
    pending, codes = list(commands), {}
    running: dict[str, tuple[subprocess.Popen, Any, float]] = {}
    restore = sigterm_as_interrupt()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name = pending.pop(0)
                path = log_dir / f"{name}.log"
                f = open(path, "ab")
                f.write(f"\n=== sparrow experiment, {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                        f"{' '.join(commands[name])}\n".encode())
                f.flush()
                proc = subprocess.Popen(list(commands[name]), stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL,
                                        env=None if env is None else dict(env))
                running[name] = (proc, f, time.monotonic())
                log.info("arm %s: started (pid %d; %d running, %d waiting), log %s", name,
                         proc.pid, len(running), len(pending), path)
            for name, (proc, f, start) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                f.close()
                del running[name]
                codes[name] = code
                seconds = time.monotonic() - start
                if code == 0:
                    log.info("arm %s: finished in %.0f s (exit code 0)", name, seconds)
                elif code in STOPPED_EXIT_CODES:
                    log.warning("arm %s: stopped by a signal after %.0f s (exit code %d): it "
                                "saved its step and did not finish; re-running resumes it",
                                name, seconds, code)
                else:
                    log.error("arm %s: FAILED after %.0f s (exit code %d); the end of %s:\n%s",
                              name, seconds, code, log_dir / f"{name}.log",
                              log_tail(log_dir / f"{name}.log"))
            if running:
                time.sleep(poll_s)
    except BaseException:
        _stop(running)
        raise
    finally:
        restore()
    return codes


def _stop(running: Mapping[str, tuple[subprocess.Popen, Any, float]]) -> None:
    """SIGTERM to every running arm, then wait for them (a second interrupt: SIGKILL)."""
    for name, (proc, _, _) in running.items():
        if proc.poll() is None:
            log.warning("arm %s: stopping (SIGTERM to pid %d: it saves a checkpoint first)",
                        name, proc.pid)
            proc.terminate()
    try:
        for proc, _, _ in running.values():
            proc.wait()
    except KeyboardInterrupt:
        log.warning("interrupted again: killing the arms (they resume from their last checkpoint)")
        for proc, _, _ in running.values():
            proc.kill()
        for proc, _, _ in running.values():
            proc.wait()
    finally:
        for _, f, _ in running.values():
            f.close()


def sigterm_as_interrupt():
    """While arms run, SIGTERM to this process stops them as Ctrl-C does. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    prev = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if prev is None else prev)


def run_experiment(gin_files: Sequence[str], gin_params: Sequence[str],
                   arms: Sequence[str] | None = None, *, report_only: bool = False,
                   parallel: int | None = None, log_level: str | None = None) -> dict[str, Any]:
    """Runs (or resumes) each arm, then writes the comparison. Returns paths and final values.
    `parallel` overrides ExperimentConfig.parallel; `log_level` is passed to the arms' commands."""
    from sparrow_jax import train
    from sparrow_jax.runtime.gin_files import parse_gin
    from sparrow_jax.runtime.metrics import read_jsonl
    from sparrow_jax.train import trainer  # noqa: F401 - the configurables the arms' files bind

    try:
        cfg = ExperimentConfig()
        if parallel is not None:
            cfg = dataclasses.replace(cfg, parallel=parallel)
    except ValueError as e:
        raise SystemExit(f"sparrow experiment: {e}") from None
    names = list(cfg.arms) if arms is None else list(arms)
    unknown = [a for a in names if a not in cfg.arms]
    if unknown:
        raise SystemExit(f"sparrow experiment: unknown arm(s) {unknown}; configured: "
                         f"{list(cfg.arms)}")
    if _bound("TrainConfig.distributed") and gin.query_parameter("TrainConfig.distributed"):
        raise SystemExit("sparrow experiment runs its arms on this host; for multi-host arms run "
                         "`sparrow train` per arm with the arm's bindings")
    out = Path(cfg.output_dir).resolve()
    # Never into another command's output or a model (sparrow_jax.runtime.output_dir); each
    # arm's own run directory checks its resume as `sparrow train` does.
    try:
        output_dir.claim(out, "experiment", {"arms": dict(cfg.arms), "report": cfg.report},
                         compare=False, name="ExperimentConfig.output_dir", option=None)
    except output_dir.OutputDirError as e:
        raise SystemExit(f"sparrow experiment: {e}") from None
    eval_prompts = gin.query_parameter("TrainConfig.eval_prompts") if _bound(
        "TrainConfig.eval_prompts") else train.TrainConfig.__dataclass_fields__["eval_prompts"].default
    failed: dict[str, int] = {}
    if not report_only and cfg.parallel > 1:
        log.info("%d arm(s) as `sparrow train` subprocesses, at most %d at a time", len(names),
                 cfg.parallel)
        codes = run_parallel({n: arm_command(gin_files, gin_params, arm_bindings(cfg, n),
                                             log_level) for n in names}, out, cfg.parallel,
                             env=parallel_env(cfg.parallel, os.environ))
        failed = {n: c for n, c in codes.items() if c != 0}
    elif not report_only:
        for i, name in enumerate(names):
            log.info("arm %d/%d: %s (%s)", i + 1, len(names), name,
                     "; ".join(cfg.arms[name]) or "base configuration")
            # A fresh gin configuration per arm: base files + overrides + the arm's bindings.
            parse_gin(gin_files, [*gin_params, *arm_bindings(cfg, name)])
            try:
                train.train()
            except RunStopped as e:      # the arm saved and stopped on a signal: so do we
                print(f"sparrow experiment: arm {name}: {e}; the report was not written "
                      f"(exit status {e.exit_code})", file=sys.stderr, flush=True)
                raise SystemExit(e.exit_code) from None
        parse_gin(gin_files, gin_params)          # leave the base configuration bound
    done = [n for n in names if n not in failed]
    results = {name: read_jsonl(out / name) for name in done if (out / name).exists()}
    missing = [n for n in done if n not in results]
    if missing:
        raise SystemExit(f"sparrow experiment: no metrics for arm(s) {missing} in {out}")
    report: dict[str, Any] = {}
    if results:
        report = write_reports(out, results, cfg, int(eval_prompts))
    if failed:
        raise SystemExit(
            f"sparrow experiment: {len(failed)} arm(s) failed: " + ", ".join(
                f"{n} (exit code {c}, log {out / f'{n}.log'})" for n, c in failed.items())
            + f"; the report covers the {len(results)} arm(s) that finished. Re-running the "
            "same command resumes the failed ones and skips the finished ones.")
    return report


def write_reports(out: Path, results: Mapping[str, Sequence[Mapping[str, float]]],
                  cfg: ExperimentConfig, eval_prompts: int) -> dict[str, Any]:
    png, md = write_report(out, results, eval_prompts=eval_prompts, threshold=cfg.threshold,
                           stem=cfg.report)
    print(md.read_text(), flush=True)
    log.info("wrote %s and %s", png, md)
    # Arms named arm@seed: per-seed paired differences to dense (sparrow_jax.experiment.paired).
    from sparrow_jax.experiment import paired as experiment_paired
    paired = experiment_paired.write_paired_report(out, results, stem=f"{cfg.report}_paired")
    if paired is not None:
        print(paired.read_text(), flush=True)
    # A pre-registered experiment (PreregConfig.seeds bound in its gin file): its tests.
    pre = prereg.PreregConfig()
    if pre.seeds:
        path = out / f"{cfg.report}_prereg.md"
        path.write_text(prereg.prereg_markdown(prereg.analyse(results, pre)))
        print(path.read_text(), flush=True)
    return {"png": png, "md": md,
            "final": {n: final_values(r, eval_prompts) for n, r in results.items()}}


def _bound(name: str) -> bool:
    try:
        gin.query_parameter(name)
        return True
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    arms = [a for a in args.arms.split(",") if a] if args.arms else None
    run_experiment(args.gin_files, args.gin_param, arms, report_only=args.report_only,
                   parallel=getattr(args, "parallel", None),
                   log_level=getattr(args, "log_level", None))
    return 0
