"""`sparrow calibrate`: the paper's offline budget sweep, automated.

For one model and prompt set:
  1. for every budget of a grid, roll out the prompts in sparse mode with that budget in every
     bin (same prompts and seed for each budget), replay the rollout teacher-forced through the
     learner, and get the exact full-vocabulary alpha of every generated token
     (`Learner.analyze`, alpha_mode="full");
  2. pool tokens per bin of total cached length and take the tail (5th percentile) per bin;
  3. per bin, pick the cheapest budget whose tail meets the target (`calibration.pick_schedule`);
  4. write `schedule.json` (for `load_schedule`), `heatmap.png` (bins x budgets) and
     `report.json` (tails, counts, chosen budgets, unmet bins, the cost model's predicted
     speedup over dense on the chosen hardware for the measured length distribution).

Noise floor (optional): one dense rollout, analysed with the top-k estimator between the
engine's recorded top-k and the learner's teacher-forced dense top-k, k = min(vocab,
noise_floor_topk). When k covers the vocabulary this is the exact full alpha between two dense
computations (what the statistic reads when nothing is sparse); otherwise it is the paper's
top-k lower bound, marked `exact: false`. The dense rollout's response lengths are also the
length distribution fed to the cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Sequence

import gin
import jax
import numpy as np
from tqdm import tqdm

from sparrow_jax.rl.learner import Learner, LearnerConfig, SparseReplay
from sparrow_jax.rollout import RolloutConfig, generate
from sparrow_jax.rollout.config import padded_length
from sparrow_jax.runtime.run_files import write_text_atomic
from sparrow_jax.sparsity import calibration, cost_model, exact_cost, mismatch
from sparrow_jax.sparsity.controller import ControllerConfig
from sparrow_jax.sparsity.evidence import exceedance_counts
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

log = logging.getLogger(__name__)
THRESHOLDS = (0.5, 0.8, 0.9, 0.99)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    """What to sweep. Rollout details (max_budget, block_size, dense_layers, backend, top_p,
    stop ids) come from `RolloutConfig`; max_new_tokens and temperature set here override it."""
    model_path: str = ""
    prompts_path: str = ""
    output_dir: str = "runs/calibrate"
    budgets: tuple[int, ...] = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)
    bin_size: int = 2000
    num_bins: int = 20
    target: float = 0.86
    quantile: float = 0.05
    num_prompts: int = 16            # the first N prompts of the file (reproducible)
    use_chat_template: bool = False  # render plain prompts with the tokenizer's chat template
    group_size: int = 1              # samples per prompt
    prompts_per_batch: int = 0       # prompts per generate() call; 0 = all at once
    analyze_rows: int = 8            # rows per teacher-forced replay (its mask is O(T^2))
    max_new_tokens: int = 1024
    temperature: float = 1.0
    seed: int = 0
    hardware: str = "h200"           # cost_model.HARDWARE name for the predicted speedup
    cost_batch: int = 256            # sequences decoded together in the cost model
    noise_floor: bool = True
    noise_floor_topk: int = 64
    fallback: str = "max"            # unmet bin -> largest budget ("max") or dense ("dense")
    min_bin_tokens: int = 50         # fewer tokens in a cell: its tail is too noisy to pick on
    dtype: str | None = None         # compute dtype; None = f32 on CPU, bf16 on accelerators


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (CalibrateConfig.model_path)")
    parser.add_argument("--prompts", help="JSONL/Parquet prompts (CalibrateConfig.prompts_path)")
    parser.add_argument("--out", help="output directory (CalibrateConfig.output_dir)")
    parser.add_argument("--budgets", nargs="+",
                        help="budget grid in tokens, e.g. '64 128 256' or '64,128,256'")
    # dest must not be "target": cli.py keeps the subcommand's entry point in args.target.
    parser.add_argument("--target", dest="tail_target", type=float,
                        help="required tail alpha (CalibrateConfig.target, default 0.86)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let --out replace an earlier calibration with other settings "
                             "(only its own files)")


def _parse_budgets(items: Sequence[str]) -> tuple[int, ...]:
    out = []
    for item in items:
        for part in str(item).replace(",", " ").split():
            try:
                out.append(int(part))
            except ValueError:
                raise ValueError(f"--budgets: {part!r} is not an integer") from None
    return tuple(out)


def apply_overrides(cfg: CalibrateConfig, args: argparse.Namespace) -> CalibrateConfig:
    """Command-line flags win over gin (they are the quick way to point at a model)."""
    changes: dict[str, Any] = {}
    for flag, field in (("model", "model_path"), ("prompts", "prompts_path"),
                        ("out", "output_dir"), ("tail_target", "target")):
        if getattr(args, flag, None) is not None:
            changes[field] = getattr(args, flag)
    if getattr(args, "budgets", None):
        changes["budgets"] = _parse_budgets(args.budgets)
    return dataclasses.replace(cfg, **changes)


def check_config(cfg: CalibrateConfig, rcfg: RolloutConfig) -> tuple[int, ...]:
    """Raises ValueError/FileNotFoundError naming the bad setting; returns the sorted grid."""
    if not cfg.model_path:
        raise ValueError("no model: pass --model DIR or set CalibrateConfig.model_path")
    if not os.path.isfile(os.path.join(cfg.model_path, "config.json")):
        raise FileNotFoundError(f"model directory {cfg.model_path!r} has no config.json "
                                "(expected a local Hugging Face Qwen3 directory)")
    if not cfg.prompts_path:
        raise ValueError("no prompts: pass --prompts FILE or set CalibrateConfig.prompts_path")
    if not os.path.isfile(cfg.prompts_path):
        raise FileNotFoundError(f"prompt file not found: {cfg.prompts_path!r}")
    grid = tuple(sorted({int(b) for b in cfg.budgets}))
    if not grid:
        raise ValueError("the budget grid is empty (CalibrateConfig.budgets / --budgets)")
    bs = rcfg.block_size
    bad = [b for b in grid if b % bs or b < 3 * bs]
    if bad:
        raise ValueError(f"budgets {bad} must be multiples of the block size {bs} and at least "
                         f"3 blocks ({3 * bs} tokens: sink + 2 local blocks)")
    if grid[-1] > rcfg.max_budget:
        raise ValueError(f"largest budget {grid[-1]} exceeds RolloutConfig.max_budget="
                         f"{rcfg.max_budget} (the static selection width); raise it with "
                         f"--gin_param 'RolloutConfig.max_budget = {grid[-1]}'")
    if not 0.0 < cfg.target <= 1.0 or not 0.0 < cfg.quantile < 1.0:
        raise ValueError(f"target must be in (0, 1] and quantile in (0, 1); got {cfg.target}, "
                         f"{cfg.quantile}")
    if cfg.temperature <= 0:
        raise ValueError(f"temperature must be > 0 (alpha compares sampling distributions), "
                         f"got {cfg.temperature}")
    for field in ("bin_size", "num_bins", "num_prompts", "group_size", "max_new_tokens"):
        if getattr(cfg, field) <= 0:
            raise ValueError(f"CalibrateConfig.{field} must be positive, got {getattr(cfg, field)}")
    cost_model.get_hardware(cfg.hardware)  # unknown names fail now, not after the sweep
    return grid


def _divisor_at_most(n: int, k: int) -> int:
    """Largest divisor of n that is <= k (k <= 0: n): equal chunks, so one compile per shape."""
    k = n if k <= 0 else min(k, n)
    return max(d for d in range(1, k + 1) if n % d == 0)


def _prompt_batches(cfg: CalibrateConfig, tokenizer, block_size: int) -> list[tuple[np.ndarray,
                                                                                       np.ndarray]]:
    from sparrow_jax.data.prompts import ANSWER_FIELDS, PromptDataset, PromptFormat
    # Calibration never scores answers: let the prompt itself stand in for a missing answer
    # field, so answer-less prompt files are not dropped as malformed.
    fmt = PromptFormat(answer_fields=ANSWER_FIELDS + ("prompt",),
                       use_chat_template=cfg.use_chat_template)
    dataset = PromptDataset.from_files(cfg.prompts_path, tokenizer, fmt=fmt)
    records = dataset.records[:cfg.num_prompts]
    if len(records) < cfg.num_prompts:
        log.warning("only %d prompts in %s (asked for %d)", len(records), cfg.prompts_path,
                    cfg.num_prompts)
    # One padded width for every batch, so the rollout program compiles once.
    width = padded_length(max(len(r["prompt_ids"]) for r in records), block_size)
    ids = np.full((len(records), width), dataset.pad_id, np.int32)
    for i, r in enumerate(records):
        ids[i, :len(r["prompt_ids"])] = r["prompt_ids"]
    lengths = np.asarray([len(r["prompt_ids"]) for r in records], np.int32)
    per = _divisor_at_most(len(records), cfg.prompts_per_batch)
    return [(ids[i:i + per], lengths[i:i + per]) for i in range(0, len(records), per)]


def _measure(model, learner: Learner, batches, rcfg: RolloutConfig, cfg: CalibrateConfig,
             budget: int | None, replay: SparseReplay | None) -> dict[str, np.ndarray | float]:
    """Rolls out every prompt batch at one budget (None = dense) and analyses it."""
    table = np.full(cfg.num_bins, budget or 0, np.int32)
    parts: list[dict[str, np.ndarray]] = []
    t_roll = t_ana = 0.0
    for i, (ids, lens) in enumerate(batches):
        start = time.time()
        traj = generate(model, ids, lens, cfg=rcfg, budgets=table, bin_size=cfg.bin_size,
                        group_size=cfg.group_size,
                        rng=jax.random.fold_in(jax.random.key(cfg.seed), i))
        jax.block_until_ready(traj.tokens)
        t_roll += time.time() - start
        start = time.time()
        rows = traj.tokens.shape[0]
        step = _divisor_at_most(rows, cfg.analyze_rows)
        for r in range(0, rows, step):
            part = jax.tree.map(lambda x: x[r:r + step], traj)
            out = learner.analyze(part, None if replay is None else table, replay)
            parts.append({
                "alpha": np.asarray(out.alpha), "positions": np.asarray(part.cached_lengths),
                "mask": np.asarray(part.mask), "logp_rollout": np.asarray(part.logprobs),
                "logp_dense": np.asarray(out.logp_old),
                "logp_replay": np.asarray(part.logprobs if out.logp_sparse_replay is None
                                          else out.logp_sparse_replay),
                "lengths": np.stack([np.asarray(part.prompt_lengths),
                                     np.asarray(part.response_lengths)], axis=1)})
        t_ana += time.time() - start
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    m = data["mask"]
    # The replay must reproduce the rollout's own logprobs, else its alpha is not the actor's.
    # Rare near-tied block scores can flip one selection between the two paths; the fraction of
    # tokens off by > 1e-3 says whether that matters (it should be ~0).
    err = np.abs(data["logp_replay"] - data["logp_rollout"])[m]
    data["replay_err"] = float(np.max(err, initial=0.0))
    data["replay_mismatch_frac"] = float(np.mean(err > 1e-3)) if err.size else 0.0
    data["rollout_s"], data["analyze_s"] = t_roll, t_ana
    return data


def _summarize(data: dict[str, Any], cfg: CalibrateConfig) -> dict[str, Any]:
    s = mismatch.mismatch_summary(
        data["alpha"], data["positions"], data["mask"], thresholds=THRESHOLDS,
        logp_sparse=data["logp_rollout"], logp_dense=data["logp_dense"], bin_size=cfg.bin_size,
        quantile=cfg.quantile, num_bins=cfg.num_bins)
    out = {k: float(v) for k, v in s.items() if k not in ("tail", "counts")}
    out["tail"] = np.asarray(s["tail"], np.float64)
    out["counts"] = np.asarray(s["counts"], np.int64)
    out["mean_response_len"] = float(data["lengths"][:, 1].mean())
    out["mean_alpha_by_bin"] = exact_cost.mean_alpha_by_bin(*(data[k] for k in (
        "alpha", "positions", "mask")), bin_size=cfg.bin_size, num_bins=cfg.num_bins)
    for k in ("replay_err", "replay_mismatch_frac", "rollout_s", "analyze_s"):
        out[k] = data[k]
    return out


def _jsonable(x: Any) -> Any:
    """NaN -> null (strict JSON), numpy -> Python."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _fmt(v: float | None, spec: str = ".4f", width: int = 7) -> str:
    text = "-" if v is None or not math.isfinite(v) else format(v, spec)
    return text.rjust(width)


