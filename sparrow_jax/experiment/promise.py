"""`sparrow promise`: the promise measured on one GPU in one call (issue 56).

    sparrow promise CONFIG.gin [more.gin] [--gin_param ...] [--out DIR] [--stem NAME]
        [--checkpoint FILE.safetensors] [--device KIND] [--plan]

Three parts, each a `sparrow` child process under a deadline, all within
`PromiseConfig.time_limit_s` (the device check's `promise` stage: at most 9 minutes on one H200,
compiles included; docs/devices/README.md has the time plan):

1. **Warm-up on the device**: `sparrow sft` trains the config's model from scratch on the
   synthetic long task (`PromiseConfig.k_range`: 4-6K-token answers on the GPU) with the
   sparsity-aware loss, for `SFTConfig.max_seconds`. The checkpoint comes back as ONE file,
   `<out>/<stem>.safetensors` (bf16 weights; config and tokenizer in its header:
   `runtime.packed_checkpoint`), which `--checkpoint FILE` reuses instead of training.
2. **The registered RL arms** from that checkpoint, one after another on the paged engine
   (`PromiseConfig.arms`: dense, the certified controller, exact sparse), each for
   `PromiseConfig.steps` RL steps with its own seed (registered: `PromiseConfig.seeds`, the next
   one not yet in the results file), held-out references scored teacher-forced at the start and
   after every step. The time left is shared among the arms still to run: an arm past its share
   is asked to stop (SIGTERM: it finishes its step and saves), one past the command's deadline is
   killed; what finished is reported.
3. **The report**, `<out>/<stem>.md` and `.json` (`promise_report`), rewritten after every part:
   per arm the RL step's split, rollout tokens/s, the whole model's KV read, the tail per bin,
   held-out metrics at start and end, sparse/dense per RL step and per rollout, the bytes-vs-
   launches balance of a decode step; and the run's seeds appended to `<out>/<results_file>`,
   which pools every run of the same registered config (`promise_pool`: the pooled estimate with
   its interval, and how many more runs the registered test needs).

`--plan` prints the time plan only (no child, no device). The parent process never starts jax on
the device: each child gets the whole GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import gin

from sparrow_jax.experiment import promise_plan, promise_pool, promise_report
from sparrow_jax.experiment.prereg import PreregConfig
from sparrow_jax.experiment.runner import (STOPPED_EXIT_CODES, arm_command,
                                           sigterm_as_interrupt)

__all__ = ["PromiseConfig", "ChildRun", "run_child", "run_promise", "add_arguments", "main"]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PromiseConfig:
    """What one `sparrow promise` run is; registered in its gin file before any run.

    name: the experiment's name (the report's stem ends with it).
    arms: arm -> gin bindings on top of the config (run in this order; the first is
      `PreregConfig.reference` and evaluates at step 0 for all: same checkpoint).
    seeds: the registered seeds, one per run, used in order (the next one the results file
      does not hold yet); arm i of a run trains with seed + 1000 i (data order and sampling keys
      of its own: arms are independent training runs, so their difference carries the
      run-to-run variance).
    steps: RL steps per arm; the held-out metric after this step is the registered endpoint.
    k_range: the synthetic task's cycles K (81 tokens each) of the RL prompts and references.
    train_prompts, heldout_prompts, train_seed, heldout_seed: the generated prompt files
      (seeds none of the warm-up's: tests/test_promise.py checks).
    time_limit_s: the whole command; warmup_limit_s: the warm-up's process; report_reserve_s:
      kept for the report at the end.
    results_file: under --out, pools every run of the same registered config."""
    name: str = "promise"
    arms: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = ()
    steps: int = 2
    k_range: tuple[int, int] = (50, 75)
    train_prompts: int = 512
    heldout_prompts: int = 64
    train_seed: int = 52
    heldout_seed: int = 53
    time_limit_s: float = 530.0
    warmup_limit_s: float = 180.0
    report_reserve_s: float = 10.0
    results_file: str = "promise_results.jsonl"

    def __post_init__(self):
        if not self.arms or not self.seeds:
            raise ValueError("PromiseConfig: bind its arms and its registered seeds")
        for name, bindings in self.arms.items():
            if not name or "/" in name or name.startswith(".") or isinstance(bindings, str):
                raise ValueError(f"PromiseConfig.arms: bad arm {name!r} (a directory name, "
                                 f"with a list of gin bindings)")
        if self.steps < 1 or self.k_range[0] > self.k_range[1] or self.time_limit_s <= 0:
            raise ValueError(f"PromiseConfig: steps >= 1, k_range (lo, hi) and time_limit_s > 0"
                             f" (got {self.steps}, {self.k_range}, {self.time_limit_s})")
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))


def arm_seed(seed: int, index: int) -> int:
    """The training seed of arm `index` of a run registered under `seed`."""
    return seed + 1000 * index


# -- children ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChildRun:
    """How a child process ended: exit code (None: killed), seconds, whether it was asked to
    stop (SIGTERM at its soft deadline) or killed (its hard deadline)."""
    code: int | None
    seconds: float
    stopped: bool
    killed: bool

    @property
    def status(self) -> str:
        if self.killed:
            return "killed"
        if self.code == 0:
            return "ok"
        return "stopped" if self.code in STOPPED_EXIT_CODES or self.stopped else "fail"


def run_child(cmd: Sequence[str], *, soft: float, hard: float, env: Mapping[str, str] | None =
              None, poll_s: float = 0.2) -> ChildRun:
    """Runs `cmd` (its output to ours: the device check's log keeps it); SIGTERM at monotonic
    time `soft` (`sparrow train` then ends its step and saves; a command in its start-up, and
    `sparrow sft`, leave at once), SIGKILL of its process group at `hard`. A KeyboardInterrupt
    here (Ctrl-C, or SIGTERM to the command: `runner.sigterm_as_interrupt`) kills the child's
    group first."""
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), cwd=REPO, env=None if env is None else dict(env),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    stopped = killed = False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now >= hard:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                proc.wait()
                break
            if now >= soft and not stopped:
                log.warning("stopping pid %d at its deadline (SIGTERM)",
                            proc.pid)
                proc.terminate()
                stopped = True
            time.sleep(poll_s)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise
    return ChildRun(None if killed else proc.returncode, time.monotonic() - t0, stopped, killed)


def sparrow_command(command: str, gin_files: Sequence[str], bindings: Sequence[str]
                    ) -> list[str]:
    """`python -m sparrow_jax.cli COMMAND FILES --gin_param ...`."""
    argv = [sys.executable, "-m", "sparrow_jax.cli", command, *gin_files]
    for b in bindings:
        argv += ["--gin_param", b]
    return argv


# -- the parts -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Data:
    train: Path
    heldout: Path


def write_data(cfg: PromiseConfig, folder: Path) -> Data:
    """The RL prompts and the held-out references of the task (generated: seeds and K range
    are the config's)."""
    from sparrow_jax.data.synthetic import write_jsonl
    folder.mkdir(parents=True, exist_ok=True)
    data = Data(folder / "train.jsonl", folder / "heldout.jsonl")
    write_jsonl(str(data.train), cfg.train_prompts, cfg.train_seed, cfg.k_range)
    write_jsonl(str(data.heldout), cfg.heldout_prompts, cfg.heldout_seed, cfg.k_range)
    return data


def config_sha(gin_files: Sequence[str], gin_params: Sequence[str]) -> str:
    """The registered config's identity: its files' text and the overrides, in order."""
    h = hashlib.sha256()
    for f in gin_files:
        h.update(Path(f).read_bytes())
    for p in gin_params:
        h.update(p.encode())
    return h.hexdigest()[:16]


def device_kind() -> str:
    """The device this host's jax sees, from a child that allocates nothing."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    probe = "import jax; print(jax.devices()[0].device_kind)"
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           env=env, timeout=120)
        return r.stdout.strip().splitlines()[-1]
    except Exception:       # reported as unknown: the parts say the rest
        return "unknown"


def arm_bindings(cfg: PromiseConfig, name: str, index: int, *, seed: int, model: Path,
                 run_dir: Path, data: Data, cache: Path) -> list[str]:
    """One arm's `sparrow train` bindings after the config's: its own, then where and what it
    trains (the checkpoint, its run directory, the generated data, its seed, the steps) and the
    run's compile cache (a later arm loads the programs an earlier one compiled: the learner's,
    the references')."""
    return [*cfg.arms[name], f"TrainConfig.model_path = '{model}'",
            f"TrainConfig.compile_cache_dir = '{cache}'",
            f"TrainConfig.run_dir = '{run_dir}'", f"TrainConfig.train_data = '{data.train}'",
            "TrainConfig.eval_data = ''", f"ReferenceEvalConfig.data = '{data.heldout}'",
            f"TrainConfig.seed = {arm_seed(seed, index)}",
            f"TrainConfig.total_steps = {cfg.steps}", "TrainConfig.eval_every = 1",
            f"TrainConfig.eval_at_start = {index == 0}"]


def warmup_bindings(out_dir: Path) -> list[str]:
    return [f"SFTConfig.output_dir = '{out_dir}'", "SFTConfig.overwrite = True"]


def run_promise(gin_files: Sequence[str], gin_params: Sequence[str], *, out: Path, stem: str,
                work: Path, checkpoint: Path | None = None, device: str = "") -> dict:
    """The three parts (module docstring); returns the report's JSON."""
    from sparrow_jax.runtime import packed_checkpoint
    from sparrow_jax.train.sft import SFTConfig, read_summary

    t0 = time.monotonic()
    cfg, pre, sft = PromiseConfig(), PreregConfig(), SFTConfig()
    end = t0 + cfg.time_limit_s
    out.mkdir(parents=True, exist_ok=True)
    sha = config_sha(gin_files, gin_params)
    results = promise_pool.results_path(out, cfg.results_file, REPO / "docs" / "devices")
    seed, registered = promise_pool.next_seed(promise_pool.read(results), sha, cfg.seeds)
    report = promise_report.Report(
        name=cfg.name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), device=device or device_kind(), config=tuple(gin_files),
        overrides=tuple(gin_params), config_sha=sha, seed=seed, registered_seed=registered,
        steps=cfg.steps, k_range=cfg.k_range, arm_names=tuple(cfg.arms),
        reference=pre.reference, equivalent_arm=pre.equivalent_arm, metric=pre.metric,
        margin=pre.margin, alpha=pre.alpha, time_limit_s=cfg.time_limit_s,
        plan=plan_for(gin_files, gin_params, cfg).as_dict(),
        results_file=results.name)
    files = promise_report.ReportFiles(out, stem)

    def save(rep: promise_report.Report, part: str) -> promise_report.Report:
        rep = dataclasses.replace(rep, seconds=time.monotonic() - t0)
        files.write(rep)
        log.info("promise: %s done at %.0f s; report %s", part, rep.seconds, files.md)
        return rep

    data = write_data(cfg, work / "data")
    # 1. warm-up (or the checkpoint given)
    packed = out / f"{stem}.safetensors"
    model = work / "model"
    if checkpoint is not None:
        packed_checkpoint.unpack(checkpoint, model)
        warmup = promise_report.warmup_record("reused", 0.0, read_summary(model),
                                              checkpoint.name, checkpoint.stat().st_size,
                                              model, sft)
    else:
        trained = work / "warmup"
        log.info("promise: warm-up, `sparrow sft` for %.0f s", sft.max_seconds)
        now = time.monotonic()
        run = run_child(sparrow_command("sft", gin_files, [*gin_params,
                                                           *warmup_bindings(trained)]),
                        soft=min(end, now + cfg.warmup_limit_s),
                        hard=min(end, now + cfg.warmup_limit_s + 15))
        size = 0
        if run.status == "ok":
            packed_checkpoint.pack(trained, packed)
            packed_checkpoint.unpack(packed, model)
            size = packed.stat().st_size
        warmup = promise_report.warmup_record(run.status, run.seconds, read_summary(trained),
                                              packed.name, size, model if size else None, sft)
    report = save(dataclasses.replace(report, warmup=warmup), "warm-up")
    if not (model / "config.json").is_file():
        log.error("promise: no checkpoint to train from (warm-up %s)", warmup["status"])
        return finish(report, files, results, pre, cfg, t0)
    # 2. the arms, one after another, sharing the time left
    arms_end = end - cfg.report_reserve_s
    expected = {p["part"]: p["seconds"] for p in report.plan["parts"]}
    names = list(cfg.arms)
    for i, name in enumerate(names):
        now = time.monotonic()
        share = max(0.0, (arms_end - now) * arm_share(expected, names[i:]))
        run_dir = work / "arms" / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a reused --work: no resume of its last run
        cmd = arm_command(gin_files, gin_params, arm_bindings(
            cfg, name, i, seed=seed, model=model, run_dir=run_dir, data=data,
            cache=work / "xla"))
        log.info("promise: arm %s (%d of %d), %.0f s of the %.0f left", name, i + 1,
                 len(cfg.arms), share, arms_end - now)
        run = (run_child(cmd, soft=now + share, hard=arms_end) if share > 0
               else ChildRun(None, 0.0, False, True))
        report = save(report.with_arm(name, promise_report.arm_record(
            name, arm_seed(seed, i), run.status, run.code, run.seconds, run_dir, model)),
            f"arm {name}")
    return finish(report, files, results, pre, cfg, t0)


def arm_share(expected: Mapping[str, float], arms: Sequence[str]) -> float:
    """The first of `arms`' share of the time left: its planned seconds over theirs (equal
    shares where the plan has no entry)."""
    secs = [max(expected.get(f"arm {a}", 1.0), 1.0) for a in arms]
    return secs[0] / sum(secs)


def finish(report: promise_report.Report, files: promise_report.ReportFiles, results: Path,
           pre: PreregConfig, cfg: PromiseConfig, t0: float) -> dict:
    """Appends this run to the results file (when an arm reached the registered step) and
    pools every run of the registered config; the report's last writing."""
    record = report.pool_record()
    records = (promise_pool.append(results, record) if record["values"]
               else promise_pool.read(results))
    report = dataclasses.replace(
        report, seconds=time.monotonic() - t0,
        pooled=promise_pool.pooled(records, report.config_sha, pre, list(cfg.arms),
                                   seeds_registered=len(cfg.seeds)))
    files.write(report)
    print(json.dumps(report.summary()), flush=True)
    return report.as_dict()


def plan_for(gin_files: Sequence[str], gin_params: Sequence[str], cfg: PromiseConfig
             ) -> "promise_plan.TimePlan":
    """The time plan of this config (`promise_plan.time_plan`), from each arm's compile plan;
    leaves the base configuration parsed."""
    from sparrow_jax.data.synthetic import prompt_tokens
    from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
    from sparrow_jax.runtime.gin_files import parse_gin
    from sparrow_jax.sparsity.cost_model import ModelShape
    from sparrow_jax.sparsity.schedule import make_schedule
    from sparrow_jax.train import compile_plan
    from sparrow_jax.train import plan as run_plan
    from sparrow_jax.train.sft import SFTConfig, demo_model_config

    sft = SFTConfig()
    mcfg = demo_model_config(sft, build_synthetic_tokenizer())
    placeholders = ["TrainConfig.model_path = 'model'", "TrainConfig.train_data = 'train'",
                    "TrainConfig.eval_data = ''", "ReferenceEvalConfig.data = 'heldout'"]
    shapes, run = [], None
    for i, name in enumerate(cfg.arms):
        parse_gin(gin_files, [*gin_params, *cfg.arms[name], *placeholders,
                              f"TrainConfig.eval_at_start = {i == 0}"])
        run = run_plan.from_gin()
        programs = compile_plan.from_gin(mcfg, data_shards=1).programs
        # Programs of one name differ by the mode (decode) or the learner's alpha (grads)
        suffix = {"rollout/paged_decode": f":{run.mode}",
                  "learner/grads": f":alpha-{run.learner.alpha_mode}"}
        shapes.append(promise_plan.ArmShape(
            name, str(run.mode), tuple((p.name + suffix.get(p.name, ""), p.first)
                                       for p in programs if p.first), i == 0))
    parse_gin(gin_files, gin_params)
    sched = make_schedule()
    shape = ModelShape.from_hf_config(mcfg.to_hf_dict(dtype="bfloat16"),
                                      dense_layers=tuple(run.rollout.dense_layers))

    def budget_at(context: int) -> int:
        return int(sched.budgets[min(context // sched.bin_size, len(sched.budgets) - 1)])
    return promise_plan.time_plan(
        shape, shapes, rows=run.train.prompts_per_step * run.train.group_size,
        group_size=run.train.group_size, k_range=cfg.k_range, prompt_len=prompt_tokens() + 1,
        steps=cfg.steps, budget_at=budget_at, gamma=run.rollout.gamma,
        warmup_s=sft.max_seconds, limit_s=cfg.time_limit_s,
        references=min(cfg.heldout_prompts, run.reference.prompts),
        reference_len=prompt_tokens() + 1 + int(
            promise_plan.answer_lengths(1, cfg.k_range).mean()),
        cached=("learner/grads", "learner/apply", "eval/reference", "rollout/paged_prefill"))


# -- the command ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(REPO / "docs" / "devices"),
                        help="report, checkpoint file and results file directory "
                             "(default docs/devices)")
    parser.add_argument("--stem", default="", help="report file stem (default "
                        "<date>-<device>-<PromiseConfig.name>)")
    parser.add_argument("--checkpoint", default="",
                        help="a packed checkpoint (.safetensors) of an earlier run: no warm-up")
    parser.add_argument("--device", default="", help="the device's kind for the report "
                        "(default: asked of jax in a child process)")
    parser.add_argument("--work", default="", help="working folder (default: a temporary one)")
    parser.add_argument("--plan", action="store_true", help="print the time plan and stop")


def main(args: argparse.Namespace) -> int:
    try:
        cfg = PromiseConfig()
    except ValueError as e:
        raise SystemExit(f"sparrow promise: {e}") from None
    if args.plan:
        plan = plan_for(args.gin_files, args.gin_param, cfg)
        print("\n".join(plan.lines()))
        return 0 if plan.total <= cfg.time_limit_s else 1
    device = args.device or device_kind()
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    stem = args.stem or f"{datetime.date.today():%Y-%m-%d}-{slug}-{cfg.name}"
    work = Path(args.work or tempfile.mkdtemp(prefix="sparrow-promise-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None and not checkpoint.is_file():
        raise SystemExit(f"sparrow promise: no checkpoint file {checkpoint}")
    restore = sigterm_as_interrupt()    # SIGTERM, as Ctrl-C: the running child is killed
    try:                                 # (run_child), the report keeps the parts that ended
        report = run_promise(args.gin_files, args.gin_param, out=Path(args.out), stem=stem,
                             work=work, checkpoint=checkpoint, device=device)
    finally:
        restore()
    done = [a for a, r in report["arms"].items() if r["status"] == "ok"]
    return 0 if report["warmup"]["status"] in ("ok", "reused") and len(done) == len(
        report["arm_names"]) else 1
