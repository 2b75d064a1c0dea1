"""The report of `sparrow promise` for people: `Report.as_dict` (promise_report) as markdown -
the warm-up, the arms' table (the RL step's split, tokens/s, KV read, held-out start and end,
sparse/dense per step and per rollout), the tail per bin, a decode step's bytes against its
launches, issue 56's targets, the pooled registered test and the time plan."""

from __future__ import annotations

import math
from typing import Any, Mapping

from sparrow_jax.experiment import promise_plan

__all__ = ["markdown"]


def _f(v: Any, spec: str = ".3g") -> str:
    """A number for a table cell; "-" where it is missing or not finite."""
    v = float(v) if isinstance(v, (int, float)) else math.nan
    return "-" if not math.isfinite(v) else format(v, spec)


def markdown(r: Mapping[str, Any]) -> str:
    """The report (`Report.as_dict`) for people."""
    lines = [f"# The promise on one device: {r['name']}, {r['date']} ({r['device']})", "",
             f"- config: {', '.join(f'`{c}`' for c in r['config'])}"
             + (f" with {', '.join(f'`{o}`' for o in r['overrides'])}" if r["overrides"]
                else "") + f" (sha {r['config_sha']})",
             f"- seed {r['seed']}" + ("" if r["registered_seed"] else
                                       " (past the registered seeds: not pooled)")
             + f"; {r['steps']} RL steps per arm; the task's answers: K in "
             f"{r['k_range'][0]}-{r['k_range'][1]} cycles of 81 tokens",
             f"- {r['seconds']:.0f} s of the {r['time_limit_s']:.0f} s limit; the time plan "
             f"expected {r['plan']['total_s']:.0f} s", ""]
    w = r.get("warmup")
    if w:
        model = w.get("model", {})
        lines += ["## Warm-up", "",
                  f"`sparrow sft` from scratch ({w['status']}, {w['seconds']:.0f} s; "
                  f"SFTConfig.max_seconds {w['max_seconds']:.0f}): "
                  f"{w.get('params_m', '?')}M parameters, {model.get('num_hidden_layers', '?')} "
                  f"layers (hidden {model.get('hidden_size', '?')}, "
                  f"{model.get('num_attention_heads', '?')} query / "
                  f"{model.get('num_key_value_heads', '?')} KV heads of "
                  f"{model.get('head_dim', '?')}), {_f(w.get('crop_steps_done'), '.0f')} crop + "
                  f"{_f(w.get('long_steps_done'), '.0f')} whole-sequence steps; last step loss "
                  f"{_f(w.get('loss'))}, token accuracy {_f(w.get('token_acc'))}, sparse "
                  f"forward {_f(w.get('sparse_acc'))}. Checkpoint: `{w['file'] or 'none'}` "
                  f"({w['file_mib']} MiB).", ""]
    arms = r["arms"]
    comp = r["comparisons"]
    if arms:
        metric = r["metric"]
        start = r["heldout_start"].get(metric)
        lines += ["## Arms", "",
                  "Seconds per RL step without the compiles inside them (mean over the steps); "
                  f"speed-ups against `{r['reference']}` (its seconds / the arm's: > 1 is "
                  f"faster); held-out `{metric}` at step 0 (one checkpoint) and after the last "
                  "step.", "",
                  "| arm | status | steps | RL step s | rollout | reward | probe | learner | "
                  "compiles s | rollout tok/s | whole-model KV read | held-out start -> end | "
                  "sparse/dense per RL step | per rollout |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, a in arms.items():
            s = a.get("split", {})
            c = comp.get(name, {})
            end = a.get("heldout_end", {}).get(metric)
            lines.append(
                f"| {name} ({a.get('mode', '?')}) | {a['status']} | {a.get('steps', 0)} | "
                f"{_f(a.get('step_s'))} | {_f(s.get('rollout'))} | {_f(s.get('reward'))} | "
                f"{_f(s.get('probe'))} | {_f(s.get('learner'))} | {_f(a.get('compile_s'))} | "
                f"{_f(a.get('tokens_per_s'), '.0f')} | {_f(a.get('kv_read'))} | "
                f"{_f(start, '.2f')} -> {_f(end, '.2f')} | {_f(c.get('speedup_step'))}x | "
                f"{_f(c.get('speedup_rollout'))}x |")
        lines += ["", "### Tail per length bin (last step)", "",
                  "The sparse arm: alpha's tail quantile per bin (TrainConfig.tail_quantile) at "
                  "its budget; exact sparse: the drafts' mean alpha per bin and the tokens each "
                  "verify pass kept.", ""]
        for name, a in arms.items():
            tail = a.get("tail_by_bin") or {}
            if not tail:
                continue
            budgets = a.get("budget_by_bin") or {}
            cells = ", ".join(f"bin {b}: {_f(v)}" + (f" @ {budgets[b]:.0f}" if b in budgets
                                                     else "") for b, v in sorted(tail.items()))
            lines.append(f"- {name}: {cells}")
            per_pass = a.get("tokens_per_pass_by_bin")
            if per_pass:
                lines.append("  - tokens per verify pass: " + ", ".join(
                    f"bin {b}: {_f(v)}" for b, v in sorted(per_pass.items())))
        lines += ["", "### A decode step: bytes vs launches", "",
                  "At the run's mean context (every row at its prompt + half its mean answer), "
                  "on the H200's numbers (promise_plan.DeviceNumbers: the copy bandwidth x the "
                  "decode kernels' share; launches per the 2026-11-28 census at ~5 us each).", "",
                  "| arm | rows | context | KV MB | weights MB | KV share of bytes | bytes "
                  "limit ms | launches | launch floor ms | bytes / launches | measured ms per "
                  "step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, b in ((n, a["balance"]) for n, a in arms.items() if a.get("balance")):
            lines.append(f"| {name} | {b['rows']} | {b['context']:.0f} | "
                         f"{b['kv_bytes'] / 1e6:.1f} | {b['weight_bytes'] / 1e6:.1f} | "
                         f"{b['kv_share']:.2f} | {1e3 * b['bytes_limit_s']:.3f} | "
                         f"{b['launches']} | {1e3 * b['launch_floor_s']:.3f} | "
                         f"{b['bytes_over_launches']:.2f} | {_f(1e3 * b['measured_s'])} |")
    lines += ["", "## Targets (issue 56)", "", "| arm | target | value | met |",
              "|---|---|---|---|"]
    for t in r["targets"]:
        met = {None: "not measured", True: "yes", False: "no"}[t["met"]]
        lines.append(f"| {t['arm']} | {t['target']} | {_f(t['value'])} | {met} |")
    p = r.get("pooled")
    if p:
        lines += ["", f"## Pooled: every run of this registered config ({p['runs']} of "
                  f"{p['seeds_registered']} registered runs; `{r['results_file']}`)", ""]
        for arm, e in p["arms"].items():
            t, w = e.get("tost"), e.get("power") or {}
            est = ("none yet (< 2 seeds)" if t is None else
                   f"{t['mean']:+.4f}, {100 - 200 * p['alpha']:g}% CI [{t['ci_low']:+.4f}, "
                   f"{t['ci_high']:+.4f}], TOST p = {t['p']:.3f} -> "
                   f"**{'equivalent' if t['equivalent'] else 'not shown equivalent'}**")
            need = ("" if not w else
                    f"; the registered test needs {w['needed']} seeds (power {w['power']:g} at "
                    f"s.d. {w['planned_sd']:g}): **{w['more_needed']} more runs**"
                    + ("" if w.get("needed_at_observed_sd") is None else
                       f" ({w['needed_at_observed_sd']} at the pooled s.d. "
                       f"{w['observed_sd']:.3g})"))
            lines.append(f"- `{arm}` - `{r['reference']}`, `{p['metric']}` (margin "
                         f"{p['margin']:g}) over {e['seeds']} seeds: {est}{need}; mean "
                         f"speed-up per RL step {_f(e.get('speedup_step'))}x, per rollout "
                         f"{_f(e.get('speedup_rollout'))}x")
    lines += ["", "## Time plan (expected before the run)", "",
              *promise_plan.TimePlan(tuple(promise_plan.PlannedPart(**x) for x in
                                           r["plan"]["parts"]), r["plan"]["limit_s"]).lines()]
    return "\n".join(lines) + "\n"