def _bin_label(j: int, bin_size: int, num_bins: int) -> str:
    """Upper edge of a bin ('<4000'); the open-ended last bin shows its lower edge ('>=38000')."""
    return f">={j * bin_size}" if j == num_bins - 1 else f"<{(j + 1) * bin_size}"


def format_tables(report: dict[str, Any]) -> str:
    """Per-budget table, then tail per bin (bins with data only; '*' = the chosen budget)."""
    head = (f"{'budget':>7} {'tokens':>7} {'resp':>6} {'mean':>7} {'p1':>7} {'p5':>7} "
            f"{'<0.9':>7} {'worst':>7} {'replay':>8} {'roll_s':>6} {'pred_x':>6}")
    lines = [head, "-" * len(head)]
    rows = [(str(b), s) for b, s in zip(report["budgets"], report["per_budget"])]
    if report.get("noise_floor"):
        rows.append(("dense", report["noise_floor"]))
    for label, s in rows:
        lines.append(
            f"{label:>7} {int(s['num_tokens']):>7} {s['mean_response_len']:>6.0f} "
            f"{_fmt(s['alpha_mean'])} {_fmt(s['alpha_p1'])} {_fmt(s['alpha_p5'])} "
            f"{_fmt(s['frac_below_0.9'], '.2%')} {_fmt(s['tail_min'])} "
            f"{_fmt(s.get('replay_err'), '.1e', 8)} {s['rollout_s']:>6.1f} "
            f"{_fmt(s.get('pred_speedup'), '.2f', 6)}")
    sched, bin_size = report["schedule"]["budgets"], report["bin_size"]
    counts = np.asarray(report["counts"])
    used = [j for j in range(counts.shape[1]) if counts[:, j].max() > 0]
    q = f"{report['quantile'] * 100:g}"      # q = 0.002 is p0.2, not p0
    lines += ["", f"tail alpha (p{q}) per bin of {bin_size} tokens; * = chosen budget",
              f"{'budget':>7} " + " ".join(f"{_bin_label(j, bin_size, counts.shape[1]):>7} "
                                           for j in used),
              f"{'min n':>7} " + " ".join(f"{counts[:, j].min():>7} " for j in used)]
    for b, tails in zip(report["budgets"], report["tails"]):
        cells = [_fmt(tails[j]) + ("*" if sched[j] == b else " ") for j in used]
        lines.append(f"{b:>7} " + " ".join(cells))
    if report.get("noise_floor"):
        tails = report["noise_floor"]["tail"]
        lines.append(f"{'dense':>7} " + " ".join(_fmt(tails[j]) + " " for j in used))
    return "\n".join(lines)


