"""The report of `sparrow promise`: markdown + JSON, rewritten after every part.

Per arm (from its run directory's metrics.jsonl and operative config): the RL step's split into
rollout, rewards, learner and controller replay (`probe`), each without the compile seconds
measured inside it (`time/compile/<phase>`; the warm-up's compiles are apart), rollout
tokens/s, the whole model's KV read over the run, the tail of alpha per length bin (the sparse
arms; exact sparse: its drafts' acceptance per bin), the held-out metrics at the start (the
first arm's step-0 evaluation: every arm starts from the same checkpoint) and after the last
step, the TIS weight, and a decode step's bytes against its launches at the run's mean context
(`promise_plan.step_balance`). Against the reference arm: sparse/dense per RL step and per
rollout. Then issue 56's targets, measured or not, and the pooled registered test
(`promise_pool`). `promise_markdown` writes it for people.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from sparrow_jax.experiment import promise_plan
from sparrow_jax.experiment.promise_markdown import markdown

__all__ = ["PHASES", "Report", "ReportFiles", "warmup_record", "arm_record", "TARGETS"]

# The RL step's parts, in the order the step runs them (time/<phase>).
PHASES = ("rollout", "reward", "probe", "learner")
# Issue 56's targets for the equivalent arm against the reference at >= 4K tokens of context.
TARGETS = {"speedup_rollout": 1.5, "speedup_step": 1.3, "kv_read": 0.5}


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and v is not None else math.nan


def _mean(vals: Sequence[float]) -> float:
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.mean(vals)) if vals else math.nan


def warmup_record(status: str, seconds: float, summary: Mapping[str, str], file: str,
                  size: int, model_dir: Path | None, sft) -> dict[str, Any]:
    """The warm-up part: how it ended, its `sft_summary.txt` (steps per phase, last losses and
    token accuracies), the model's shape and the packed checkpoint file."""
    rec: dict[str, Any] = {"status": status, "seconds": round(seconds, 1),
                           "max_seconds": sft.max_seconds, "file": file if size else "",
                           "file_mib": round(size / 2**20, 2)}
    for key, value in summary.items():
        try:
            rec[key] = float(value)
        except ValueError:
            rec[key] = value
    if model_dir is not None and (model_dir / "config.json").is_file():
        c = json.loads((model_dir / "config.json").read_text())
        from sparrow_jax.model.config import Qwen3Config
        fields = {f.name for f in dataclasses.fields(Qwen3Config)}
        rec["model"] = {k: c[k] for k in ("num_hidden_layers", "hidden_size",
                                           "num_attention_heads", "num_key_value_heads",
                                           "head_dim", "intermediate_size", "vocab_size")}
        rec["params_m"] = round(Qwen3Config(**{k: v for k, v in c.items()
                                              if k in fields}).num_params() / 1e6, 2)
    return rec


def _binding(run_dir: Path, selector: str, name: str, default: Any) -> Any:
    from sparrow_jax.runtime.gin_files import gin_binding
    path = run_dir / "operative_config.gin"
    value = gin_binding(path.read_text(), selector, name) if path.is_file() else None
    return default if value is None else value


def _bins(row: Mapping[str, Any], prefix: str) -> dict[int, float]:
    return {int(k.rsplit("_", 1)[1]): float(v) for k, v in row.items()
            if k.startswith(prefix) and isinstance(v, (int, float))}


