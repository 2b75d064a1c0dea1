"""`sparrow experiment`: several training arms side by side on one task.

    sparrow experiment CONFIG.gin [--gin_param ...] [--arms a,b] [--report_only]

Each arm is the base configuration (the gin files and overrides) plus its own gin bindings
(`ExperimentConfig.arms`), run with `sparrow train` semantics in `output_dir/<arm>/` - same
initial model, data order and seeds, since those come from the shared base. Arms run one after
another; re-running the command resumes an interrupted arm from its last checkpoint and skips
finished ones. Then it writes, from every arm's metrics.jsonl:

  comparison.png   per arm vs step: training reward, held-out reward under dense decoding, the
                   minimum per-bin tail alpha and the fraction of tokens with alpha < 0.9, the
                   mean budget, rollout tokens/s
  comparison.md    the same as a table of final values (held-out reward with its standard error)

Each arm keeps its own TensorBoard run (`tensorboard --logdir output_dir` shows them together).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import gin
import numpy as np

log = logging.getLogger(__name__)

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

    def __post_init__(self):
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
    """Table row of one arm: the first and last held-out rewards (with the standard error of a
    mean of `eval_prompts` 0/1 rewards, sqrt(p(1-p)/n)), and means over the last `last_k`
    training steps of the other panels."""
    series = arm_series(rows)
    out: dict[str, float] = {}
    evals = series["eval_dense/reward"][1]
    if evals:
        p = evals[-1]
        out.update(eval_first=evals[0], eval_last=p,
                   eval_se=math.sqrt(max(p * (1 - p), 0.0) / max(eval_prompts, 1)))
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    # One colour per arm in every panel (panels without a dense series would otherwise shift them).
    colour = {name: f"C{i % 10}" for i, name in enumerate(arms)}
    for ax, (key, title) in zip(axes.ravel(), PANELS):
        for name, rows in arms.items():
            steps, values = arm_series(rows)[key]
            if steps:
                ax.plot(steps, values, marker="o", markersize=3, label=name, color=colour[name])
        if key == "alpha/tail_min":
            ax.axhline(threshold, color="red", linestyle="--", linewidth=1,
                       label=f"threshold {threshold}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    axes[0, 2].legend(fontsize=8)
    fig.tight_layout()
    png = output_dir / f"{stem}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)

    header = ("| arm | steps | held-out reward (dense): first -> last (+- s.e.) | training reward"
              " | min tail alpha | frac alpha < 0.9 | mean budget | rollout tokens/s |")
    lines = ["# Experiment comparison", "",
             f"Final values: held-out reward at the first and last evaluation ({eval_prompts} "
             "prompts; s.e. = sqrt(p(1-p)/n)); the other columns are means over each arm's last "
             "5 training steps. Mean budget = schedule budget weighted by generated tokens per "
             "length bin (blank for dense rollout).", "", header,
             "|" + "---|" * 8]
    for name, rows in arms.items():
        f = final_values(rows, eval_prompts)
        held = (f"{f['eval_first']:.3f} -> {f['eval_last']:.3f} (+- {f['eval_se']:.3f})"
                if "eval_last" in f else "")

        def num(key: str, spec: str) -> str:
            v = f.get(key, math.nan)
            return "" if math.isnan(v) else format(v, spec)
        lines.append(f"| {name} | {f['steps']:.0f} | {held} | {num('reward/mean', '.3f')} | "
                     f"{num('alpha/tail_min', '.3f')} | {num('alpha/frac_below_0.9', '.4f')} | "
                     f"{num('budget_mean', '.0f')} | {num('rollout/tokens_per_s', '.0f')} |")
    md = output_dir / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    return png, md


# -- running the arms ----------------------------------------------------------------------------
def _arm_bindings(cfg: ExperimentConfig, name: str) -> list[str]:
    run_dir = Path(cfg.output_dir).resolve() / name
    return [*cfg.arms[name], f"TrainConfig.run_dir = '{run_dir}'"]


def run_experiment(gin_files: Sequence[str], gin_params: Sequence[str],
                   arms: Sequence[str] | None = None, *, report_only: bool = False
                   ) -> dict[str, Any]:
    """Runs (or resumes) each arm, then writes the comparison. Returns paths and final values."""
    from sparrow_jax import cli, train
    from sparrow_jax.runtime.metrics import read_jsonl

    cfg = ExperimentConfig()
    names = list(cfg.arms) if arms is None else list(arms)
    unknown = [a for a in names if a not in cfg.arms]
    if unknown:
        raise SystemExit(f"sparrow experiment: unknown arm(s) {unknown}; configured: "
                         f"{list(cfg.arms)}")
    if _bound("TrainConfig.distributed") and gin.query_parameter("TrainConfig.distributed"):
        raise SystemExit("sparrow experiment runs its arms in one process; for multi-host arms run "
                         "`sparrow train` per arm with the arm's bindings")
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    eval_prompts = gin.query_parameter("TrainConfig.eval_prompts") if _bound(
        "TrainConfig.eval_prompts") else train.TrainConfig.__dataclass_fields__["eval_prompts"].default
    if not report_only:
        for i, name in enumerate(names):
            log.info("arm %d/%d: %s (%s)", i + 1, len(names), name,
                     "; ".join(cfg.arms[name]) or "base configuration")
            # A fresh gin configuration per arm: base files + overrides + the arm's bindings.
            cli.parse_gin(gin_files, [*gin_params, *_arm_bindings(cfg, name)])
            train.train()
        cli.parse_gin(gin_files, gin_params)          # leave the base configuration bound
    results = {name: read_jsonl(out / name) for name in names if (out / name).exists()}
    missing = [n for n in names if n not in results]
    if missing:
        raise SystemExit(f"sparrow experiment: no metrics for arm(s) {missing} in {out}")
    png, md = write_report(out, results, eval_prompts=int(eval_prompts),
                           threshold=cfg.threshold, stem=cfg.report)
    print(md.read_text(), flush=True)
    log.info("wrote %s and %s", png, md)
    # Arms named arm@seed: per-seed paired differences to dense (sparrow_jax.experiment_paired).
    from sparrow_jax import experiment_paired
    paired = experiment_paired.write_paired_report(out, results, stem=f"{cfg.report}_paired")
    if paired is not None:
        print(paired.read_text(), flush=True)
    return {"png": png, "md": md,
            "final": {n: final_values(r, int(eval_prompts)) for n, r in results.items()}}


def _bound(name: str) -> bool:
    try:
        gin.query_parameter(name)
        return True
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    arms = [a for a in args.arms.split(",") if a] if args.arms else None
    run_experiment(args.gin_files, args.gin_param, arms, report_only=args.report_only)
    return 0