def run_calibration(cfg: CalibrateConfig, rcfg: RolloutConfig | None = None) -> dict[str, Any]:
    """The whole sweep; writes the three files to cfg.output_dir and returns the report."""
    from sparrow_jax.model import load_hf, load_tokenizer
    rcfg = rcfg if rcfg is not None else RolloutConfig()
    grid = check_config(cfg, rcfg)
    tokenizer = load_tokenizer(cfg.model_path)
    batches = _prompt_batches(cfg, tokenizer, rcfg.block_size)
    model = load_hf(cfg.model_path, dtype=cfg.dtype)
    with open(os.path.join(cfg.model_path, "config.json")) as f:
        hf_config = json.load(f)
    eos = hf_config.get("eos_token_id")
    eos = tokenizer.eos_token_id if eos is None else eos
    stop = rcfg.stop_token_ids or tuple(() if eos is None else np.atleast_1d(eos).tolist())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else rcfg.pad_token_id
    rcfg = dataclasses.replace(rcfg, mode="sparse", max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, stop_token_ids=tuple(map(int, stop)),
                               pad_token_id=int(pad))
    # Same static selection width as the engine's decode loop, so the replay selects the same
    # blocks (see static.decode_program).
    s_max = padded_length(batches[0][0].shape[1] + rcfg.max_new_tokens, rcfg.block_size)
    replay = SparseReplay(bin_size=cfg.bin_size, block_size=rcfg.block_size,
                          max_selected=min(rcfg.max_budget, s_max) // rcfg.block_size,
                          dense_layers=tuple(rcfg.dense_layers))
    shape = cost_model.ModelShape.from_hf_config(
        hf_config, dense_layers=rcfg.dense_layers, name=os.path.basename(
            os.path.normpath(cfg.model_path)))
    n_rows = sum(len(ids) for ids, _ in batches) * cfg.group_size
    log.info("calibrating %s: %d budgets x %d rows x <= %d new tokens, bins of %d", cfg.model_path,
             len(grid), n_rows, cfg.max_new_tokens, cfg.bin_size)

    learner = Learner(model, LearnerConfig(alpha_mode="full"), group_size=cfg.group_size,
                      sampling=rcfg.sampling)
    per_budget, lengths, exceed = [], None, []
    bar = tqdm(total=len(grid) + int(cfg.noise_floor), desc="calibrate", unit="run")
    for b in grid:
        bar.set_postfix(budget=b)
        # alpha_mode "full" reads no top-k record: the sweep's rollouts record none.
        data = _measure(model, learner, batches, rcfg.for_alpha_mode("full"), cfg, b, replay)
        per_budget.append(_summarize(data, cfg))
        exceed.append(exceedance_counts(data["alpha"], data["positions"], data["mask"],
                                        target=cfg.target, bin_size=cfg.bin_size,
                                        num_bins=cfg.num_bins))
        lengths = data["lengths"]  # the largest budget's lengths, unless the dense run follows
        bar.update(1)
    del learner
    floor = None
    if cfg.noise_floor:
        bar.set_postfix(budget="dense")
        k = min(model.config.vocab_size, cfg.noise_floor_topk)
        dense_cfg = dataclasses.replace(rcfg, mode="dense", record_topk=k)
        dense_learner = Learner(model, LearnerConfig(alpha_mode="topk"),
                                group_size=cfg.group_size, sampling=dense_cfg.sampling)
        data = _measure(model, dense_learner, batches, dense_cfg, cfg, None, None)
        floor = _summarize(data, cfg)
        floor.update(topk=k, exact=k >= model.config.vocab_size)
        floor.pop("replay_err"), floor.pop("replay_mismatch_frac")  # no replay in dense mode
        lengths = data["lengths"]
        bar.update(1)
    bar.close()

    tails = np.stack([s["tail"] for s in per_budget])
    counts = np.stack([s["counts"] for s in per_budget])
    # A 5th percentile of a handful of tokens is noise: such cells count as "no data", so the
    # bin inherits its neighbour's budget instead of being decided by a few samples.
    pick_tails = np.where(counts >= cfg.min_bin_tokens, tails, np.nan)
    if not np.isfinite(pick_tails).any():
        raise ValueError(f"no bin got >= min_bin_tokens={cfg.min_bin_tokens} tokens; use more "
                         "prompts, a longer max_new_tokens or a lower min_bin_tokens")
    name = f"calibrated-{shape.name or 'model'}-{cfg.target:g}"
    schedule, info = calibration.pick_schedule(
        pick_tails, grid, cfg.target, cfg.fallback, bin_size=cfg.bin_size,
        block_size=rcfg.block_size, name=name)
    # The controller's own rule (its gin ControllerConfig, at this target and q): the table a
    # training run can start from and only hold or raise (docs/mismatch.md).
    rule = dataclasses.replace(ControllerConfig(), target=cfg.target, quantile=cfg.quantile)
    certified, cert = calibration.certify_schedule(
        np.stack([h for h, _ in exceed]), np.stack([t for _, t in exceed]), grid, rule,
        bin_size=cfg.bin_size, block_size=rcfg.block_size, name=f"certified-{name}")
    hw = cost_model.get_hardware(cfg.hardware)
    cost_kw = dict(batch=cfg.cost_batch, group_size=cfg.group_size)
    speedup = cost_model.predict_speedup(shape, hw, schedule, lengths, **cost_kw)
    for b, s in zip(grid, per_budget):
        const = Schedule.constant(b, cfg.num_bins, bin_size=cfg.bin_size,
                                  block_size=rcfg.block_size)
        s["pred_speedup"] = cost_model.predict_speedup(shape, hw, const, lengths, **cost_kw)

    # Exact sparse rollout's plan per bin (sparsity/exact_cost.py, RolloutConfig.gamma_by_bin),
    # lossless, and the one planner across modes: the lossless plan with a suffix of bins
    # approximate where the controller's rule certified a budget and that is predicted faster
    # over the tokens this model generates per bin.
    weights = exact_cost.tokens_by_bin(lengths, bin_size=cfg.bin_size, num_bins=cfg.num_bins)
    rollout_plan = exact_cost.plan_modes(
        shape, hw, (np.arange(cfg.num_bins) + 0.5) * cfg.bin_size, {
            b: np.where(s["counts"] >= cfg.min_bin_tokens, s["mean_alpha_by_bin"], np.nan)
            for b, s in zip(grid, per_budget)}, certified.budgets, batch=cfg.cost_batch,
        weights=weights)
    exact_plan = rollout_plan.lossless
    exact_plan.log(cfg.bin_size)
    rollout_plan.log(cfg.bin_size)
    os.makedirs(cfg.output_dir, exist_ok=True)
    paths = {k: os.path.join(cfg.output_dir, f) for k, f in (
        ("schedule", "schedule.json"), ("heatmap", "heatmap.png"), ("report", "report.json"),
        ("certified", "certified_schedule.json"), ("one_lower", "one_rung_lower_schedule.json"),
        ("exact", "exact_schedule.json"), ("plan", "rollout_plan_schedule.json"))}
    schedule.to_json(paths["schedule"])
    # The exact plan's draft budgets as a schedule (dense bins at the dense rung): what
    # `make_schedule.path` of an exact_sparse training run reads (exact_plan_config).
    Schedule(exact_plan.budgets, cfg.bin_size, rcfg.block_size,
             f"exact-{name}").to_json(paths["exact"])
    # The plan across modes' budgets: draft budgets where exact, certified ones where
    # approximate (what its printed gin lines point make_schedule.path to).
    Schedule(rollout_plan.budgets, cfg.bin_size, rcfg.block_size,
             f"plan-{name}").to_json(paths["plan"])
    certified.to_json(paths["certified"])
    cert["one_rung_lower"].to_json(paths["one_lower"])
    cert["one_rung_lower"] = cert["one_rung_lower"].to_dict()
    # A short title: the default one is clipped on the narrow figures of few-bin sweeps.
    calibration.write_heatmap(paths["heatmap"], tails, grid, schedule, cfg.bin_size,
                              target=cfg.target, title=f"tail alpha (p{cfg.quantile * 100:g}); "
                              f"red: target {cfg.target:g}; white: schedule")
    report = {
        "model": cfg.model_path, "prompts": cfg.prompts_path, "rows": n_rows,
        "budgets": list(grid), "bin_size": cfg.bin_size, "num_bins": cfg.num_bins,
        "quantile": cfg.quantile, "target": cfg.target, "tails": tails, "counts": counts,
        "per_budget": per_budget, "noise_floor": floor, "schedule": schedule.to_dict(),
        "picked": info["picked"], "unmet_bins": info["unmet_bins"],
        "no_data_bins": info["no_data_bins"], "ok": info["ok"],
        "certified": {"schedule": certified.to_dict(), **cert,
                      "rule": {k: getattr(rule, k) for k in (
                          "target", "quantile", "confidence", "min_rows", "min_tokens",
                          "lower_margin")}},
        "predicted_speedup": speedup, "hardware": hw.name, "cost_batch": cfg.cost_batch,
        "exact_plan": dataclasses.asdict(exact_plan),
        "rollout_plan": {**{k: v for k, v in dataclasses.asdict(rollout_plan).items()
                            if k != "lossless"},
                         "overall_speedup": rollout_plan.overall_speedup(),
                         "lossless_overall_speedup": rollout_plan.lossless_overall_speedup()},
        "model_shape": dataclasses.asdict(shape),
        "lengths": {"source": "dense" if floor else f"budget {grid[-1]}",
                    "mean_prompt": float(lengths[:, 0].mean()),
                    "mean_response": float(lengths[:, 1].mean()),
                    "max_total": int(lengths.sum(1).max())},
        "config": dataclasses.asdict(cfg), "rollout": dataclasses.asdict(rcfg), "files": paths,
    }
    report = _jsonable(report)
    # Last and whole (a temporary file renamed; a Ctrl-C waits for it): report.json is there
    # only when every file is.
    write_text_atomic(paths["report"], json.dumps(report, indent=1))
    return report