def arm_record(name: str, seed: int, status: str, code: int | None, seconds: float,
               run_dir: Path, model_dir: Path) -> dict[str, Any]:
    """One arm's part of the report (module docstring) from its run directory."""
    from sparrow_jax.runtime.metrics import read_jsonl
    rec: dict[str, Any] = {"status": status, "exit_code": code, "seconds": round(seconds, 1),
                           "seed": seed, "steps": 0}
    rows = read_jsonl(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if "time/step" in r]
    rec["mode"] = str(_binding(run_dir, "TrainConfig", "rollout_mode", "sparse"))
    start = next((r for r in rows if r.get("step") == 0), {})
    rec["heldout_start"] = {k: v for k, v in start.items() if k.startswith("eval_")}
    if not steps:
        return rec
    last = steps[-1]
    rec["steps"] = int(last["step"])
    rec["heldout_end"] = {k: v for k, v in last.items() if k.startswith("eval_")}

    def warm(row: Mapping[str, Any], key: str) -> float:
        return _num(row.get(f"time/{key}")) - _num(row.get(f"time/compile/{key}") or 0.0)
    rec["per_step"] = [{"step": int(r["step"]), **{p: warm(r, p) for p in PHASES
                                                   if f"time/{p}" in r},
                        "step_s": _num(r["time/step"]) - sum(
                            _num(r.get(f"time/compile/{p}") or 0.0) for p in PHASES),
                        "compile_s": sum(_num(v) for k, v in r.items()
                                         if k.startswith("time/compile/")),
                        "tokens_per_s": _num(r.get("rollout/tokens_per_s"))} for r in steps]
    rec["split"] = {p: _mean([s.get(p, math.nan) for s in rec["per_step"]]) for p in PHASES}
    rec["step_s"] = _mean([s["step_s"] for s in rec["per_step"]])
    rec["compile_s"] = sum(s["compile_s"] for s in rec["per_step"]) + _num(
        steps[0].get("time/warmup") or 0.0)
    rec["tokens_per_s"] = _mean([s["tokens_per_s"] for s in rec["per_step"]])
    exact = rec["mode"] == "exact_sparse"
    from sparrow_jax.train.schedule_step import run_kv_read
    rec["kv_read"] = (_mean([_num(r.get("exact/kv_read_model")) for r in steps]) if exact
                      else run_kv_read(steps))
    rec["tail_by_bin"] = _bins(last, "exact_alpha/bin_" if exact else "alpha_tail/bin_")
    rec["budget_by_bin"] = _bins(last, "budget/bin_")
    if exact:
        rec["tokens_per_pass_by_bin"] = _bins(last, "exact_tokens_per_pass/bin_")
    for key, metric in (("tis_weight_mean", "loss/tis_weight_mean"),
                        ("reward_mean", "reward/mean"), ("length_mean", "response/length_mean"),
                        ("length_max", "response/length_max"),
                        ("bins_below_target", "schedule/bins_below_target")):
        rec[key] = _mean([_num(r.get(metric)) for r in steps])
    rec["decode_ms_per_step"] = 1e3 * rec["split"]["rollout"] / max(rec["length_max"], 1.0)
    rec["balance"] = balance(run_dir, model_dir, rec)
    return rec


