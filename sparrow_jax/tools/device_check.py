"""`launch/device_check.sh`: what a freshly lent accelerator can do, in one command.

Stages, each a separate process under its own timeout (a hung compile or kernel ends its stage,
not the check):
  doctor    `sparrow doctor`: every kernel backend against the XLA reference, a short rollout
  kernels   `sparrow bench kernel` at Qwen3-1.7B head shapes, 8K and 32K contexts
  selection block selection alone (`sparrow bench kernel --selection`): the one-kernel form
            beside XLA's and the former top_k + sort
  rollout   `sparrow bench rollout` at Qwen3-1.7B shapes in bf16, batch 4, 8K and 32K: dense
            vs sparse tokens/s, each program's compile seconds (from the compile log), one
            profiled run of each
  rollout_batch  the same at 8K with batch 32, an RL rollout's batch
  profile   where those decode steps' device time goes, by phase (`bench.xplane`)
  train     2 training steps of the CPU demo config (its small shipped checkpoint and data) on
            the paged engine
  train_real  2 steps of the shipped configs/qwen3_1p7b_gpu.gin at Qwen3-1.7B shape on random
            weights (`sparrow_jax.tools.config_smoke`): the real config's programs and memory
            and the step's split (rollout, reward, learner, controller replay, compiles) with
            the learner's share of the bf16 peak
  gpu_limit (a group: `--only gpu_limit` runs its four stages, ~7.5 of at most 9 minutes on an
            H200, docs/devices/README.md has the plan) - how far from the hardware's limit:
    limit_rollout  `sparrow bench rollout --engine paged` on the shipped 1.7B GPU config (its
            schedule's budgets, dense layers, paged settings): batch 32 at 8K and batch 8 at
            32K, dense vs sparse, each step's % of its bytes limit
    limit_kernels  `sparrow bench kernel` at 8K / 32K with the schedule's budgets there, each
            kernel's % of its bytes limit, on Pallas Triton and jax-triton (reported
            unavailable where `triton` is not installed)
    limit_rl   `sparrow bench rollout --workload rl` on that config: distinct prompts x 8
            samples, long-tailed lengths, tokens/s and % of the bytes limit, dense vs sparse
    limit_step `sparrow bench step` on that config at 4 layers: dense and sparse RL steps
            side by side, seconds by phase and their ratio
  decode_options (a group, only when `--only` names it; 4 x 130 s): the paged decode of the
            shipped 1.7B config at batch 32, 8K, with the defaults, command buffers off, command
            buffers on the decode loop, split-K off (RolloutConfig.decode_command_buffers,
            decode_split_k): tokens/s and % of the bytes limit side by side
  exact_gpu (only when `--only` names it; 300 s) exact_round: `sparrow bench rollout --workload
            exact` at Qwen3-1.7B shapes, batch 32 at 8K: the round's draft / verify / accept
            cost beside dense and approximate sparse
  promise   `sparrow promise configs/experiment_promise_gpu.gin` (issue 56; at most 9 minutes
            on one H200): a model trained from scratch on the device, then the registered dense /
            controller / exact RL arms from it, its own report, checkpoint file and pooled
            results file beside this report (quick: the CPU twin); only when `--only` names it
A dated report, markdown and JSON, is rewritten after every stage (docs/devices/ by default), so
what finished survives a stage that fails or a check that is killed; each stage's whole output is
in <report>-logs/ beside it. `--quick`: the same stages
at toy sizes, for CPU (CI runs it: tests/test_device_check.py).

  python -m sparrow_jax.tools.device_check [--quick] [--out DIR] [--only doctor,rollout]
  python -m sparrow_jax.tools.device_check --only gpu_limit
  python -m sparrow_jax.tools.device_check --only promise
  python -m sparrow_jax.tools.device_check --only decode_options     (520 s: a call of its own)
  python -m sparrow_jax.tools.device_check --only exact_gpu          (300 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform as host_platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPILED = re.compile(r"(compiled|loaded) (\S+) (?:from the compilation cache )?in ([\d.]+) s")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    argv: tuple[str, ...]      # after `python -m <module>`
    timeout_s: int
    what: str
    module: str = "sparrow_jax.cli"


def _profile_stage(runs: tuple[tuple[str, tuple[int, ...]], ...], budget: int,
                   timeout_s: int) -> Stage:
    """The decode-step breakdown of the rollout stages' profiled programs: for each (profile
    folder, contexts) of a `bench rollout --profile` run, dense and sparse at each context."""
    folders = tuple(f"{d}/{c}-{name}" for d, contexts in runs for c in contexts
                    for name in ("dense", f"sparse_{budget}_0_1"))
    return Stage("profile", (*folders, "--json"), timeout_s,
                 "where a decode step's device time goes, by phase", "sparrow_jax.bench.xplane")


# The quick train_real stage's toy model (written beside the run by `main`) and a page pool
# that fits a CPU machine (the config's 24 GiB per device is for a GPU).
TOY_MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 16, "tie_word_embeddings": True}
_SMALL_POOL = ("--gin_param", "RolloutConfig.pool_bytes = 67108864",
               "--gin_param", "RolloutConfig.min_table_pages = 16",
               "--gin_param", "RolloutConfig.prompt_buckets = (64,)",
               "--gin_param", "RolloutConfig.prefill_chunk = 64")
GPU_CONFIG = "configs/qwen3_1p7b_gpu.gin"
# Stages `--only NAME` selects together.
GROUPS = {"gpu_limit": ("limit_rollout", "limit_kernels", "limit_rl", "limit_step"),
          "decode_options": ("opt_default", "opt_command_buffers_off",
                             "opt_command_buffers_loop", "opt_split_k1"),
          "exact_gpu": ("exact_round",)}
# Stages that run only when `--only` names them (a call of their own: the promise stage takes
# a whole 9-minute call and writes its own report and results file; the decode options and the
# exact round are measured after gpu_limit, each group within one 9-minute call).
ON_REQUEST = ("promise", *GROUPS["decode_options"], *GROUPS["exact_gpu"])
# The fused GPU decode's compile settings (RolloutConfig.decode_command_buffers,
# decode_split_k; issue 55), each timed on its own beside the defaults in one call.
DECODE_OPTIONS = {"opt_default": (),
                  "opt_command_buffers_off": ("RolloutConfig.decode_command_buffers = 'off'",),
                  "opt_command_buffers_loop": ("RolloutConfig.decode_command_buffers = 'loop'",),
                  "opt_split_k1": ("RolloutConfig.decode_split_k = 1",)}


def gpu_limit_stages(quick: bool, run_dir: str) -> list[Stage]:
    """The gpu_limit group (module docstring). Full: the shipped 1.7B GPU config at Qwen3-1.7B
    shape on one H200, timeouts adding up to 540 s (docs/devices/README.md: the time plan);
    quick: the same commands at toy sizes for CPU (the demo config for the step bench: the GPU
    config's warm-up compiles take minutes on a CPU)."""
    if quick:
        toy = ("--layers", "3", "--hidden", "64", "--heads", "4", "--kv_heads", "2",
               "--head_dim", "16", "--vocab", "128", "--dtype", "float32")
        small = (*_SMALL_POOL, "--gin_param", "RolloutConfig.chunk_steps = 8")
        tiny_schedule = ("--gin_param", "make_schedule.name = None",
                         "--gin_param", f"make_schedule.budgets = {[48] * 20}",
                         "--gin_param", "make_schedule.bin_size = 16",
                         "--gin_param", "RolloutConfig.max_budget = 64")
        return [
            Stage("limit_rollout", ("bench", "rollout", "--", GPU_CONFIG, "--json", *toy,
                                    "--engine", "paged", "--schedule", "config", "--context",
                                    "128", "--batch", "2", "--new_tokens", "17", "--repeats",
                                    "1", *small, *tiny_schedule), 300,
                  "paged decode vs its bytes limit, toy model"),
            Stage("limit_kernels", ("bench", "kernel", "--", "--json", "--contexts", "1024",
                                    "--budgets", "256", "--models", "1.7b", "--iters", "2",
                                    "--backend", "xla,jax_triton"), 300,
                  "decode kernels vs their bytes limit, 1K context"),
            Stage("limit_rl", ("bench", "rollout", "--", GPU_CONFIG, "--json", *toy,
                               "--workload", "rl", "--samples", "4", "--group", "2",
                               "--prompt_len", "32", "--mean_len", "16", "--new_tokens", "48",
                               "--repeats", "1", *small, *tiny_schedule,
                               "--gin_param", "RolloutConfig.min_slots = 4"), 300,
                  "an RL-shaped rollout vs its bytes limit, toy model"),
            Stage("limit_step", ("bench", "step", "configs/demo_cpu.gin", "--model_config",
                                 f"{run_dir}-model.json", "--steps", "1", "--prompts", "1",
                                 "--new_tokens", "16", "--json", "--out", f"{run_dir}-step",
                                 "--gin_param", "TrainConfig.group_size = 2",
                                 "--gin_param", "LearnerConfig.micro_batch_size = 0",
                                 *tiny_schedule), 600,
                  "dense vs sparse RL step, toy model"),
        ]
    shipped = (GPU_CONFIG, "--json", "--preset", "qwen3-1.7b", "--dtype", "bfloat16")
    return [
        Stage("limit_rollout", ("bench", "rollout", "--", *shipped, "--engine", "paged",
                                "--schedule", "config", "--context", "8192", "32768",
                                "--batch", "32", "8", "--new_tokens", "65", "--repeats", "2"),
              170, "paged decode step vs its bytes limit, 1.7B, the shipped schedule: batch 32 "
                   "at 8K, batch 8 at 32K"),
        Stage("limit_kernels", ("bench", "kernel", "--", "--json", "--contexts", "8192,32768",
                                "--budgets", "2048,4096", "--models", "1.7b",
                                "--backend", "pallas_triton,jax_triton"), 60,
              "decode kernels vs their bytes limit at 8K / 32K, the schedule's budgets there"),
        # min_slots 32: one decode program per mode (the shipped slot ladder would compile
        # 32 / 16 / 8 slots, ~75 s more on the H200)
        Stage("limit_rl", ("bench", "rollout", "--", *shipped, "--workload", "rl",
                           "--samples", "32", "--group", "8", "--prompt_len", "2048",
                           "--mean_len", "256", "--new_tokens", "1024", "--repeats", "1",
                           "--gin_param", "RolloutConfig.min_slots = 32"), 130,
              "an RL-shaped rollout (4 prompts x 8, long-tailed lengths) vs its bytes limit, "
              "1.7B, the shipped engine and schedule"),
        Stage("limit_step", ("bench", "step", GPU_CONFIG, "--preset", "qwen3-1.7b",
                             "--layers", "4", "--steps", "2", "--prompts", "2",
                             "--new_tokens", "1024", "--json", "--out", f"{run_dir}-step"), 180,
              "dense vs sparse RL step of the shipped 1.7B GPU config at 4 layers, by phase"),
    ]


def on_request_stages(quick: bool) -> list[Stage]:
    """The decode_options group (the paged decode of the shipped 1.7B GPU config at batch 32,
    8K, under each of DECODE_OPTIONS: tokens/s and % of its bytes limit side by side across the
    group's stages; 4 x 130 s) and the exact_gpu group (the exact-sparse round's draft / verify
    / accept cost at Qwen3-1.7B shapes, batch 32 at 8K, beside dense and approximate sparse, so
    its speed at any acceptance can be predicted; 300 s). Quick: toy sizes for CPU."""
    if quick:
        toy = ("--layers", "3", "--hidden", "64", "--heads", "4", "--kv_heads", "2",
               "--head_dim", "16", "--vocab", "128", "--dtype", "float32")
        rollout = ("bench", "rollout", "--", GPU_CONFIG, "--json", *toy, "--engine", "paged",
                   "--schedule", "config", "--context", "128", "--batch", "2", "--new_tokens",
                   "17", "--repeats", "1", *_SMALL_POOL,
                   "--gin_param", "RolloutConfig.chunk_steps = 8",
                   "--gin_param", "make_schedule.name = None",
                   "--gin_param", f"make_schedule.budgets = {[48] * 20}",
                   "--gin_param", "make_schedule.bin_size = 16",
                   "--gin_param", "RolloutConfig.max_budget = 64")
        exact = ("bench", "rollout", "--", "--json", *toy, "--workload", "exact", "--context",
                 "256", "--budget", "64", "--gamma", "2", "--batch", "2", "--new_tokens", "16",
                 "--repeats", "1")
        timeout, exact_timeout, shape = 300, 300, "toy model"
    else:
        rollout = ("bench", "rollout", "--", GPU_CONFIG, "--json", "--preset", "qwen3-1.7b",
                   "--dtype", "bfloat16", "--engine", "paged", "--schedule", "config",
                   "--context", "8192", "--batch", "32", "--new_tokens", "65", "--repeats", "2")
        exact = ("bench", "rollout", "--", "--json", "--preset", "qwen3-1.7b", "--dtype",
                 "bfloat16", "--workload", "exact", "--context", "8192", "--budget", "1024",
                 "--gamma", "2", "4", "--dense_layers", "0,1", "--batch", "32",
                 "--new_tokens", "64", "--repeats", "2")
        timeout, exact_timeout, shape = 130, 300, "1.7B, batch 32 at 8K"
    options = [Stage(name, rollout + tuple(a for b in binds for a in ("--gin_param", b)),
                     timeout, f"paged decode, {shape}, {', '.join(binds) or 'defaults'}")
               for name, binds in DECODE_OPTIONS.items()]
    return [*options, Stage("exact_round", exact, exact_timeout,
                            "exact sparse rounds (draft / verify / accept) beside dense and "
                            f"approximate sparse, {shape}")]


PROMISE_CONFIG = "configs/experiment_promise_gpu.gin"
PROMISE_TWIN = "configs/experiment_promise_twin.gin"


def promise_stage(quick: bool, run_dir: str, report: str, device: str) -> Stage:
    """`sparrow promise` on the registered GPU experiment (issue 56; docs/devices/README.md:
    its time plan): its report, checkpoint file and results file beside the check's report
    (`report`: the check's report path without suffix; `device`: the device's kind). Quick: the
    CPU twin (the same parts at toy size, configs/experiment_promise_twin.gin)."""
    base = Path(report or f"{run_dir}-report")
    argv = ("promise", PROMISE_CONFIG, *((PROMISE_TWIN,) if quick else ()),
            "--out", str(base.parent), "--stem", f"{base.name}-promise",
            "--work", f"{run_dir}-promise", *(("--device", device) if device else ()))
    what = ("the promise's CPU twin: toy warm-up, dense / controller / exact arms, report"
            if quick else "warm-up on the device, then dense / controller / exact RL arms of "
            "256 rows at 4-6K tokens, the report and the pooled results")
    return Stage("promise", argv, 540, what)


def stages(quick: bool, run_dir: str, profile_dir: str = "", report: str = "",
           device: str = "") -> list[Stage]:
    """The check's stages; quick: toy sizes for CPU (tens of seconds each on an idle 2-core
    machine; timeouts generous for a loaded one). Full: sized for one H100/H200; the stages
    before train take ~7 minutes there (2026-11-28 H200: 385 s for the five it had then),
    their timeouts add up to 1410 s, and the most telling come first. `report`, `device`: where
    the check writes its report (no suffix) and the device's kind, for the promise stage."""
    profile_dir = profile_dir or f"{run_dir}-profile"
    train = ("train", "configs/demo_cpu.gin", "--gin_param", "TrainConfig.total_steps = 2",
             "--gin_param", f"TrainConfig.run_dir = '{run_dir}'",
             "--gin_param", "TrainConfig.eval_at_start = False",
             "--gin_param", "TrainConfig.eval_every = 1000",
             "--gin_param", "TrainConfig.checkpoint_every = 1000",
             "--gin_param", "RolloutConfig.engine = 'paged'")
    if quick:
        toy = ("--layers", "3", "--hidden", "64", "--heads", "4", "--kv_heads", "2",
               "--head_dim", "16", "--vocab", "128")
        return [
            Stage("doctor", ("doctor", "--skip_rollout", "--backends", "xla"), 300,
                  "the XLA kernel path against the float64 reference"),
            Stage("kernels", ("bench", "kernel", "--", "--json", "--contexts", "1024",
                              "--budgets", "256", "--models", "1.7b", "--iters", "2"), 300,
                  "decode kernel, Qwen3-1.7B heads, 1K context"),
            Stage("selection", ("bench", "kernel", "--", "--json", "--selection", "--blocks",
                                "64", "--select", "16", "--batch", "1", "--iters", "1"), 300,
                  "block selection alone, every form beside top_k + sort"),
            Stage("rollout", ("bench", "rollout", "--", "--json", *toy, "--context", "256",
                              "--budget", "64", "--new_tokens", "16", "--repeats", "1",
                              "--dtype", "float32", "--profile", profile_dir), 300,
                  "dense vs sparse decode, toy model"),
            _profile_stage(((profile_dir, (256,)),), 64, 120),
            Stage("train", train + ("--gin_param", "TrainConfig.prompts_per_step = 2",
                                    "--gin_param", "LearnerConfig.micro_batch_size = 0",
                                    "--gin_param", "TrainConfig.group_size = 2",
                                    "--gin_param", "RolloutConfig.max_new_tokens = 16",
                                    "--gin_param", "RolloutConfig.chunk_steps = 16"), 600,
                  "2 training steps, demo model, paged engine, 16 new tokens"),
            Stage("train_real", ("configs/qwen3_1p7b_gpu.gin", "--model_config",
                                 f"{run_dir}-model.json", "--steps", "1", "--prompts", "1",
                                 "--new_tokens", "16", "--json", "--out", f"{run_dir}-real",
                                 *_SMALL_POOL), 600,
                  "1 step of the shipped GPU config, toy random model",
                  "sparrow_jax.tools.config_smoke"),
            *gpu_limit_stages(True, run_dir),
            promise_stage(True, run_dir, report, device),
            *on_request_stages(True),
        ]
    return [
        Stage("doctor", ("doctor",), 150, "every kernel backend vs the XLA reference; rollouts"),
        Stage("kernels", ("bench", "kernel", "--", "--json", "--contexts", "8192,32768",
                          "--models", "1.7b"), 120,
              "decode kernel at Qwen3-1.7B heads, 8K and 32K contexts"),
        Stage("selection", ("bench", "kernel", "--", "--json", "--selection", "--blocks",
                            "2048", "--select", "64", "--batch", "4"), 120,
              "block selection alone at 32K (32 rows x 2048 blocks, 64 kept), every form"),
        # (the selection kernel vs XLA's, `--xla_selection`, was settled on 2026-11-28: the
        # kernel; the bench keeps the flag)
        Stage("rollout", ("bench", "rollout", "--", "--json", "--preset", "qwen3-1.7b",
                          "--dtype", "bfloat16", "--context", "8192", "32768",
                          "--new_tokens", "64", "--repeats", "2",
                          "--profile", f"{profile_dir}/batch4"), 180,
              "Qwen3-1.7B shapes, bf16, batch 4: dense vs sparse tokens/s at 8K and 32K"),
        Stage("rollout_batch", ("bench", "rollout", "--", "--json", "--preset", "qwen3-1.7b",
                                "--dtype", "bfloat16", "--context", "8192", "--batch", "32",
                                "--new_tokens", "64", "--repeats", "2",
                                "--profile", f"{profile_dir}/batch32"), 150,
              "Qwen3-1.7B shapes, bf16, batch 32 at 8K (an RL rollout's batch)"),
        _profile_stage(((f"{profile_dir}/batch4", (8192, 32768)),
                        (f"{profile_dir}/batch32", (8192,))), 1024, 60),
        Stage("train", train + ("--gin_param", "RolloutConfig.max_new_tokens = 256"), 90,
              "2 training steps, demo model, paged engine, 256 new tokens"),
        # The shipped 1.7B GPU config itself, at full depth on random weights: its compile plan,
        # paged engine, learner and memory on this machine (minutes of compiles: its own call).
        Stage("train_real", ("configs/qwen3_1p7b_gpu.gin", "--preset", "qwen3-1.7b",
                             "--steps", "2", "--prompts", "8", "--new_tokens", "4096", "--json",
                             "--out", f"{run_dir}-real"), 540,
              "2 steps of configs/qwen3_1p7b_gpu.gin at Qwen3-1.7B shape, random weights, "
              "64 rollouts x 4096 tokens", "sparrow_jax.tools.config_smoke"),
        *gpu_limit_stages(False, run_dir),
        promise_stage(False, run_dir, report, device),
        *on_request_stages(False),
    ]


def run_stage(stage: Stage, log_dir: Path, work: Path | None = None) -> dict:
    """Runs one stage; its record: status (ok / fail / timeout), seconds, JSON lines it printed,
    compile seconds from the compile log, the output's last lines (the log file has it all).
    `work`: the check's temporary folder, written `TMP` in the record and the log (a committed
    report names no path of a machine that is gone)."""
    cmd = [sys.executable, "-m", stage.module, *stage.argv]

    def scrub(text: str) -> str:
        return text.replace(str(work), "TMP") if work is not None else text
    log = log_dir / f"{stage.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    # Its own process group: at the timeout the whole stage goes, including processes it
    # started (config_smoke's `sparrow train`), which would otherwise hold the GPU and the
    # output pipes - and so this wait - until they finish.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=stage.timeout_s)
        status, rc = ("ok" if proc.returncode == 0 else "fail"), proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:      # the group ended between the timeout and the kill
            pass
        out, err = proc.communicate()
        status, rc = "timeout", None
    seconds = time.perf_counter() - t0
    out, err = scrub(out), scrub(err)
    log.write_text(scrub(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}"))
    records = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    compiles = [{"program": m.group(2), "seconds": float(m.group(3)),
                 "cached": m.group(1) == "loaded"} for m in COMPILED.finditer(err)]
    lines = [ln for ln in (out + "\n" + err).splitlines() if ln.strip()]
    shown = ("sparrow " if stage.module == "sparrow_jax.cli" else f"python -m {stage.module} ")
    return {"stage": stage.name, "what": stage.what,
            "command": scrub(shown + " ".join(stage.argv)),
            "status": status, "returncode": rc, "seconds": round(seconds, 1),
            "timeout_s": stage.timeout_s, "results": records, "compiles": compiles,
            "tail": lines[-12:], "log": f"{log_dir.name}/{log.name}"}


def device_summary() -> dict:
    """The host and its accelerator, from a subprocess (this process never initialises jax: a
    broken install must not stop the report)."""
    probe = ("import jax, json; d = jax.devices(); print(json.dumps({'jax': jax.__version__, "
             "'platform': jax.default_backend(), 'devices': len(d), 'kind': d[0].device_kind}))")
    info = {"host": host_platform.node(), "python": host_platform.python_version()}
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=120)
        info.update(json.loads(r.stdout.strip().splitlines()[-1]))
    except Exception as e:          # reported, not raised: the stages say the rest
        info["error"] = f"jax did not start: {type(e).__name__}: {e}"
    return info


def markdown(report: dict) -> str:
    d = report["device"]
    head = [f"# Device check {report['date']}: {d.get('kind', '?')} x {d.get('devices', '?')}",
            "", f"- command: `{report['command']}`",
            f"- host {d.get('host')}, Python {d.get('python')}, jax {d.get('jax', '?')} on "
            f"{d.get('platform', '?')}" + (f" ({d['error']})" if "error" in d else ""),
            f"- stages finished: {sum(s['status'] == 'ok' for s in report['stages'])} of "
            f"{report['planned']}, {report['seconds']:.0f} s in all", "",
            "| stage | status | seconds | what |", "|---|---|---|---|"]
    rows = [f"| {s['stage']} | {s['status']} | {s['seconds']:.0f} / {s['timeout_s']} | "
            f"{s['what']} |" for s in report["stages"]]
    body = []
    for s in report["stages"]:
        body += ["", f"## {s['stage']}: {s['status']}", "", f"`{s['command']}`", ""]
        for r in s["results"]:
            body.append("- " + ", ".join(f"{k}={v}" for k, v in r.items()
                                         if not isinstance(v, (list, dict))))
            if "phases" in r:        # the profile stage: the costliest phases of the step
                body.append("  - " + ", ".join(f"{p['phase']} {p['us'] / 1e3:.2f} ms "
                                               f"({p['launches']} launches)"
                                               for p in r["phases"][:8]))
        if s["compiles"]:
            slow = sorted(s["compiles"], key=lambda c: -c["seconds"])[:8]
            body.append("- compiles (slowest): " + ", ".join(
                f"{c['program']} {c['seconds']:.1f} s" for c in slow))
        body += ["", "```", *s["tail"], "```"]
    return "\n".join(head + rows + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy sizes (CPU, CI)")
    ap.add_argument("--out", default=str(REPO / "docs" / "devices"),
                    help="report directory (default docs/devices)")
    ap.add_argument("--only", default="", help="comma-separated stage names (default: all)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace today's report of another check (other --quick / --only) on "
                         "this device in --out")
    ap.add_argument("--keep_profile", action="store_true",
                    help="keep the rollout's raw profiles (traces and optimized HLO, ~50 MB) "
                         "in the temporary folder the last line names")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out, prefix=".device-check-probe-").close()
    except OSError as e:         # issue 58: a traceback before any stage ran
        raise SystemExit(f"device_check: --out {args.out} is not writable "
                         f"({e.strerror or e}): choose another --out") from None
    work = Path(tempfile.mkdtemp(prefix="sparrow-device-check-"))
    names = [s.name for s in stages(args.quick, str(work / "run"), str(work / "profile"))]
    (work / "run-model.json").write_text(json.dumps(TOY_MODEL))      # quick train_real's shape
    only = [name for s in args.only.split(",") if s for name in GROUPS.get(s, (s,))]
    unknown = set(only) - set(names)
    if unknown:
        raise SystemExit(f"device_check: unknown --only stages {sorted(unknown)}; choose from "
                         f"{names + list(GROUPS)}")
    now = datetime.datetime.now(datetime.timezone.utc)
    device = device_summary()
    kind = re.sub(r"[^a-z0-9]+", "-", str(device.get("kind", "unknown")).lower()).strip("-")
    base = out / f"{now:%Y-%m-%d}-{kind}{'-quick' if args.quick else ''}"
    todo = [s for s in stages(args.quick, str(work / "run"), str(work / "profile"),
                              report=str(base), device=kind)
            if (s.name in only if only else s.name not in ON_REQUEST)]
    # Each stage's whole output beside the report (one folder: an offline host's results come
    # back as one directory), not in a temporary folder that goes with the machine.
    log_dir = base.parent / f"{base.name}-logs"
    # Today's report of another check on this device is not replaced without --overwrite
    # (sparrow_jax.runtime.output_dir; the same check again replaces it, as before).
    from sparrow_jax.runtime import output_dir
    try:
        output_dir.claim(log_dir, "device_check", {"quick": args.quick, "only": only,
                                                   "device": device.get("kind")},
                         overwrite=args.overwrite, name="the report's log folder")
    except output_dir.OutputDirError as e:
        raise SystemExit(f"device_check: {e}") from None
    report = {"date": now.isoformat(timespec="seconds"), "device": device,
              "command": "launch/device_check.sh" + (" --quick" if args.quick else ""),
              "planned": len(todo), "stages": [], "seconds": 0.0}
    t0 = time.perf_counter()
    for stage in todo:
        print(f"device_check: {stage.name} ({stage.what}; at most {stage.timeout_s} s)",
              flush=True)
        rec = run_stage(stage, log_dir, work)
        report["stages"].append(rec)
        report["seconds"] = time.perf_counter() - t0
        base.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        base.with_suffix(".md").write_text(markdown(report))
        print(f"device_check: {stage.name} {rec['status']} in {rec['seconds']:.0f} s", flush=True)
        if rec["status"] != "ok":    # the cause, not only the status (issue 58)
            print("\n".join(f"  | {line}" for line in rec["tail"][-4:]), flush=True)
        if stage.name == "profile" and not args.keep_profile:
            shutil.rmtree(work / "profile", ignore_errors=True)   # traces + HLO: ~50 MB
    failed = [s["stage"] for s in report["stages"] if s["status"] != "ok"]
    print(f"device_check: report {base}.md / .json ({len(todo) - len(failed)} of {len(todo)} "
          f"stages ok{', failed: ' + ', '.join(failed) if failed else ''}); logs in {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