def exact_plan_config(gammas: Sequence[int], schedule_path: str,
                      approximate_from_bin: int = 0) -> list[str]:
    """The gin lines that train with calibration's exact_sparse plan: its draft length per bin
    (`RolloutConfig.gamma_by_bin`, 0 = dense decoding there), `RolloutConfig.gamma` its largest
    entry (the cache slack; 1 for a plan dense in every bin), the static engine (where plans
    are measured; the paged engine runs a plan per bin too since issue 57), the plan's
    budgets as the schedule and, for a plan across modes with approximate bins, the first of
    them (`RolloutConfig.approximate_from_bin`)."""
    gammas = tuple(int(g) for g in gammas)
    lines = ["TrainConfig.rollout_mode = 'exact_sparse'", "RolloutConfig.engine = 'static'",
             f"RolloutConfig.gamma = {max(gammas) or 1}",
             f"RolloutConfig.gamma_by_bin = {gammas}"]
    if approximate_from_bin:
        lines.append(f"RolloutConfig.approximate_from_bin = {int(approximate_from_bin)}")
    return lines + [f"make_schedule.path = {schedule_path!r}"]


def output_settings(cfg: CalibrateConfig, rcfg: RolloutConfig) -> dict[str, Any]:
    """What decides a calibration's results (its output directory records them: a calibration
    with other settings is not written over it without --overwrite)."""
    from sparrow_jax.evaluation.results import file_sha256, model_fingerprint
    return {**{k: v for k, v in dataclasses.asdict(cfg).items() if k != "output_dir"},
            "rollout": dataclasses.asdict(rcfg), "model_fingerprint":
            model_fingerprint(cfg.model_path), "prompts_sha256": file_sha256(cfg.prompts_path)}