def balance(run_dir: Path, model_dir: Path, rec: Mapping[str, Any]) -> dict[str, float]:
    """A decode step's bytes vs launches at the run's mean context (every row at prompt + half
    its mean response), on the H200 numbers of `promise_plan.DeviceNumbers`."""
    from sparrow_jax.data.synthetic import prompt_tokens
    from sparrow_jax.sparsity.cost_model import ModelShape
    if not (model_dir / "config.json").is_file():
        return {}
    dense_layers = tuple(_binding(run_dir, "RolloutConfig", "dense_layers", (0, 1)))
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()),
                                      dense_layers=dense_layers, dtype_bytes=2)
    rows = int(_binding(run_dir, "TrainConfig", "prompts_per_step", 1)) * int(
        _binding(run_dir, "TrainConfig", "group_size", 1))
    context = prompt_tokens() + 1 + rec["length_mean"] / 2
    contexts = np.full(rows, context)
    budgets = None
    if rec["mode"] != "dense" and rec["budget_by_bin"]:
        bin_size = int(_binding(run_dir, "make_schedule", "bin_size", 2048))
        b = rec["budget_by_bin"]
        budgets = b[min(int(context) // bin_size, max(b))]
    bal = promise_plan.step_balance(shape, contexts, budgets)
    return {**bal.as_dict(), "context": context, "rows": rows,
            "measured_s": rec["decode_ms_per_step"] / 1e3}


@dataclasses.dataclass(frozen=True)
class Report:
    """What a run measured so far (`as_dict` derives the comparisons and targets)."""
    name: str
    date: str
    device: str
    config: tuple[str, ...]
    overrides: tuple[str, ...]
    config_sha: str
    seed: int
    registered_seed: bool
    steps: int
    k_range: tuple[int, int]
    arm_names: tuple[str, ...]
    reference: str
    equivalent_arm: str
    metric: str
    margin: float
    alpha: float
    time_limit_s: float
    plan: Mapping[str, Any]
    warmup: Mapping[str, Any] | None = None
    arms: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    pooled: Mapping[str, Any] | None = None
    results_file: str = ""
    seconds: float = 0.0

    def with_arm(self, name: str, record: Mapping[str, Any]) -> "Report":
        return dataclasses.replace(self, arms={**self.arms, name: record})

    def start_metrics(self) -> dict[str, float]:
        """The held-out metrics at step 0 (the first arm's evaluation: one checkpoint)."""
        return next((dict(a["heldout_start"]) for a in self.arms.values()
                     if a.get("heldout_start")), {})

    def end_value(self, arm: str) -> float | None:
        """The registered metric after the registered steps (None: the arm did not get there)."""
        a = self.arms.get(arm, {})
        if a.get("steps", 0) < self.steps:
            return None
        v = a.get("heldout_end", {}).get(self.metric)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    def comparisons(self) -> dict[str, dict[str, float]]:
        """Per arm against the reference: speed-up per RL step and per rollout (reference
        seconds / arm seconds: > 1 is faster), tokens/s ratio, held-out difference."""
        ref = self.arms.get(self.reference)
        out: dict[str, dict[str, float]] = {}
        for name, a in self.arms.items():
            if ref is None or not a.get("steps") or not ref.get("steps"):
                continue
            end, ref_end = self.end_value(name), self.end_value(self.reference)
            out[name] = {
                "speedup_step": ref["step_s"] / a["step_s"],
                "speedup_rollout": ref["split"]["rollout"] / a["split"]["rollout"],
                "tokens_per_s_ratio": a["tokens_per_s"] / ref["tokens_per_s"],
                "heldout_diff": (end - ref_end) if end is not None and ref_end is not None
                else math.nan}
        return out

    def targets(self) -> list[dict[str, Any]]:
        """Issue 56's targets (controller vs dense; exact sparse), each measured or not."""
        comp = self.comparisons()
        rows = []
        eq = comp.get(self.equivalent_arm, {})
        arm = self.arms.get(self.equivalent_arm, {})
        for key, label, value, goal, ok in (
                ("speedup_rollout", "rollout >= 1.5x faster", eq.get("speedup_rollout"),
                 ">= 1.5", lambda v: v >= TARGETS["speedup_rollout"]),
                ("speedup_step", "RL step >= 1.3x faster", eq.get("speedup_step"), ">= 1.3",
                 lambda v: v >= TARGETS["speedup_step"]),
                ("kv_read", "whole-model KV read <= 0.5", arm.get("kv_read"), "<= 0.5",
                 lambda v: v <= TARGETS["kv_read"])):
            v = _num(value)
            rows.append({"arm": self.equivalent_arm, "target": label, "goal": goal, "value": v,
                         "met": None if not math.isfinite(v) else bool(ok(v))})
        pooled = (self.pooled or {}).get("arms", {}).get(self.equivalent_arm, {})
        t = pooled.get("tost")
        power = pooled.get("power") or {}
        rows.append({"arm": self.equivalent_arm, "target": f"held-out difference inside +-"
                     f"{self.margin:g} once the registered seeds are pooled", "goal": "TOST",
                     "value": math.nan if t is None else t["mean"],
                     "met": None if t is None or power.get("more_needed", 1) > 0
                     else bool(t["equivalent"])})
        for name, a in self.arms.items():
            if a.get("mode") != "exact_sparse":
                continue
            v = _num(comp.get(name, {}).get("speedup_step"))
            rows.append({"arm": name, "target": "RL step faster than dense", "goal": "> 1",
                         "value": v, "met": None if not math.isfinite(v) else v > 1})
            w = _num(a.get("tis_weight_mean"))
            rows.append({"arm": name, "target": "TIS weight exactly 1", "goal": "= 1",
                         "value": w, "met": None if not math.isfinite(w) else abs(w - 1) < 1e-3})
        return rows

    def pool_record(self) -> dict[str, Any]:
        """This run's line of the results file (`promise_pool`)."""
        comp = self.comparisons()
        start = self.start_metrics().get(self.metric)
        values = {a: v for a in self.arm_names if (v := self.end_value(a)) is not None}
        return {"experiment": self.name, "config_sha": self.config_sha, "date": self.date,
                "device": self.device, "seed": self.seed, "registered": self.registered_seed,
                "steps": self.steps, "metric": self.metric, "start": start, "values": values,
                "speedup_step": {a: c["speedup_step"] for a, c in comp.items()},
                "speedup_rollout": {a: c["speedup_rollout"] for a, c in comp.items()},
                "kv_read": {a: r.get("kv_read") for a, r in self.arms.items()
                            if "kv_read" in r}}

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(heldout_start=self.start_metrics(), comparisons=self.comparisons(),
                   targets=self.targets())
        return out

    def summary(self) -> dict[str, Any]:
        """One JSON line for the device check's report: the headline numbers."""
        comp = self.comparisons()
        out: dict[str, Any] = {"bench": "promise", "device": self.device, "seed": self.seed,
                               "warmup": (self.warmup or {}).get("status"),
                               "seconds": round(self.seconds, 1)}
        for name, a in self.arms.items():
            out[f"{name}_status"] = a["status"]
            out[f"{name}_steps"] = a.get("steps", 0)
            for key in ("speedup_step", "speedup_rollout"):
                if name in comp:
                    out[f"{name}_{key}"] = round(comp[name][key], 3)
            if "kv_read" in a:
                out[f"{name}_kv_read"] = round(a["kv_read"], 3)
        arm = ((self.pooled or {}).get("arms") or {}).get(self.equivalent_arm) or {}
        if arm.get("power"):
            out["pooled_seeds"] = arm["seeds"]
            out["seeds_still_needed"] = arm["power"]["more_needed"]
        return out


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    out: Path
    stem: str

    @property
    def md(self) -> Path:
        return self.out / f"{self.stem}.md"

    @property
    def json(self) -> Path:
        return self.out / f"{self.stem}.json"

    def write(self, report: Report) -> None:
        data = report.as_dict()
        self.json.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
        self.md.write_text(markdown(data))


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON: {type(v).__name__}")