def main(args: argparse.Namespace) -> int:
    from sparrow_jax.runtime import output_dir
    try:
        cfg = apply_overrides(CalibrateConfig(), args)
        check_config(cfg, RolloutConfig())  # fail before loading anything
        # Never over an earlier calibration with other settings (hours of accelerator time),
        # another command's output or a model (sparrow_jax.runtime.output_dir).
        output_dir.claim(cfg.output_dir, "calibrate", output_settings(cfg, RolloutConfig()),
                         overwrite=getattr(args, "overwrite", False))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"sparrow calibrate: {e}") from None
    start = time.time()
    report = run_calibration(cfg)
    print(format_tables(report))
    unmet = report["unmet_bins"]
    print(f"\nschedule {report['schedule']['name']} (bins of {report['bin_size']}): "
          f"{report['schedule']['budgets']}")
    cert = report["certified"]
    labels = ["dense" if b >= DENSE_BUDGET else str(b) for b in cert["schedule"]["budgets"]]
    print(f"certified by the controller's rule (95% bound <= {cert['margin']:g} x q = "
          f"{cert['margin'] * cert['quantile']:g}, rows as units): [{', '.join(labels)}] -> "
          f"{report['files']['certified']} (start a run there: make_schedule.path)")
    if unmet:
        print(f"WARNING: no budget met tail >= {report['target']} in bins {unmet} "
              f"(given the {cfg.fallback!r} fallback); extend the grid")
    floor = report["noise_floor"]
    if floor:
        kind = "exact" if floor["exact"] else f"top-{floor['topk']} lower bound"
        print(f"noise floor (dense vs dense, {kind}): worst-bin tail "
              f"{_fmt(floor['tail_min'], width=0)}, p1 {_fmt(floor['alpha_p1'], width=0)}")
    print(f"predicted rollout speedup vs dense on {report['hardware']} (cost model, measured "
          f"lengths): {report['predicted_speedup']:.2f}x")
    ex = report["exact_plan"]
    drafts = ["dense" if b >= DENSE_BUDGET else str(b) for b in ex["budgets"]]
    print(f"exact_sparse plan per bin (0 = dense decoding): gamma {list(ex['gammas'])}, draft "
          f"budgets [{', '.join(drafts)}], x dense {[round(x, 2) for x in ex['speedup']]}")
    if not any(ex["gammas"]):
        print("  no draft beats dense decoding in any bin: exact_sparse would run as dense "
              "decoding (TrainConfig.rollout_mode = 'dense' samples the same)")
    print("  to train with it, paste into the training config (in place of its make_schedule "
          "bindings):")
    for line in exact_plan_config(ex["gammas"], report["files"]["exact"]):
        print(f"  {line}")
    plan = report["rollout_plan"]
    if plan["approximate_from_bin"]:
        k = plan["approximate_from_bin"]
        print(f"faster, not lossless - the plan across modes: bins {k}+ approximate sparse at "
              f"the certified budgets {list(plan['budgets'][k:])} (unverified drafts, "
              f"corrected by the learner's TIS; the controller does not watch them in an "
              f"exact_sparse run), x dense {[round(x, 2) for x in plan['speedup']]}, "
              f"{plan['overall_speedup']:.2f}x over this model's tokens per bin against "
              f"{plan['lossless_overall_speedup']:.2f}x lossless; to train with it instead:")
        for line in exact_plan_config(plan["gammas"], report["files"]["plan"], k):
            print(f"  {line}")
    else:
        print("plan across modes: no approximate bins (none certified in a suffix of bins, "
              "or not predicted faster): the lossless plan above")
    print(f"wrote {', '.join(report['files'].values())} in {time.time() - start:.0f} s")
    return 0
