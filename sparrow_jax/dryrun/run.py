"""`sparrow dryrun`: compile one whole RL step at production shapes for a TPU slice or GPU node,
without the hardware, and say whether it fits in each device's memory.

    sparrow dryrun CONFIG.gin [--gin_param ...] --target v5p-32 [--preset qwen3-8b] [--json]

No weights, no data: parameters are abstract (shapes from --model_config / --preset / the
config's model_path/config.json), prompts are `DryrunConfig.prompt_length` tokens and responses
`RolloutConfig.max_new_tokens`. The mesh is built over the target's compile-only devices as
`sparrow train` builds it (`make_mesh(model=TrainConfig.mesh_model)`, host placement checked by
`multihost.check_mesh`), and every program of one RL step is lowered with the real shardings and
compiled by the target's own compiler (libtpu / the jax CUDA plugin): the rollout's prefill and
decode loop (on the compute-dtype param copy), the learner's analysis pass, gradient program and
optimizer update (on the master params + Adam state).

Memory per device (`compiled.memory_analysis()`): a program's peak is
arguments + outputs - aliased (donated) + temporaries + code. The step's peak is

    peak         = persistent + step_data + max over programs P of transient(P)
    persistent   = master params + optimizer state + rollout param copy (alive the whole step)
    step_data    = the step's trajectories (all rollout calls) + the analysis outputs +
                   advantages: alive from the rollout to the update (counted whole, also while
                   the first rollout calls run: a small over-estimate)
    transient(P) = peak(P) - P's arguments that are persistent or step data
                   - P's outputs that become step data (so no buffer is counted twice)

FITS when peak <= (1 - headroom) x HBM. On GPU the default headroom 0.1 is the launcher's
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9; on TPU it leaves room for runtime reservations. A TPU program
that cannot fit fails inside libtpu; the compiler's "required" figure is then its peak.
The largest batches that would fit come from a line through two compiles: of the rollout
programs at two rows-per-call, and of the learner programs at two micro-batch sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from sparrow_jax.dryrun.programs import (Measured, StepShape, abstract_policy,
                                         abstract_trajectories, compile_program, decode_state,
                                         device_bytes, join_program, learner_programs, paged_layout,
                                         paged_rollout_programs, place, rollout_programs, sds,
                                         step_shape)
from sparrow_jax.dryrun.targets import (TARGETS, Target, get_target, target_devices,
                                        toolchain_name, toolchain_problem)
from sparrow_jax.model.config import QWEN3_PRESETS, Qwen3Config, qwen3_preset
from sparrow_jax.dryrun import kernel_census, selection_cost
from sparrow_jax.dryrun import report as report_text
from sparrow_jax.rollout.config import Engine, RolloutMode, padded_length
from sparrow_jax.runtime import multihost
from sparrow_jax.runtime.sharding import ShardingSpec, make_mesh
from sparrow_jax.sparsity import cost_model

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]   # sparrow_jax/dryrun/run.py -> the repository
COMPILE_ENV = REPO / ".compile-env"
_CHILD_ENV = "SPARROW_DRYRUN_CHILD"


def measure_rollout(shape: StepShape, spec: ShardingSpec, target: Target, rows: int, *,
                    probe: bool = False, pages_per_pool: int | None = None) -> list[Measured]:
    """prefill + decode for `rows` rows per call; probe: also a decode recording one block of
    tokens over the same cache - XLA costs a while loop's body once, so that program's cost
    analysis is one decode step (+ a small prologue/epilogue). pages_per_pool: the paged
    engine's pool size (see `paged_rollout_programs`)."""
    per_dev = rows / spec.mesh.shape["data"]
    if shape.rollout.engine == Engine.PAGED:
        progs, _ = paged_rollout_programs(shape, spec, rows, target.hbm_bytes, pages_per_pool)
        out = [compile_program(p, target.kernel_platform, per_dev)[0] for p in progs]
        if probe:                       # one decode step: its cost analysis is one token's
            d = progs[-1]               # (exact_sparse: one round, gamma + 1 tokens at most)
            steps = shape.rollout.gamma + 1 if shape.rollout.mode == RolloutMode.EXACT_SPARSE else 1
            d.name, d.static = d.name + f"[{steps}-step cost probe]", {**d.static, "steps": steps}
            out.append(compile_program(d, target.kernel_platform, per_dev)[0])
        return out
    prefill, decode = rollout_programs(shape, spec, rows)
    m_pre, lowered, compiled = compile_program(prefill, target.kernel_platform, per_dev)
    out = [m_pre]
    for tokens in (0, shape.rollout.block_size) if probe else (0,):
        decode.args = (*decode.args[:2], decode_state(lowered, compiled, spec, tokens),
                       decode.args[3])
        decode.name = "rollout.decode" + ("[1-step cost probe]" if tokens else "")
        out.append(compile_program(decode, target.kernel_platform, per_dev)[0])
    return out


def measure_learner(shape: StepShape, spec: ShardingSpec, target: Target, micro: int, *,
                    update: bool = True) -> list[Measured]:
    data, mini = spec.mesh.shape["data"], shape.learner.ppo_mini_batch_size or shape.rows_step
    progs = learner_programs(shape, spec, micro)
    rows = {"learner.analyze": (micro or shape.rows_step) / data}
    return [compile_program(p, target.kernel_platform, rows.get(p.name, (micro or mini) / data))[0]
            for p in progs if update or p.name != "learner.apply"]


def at_depth(measure, shape: StepShape, depth: int, *args, **kw) -> list[Measured]:
    """`measure(shape, ...)` for the model as it is (depth 0), or at `depth` and `depth + 1`
    layers, each figure extrapolated linearly to the model's depth: a quick estimate. Exact for
    the rollout programs (measured); the learner's layers are a scan whose body is the same at
    any depth, but the compiler's working space is not linear (`learner.apply`'s temporaries
    came out 22% low at Qwen3-0.6B's shapes, though a tiny config holds), and the analysis and
    gradient compiles barely shrink with depth (docs/dryrun.md): FITS from an extrapolated
    learner is not a guarantee."""
    full = shape.model.num_hidden_layers
    if not depth or depth + 1 >= full:
        return measure(shape, *args, **kw)
    log.warning("%s: figures extrapolated from %d and %d layers to %d", measure.__name__, depth,
                depth + 1, full)
    a, b = (measure(dataclasses.replace(shape, model=dataclasses.replace(
        shape.model, num_hidden_layers=n)), *args, **kw) for n in (depth, depth + 1))
    out = []
    for x, y in zip(a, b):
        def line(f):
            u, v = getattr(x, f), getattr(y, f)
            return None if u is None or v is None else type(u)(u + (full - depth) * (v - u))
        numeric = [f.name for f in dataclasses.fields(Measured)
                   if f.name not in ("name", "rows_per_device", "compile_s", "compile_cpu_s",
                                     "largest", "error")]
        out.append(dataclasses.replace(
            y, **{f: line(f) for f in numeric}, compile_s=x.compile_s + y.compile_s,
            compile_cpu_s=x.compile_cpu_s + y.compile_cpu_s,
            error=x.error or y.error))
    return out


def build_spec(shape: StepShape, target: Target) -> ShardingSpec:
    """The training mesh over the target's devices, with the multi-host checks of a real launch."""
    devices = target_devices(target)
    try:
        spec = ShardingSpec.create(make_mesh(model=shape.mesh_model, devices=devices))
        multihost.check_mesh(spec)
    except ValueError as e:
        raise ValueError(f"TrainConfig.mesh_model = {shape.mesh_model} does not fit {target.name} "
                         f"({target.num_hosts} host(s) of {target.devices_per_host} devices): {e}. "
                         f"Use a mesh_model that divides {target.devices_per_host}.") from None
    data = spec.mesh.shape["data"]
    for what, rows in (("rollouts per step", shape.rows_step),
                       ("rows per rollout call", shape.rows_call)):
        if rows % data:
            raise ValueError(f"{what} = {rows} is not divisible by the data axis ({data}) of "
                             f"mesh {dict(spec.mesh.shape)} on {target.name}")
    return spec


def _other_size(value: int, unit: int, total: int) -> int | None:
    """A second batch size for a line fit: half of `value`, or double, as a multiple of `unit`
    that divides `total`."""
    for v in (value // 2, value * 2):
        if v and v % unit == 0 and total % v == 0:
            return v
    return None


def _fit(a: Measured, b: Measured, room: float) -> int | None:
    """Largest rows per device with transient <= room, on the line through two compiles."""
    if a.transient is None or b.transient is None or a.rows_per_device == b.rows_per_device:
        return None
    slope = (b.transient - a.transient) / (b.rows_per_device - a.rows_per_device)
    return None if slope <= 0 else max(0, math.floor(a.rows_per_device + (room - a.transient) / slope))


def fit_max_batches(shape: StepShape, spec: ShardingSpec, target: Target,
                    rollout: list[Measured], learn: list[Measured], room: float,
                    depth: int = 0, rollout_depth: int | None = None) -> dict:
    """Largest rollout rows per call and learner micro-batch (per device) that would fit."""
    data, out = spec.mesh.shape["data"], {}
    unit = math.lcm(shape.group_size * shape.hosts, data)
    # The paged engine's memory is its pool (RolloutConfig), not its rows: nothing to fit.
    rows2 = None if shape.rollout.engine == Engine.PAGED else _other_size(shape.rows_call, unit,
                                                                     shape.rows_step)
    if rows2:
        fits = [_fit(a, b, room) for a, b in zip(rollout[:2], at_depth(
            measure_rollout, shape, depth if rollout_depth is None else rollout_depth, spec,
            target, rows2))]
        best = out["rollout_rows_per_device"] = None if None in fits else min(fits)
        if best is not None:
            calls = [p for p in range(1, shape.rows_step // (shape.group_size * shape.hosts) + 1)
                     if (p * shape.group_size * shape.hosts) % data == 0
                     and p * shape.group_size * shape.hosts / data <= best]
            out["rollout_batch_prompts"] = max(calls) if calls else 0
    mini = shape.learner.ppo_mini_batch_size or shape.rows_step
    mb = shape.learner.micro_batch_size or mini
    mb2 = _other_size(mb, math.lcm(shape.group_size, data), mini)
    if mb2:
        other = at_depth(measure_learner, shape, depth, spec, target, mb2, update=False)
        fits = [_fit(a, b, room) for a, b in zip(learn, other)]
        best = out["micro_rows_per_device"] = None if None in fits else min(fits)
        if best is not None:
            ok = [m for m in range(shape.group_size, mini + 1, shape.group_size)
                  if mini % m == 0 and m / data <= best]
            out["micro_batch_size"] = max(ok) if ok else 0
    return out


def cost_check(shape: StepShape, spec: ShardingSpec, probe: Measured | None) -> dict:
    """Compiled bytes of one decode step vs `cost_model` for the same shape, per device."""
    rc, m = shape.rollout, shape.model
    ms = cost_model.ModelShape(m.num_hidden_layers, m.hidden_size, m.num_attention_heads,
                               m.num_key_value_heads, m.head_dim, m.intermediate_size,
                               m.vocab_size, tuple(rc.dense_layers),
                               jnp.dtype(shape.compute_dtype).itemsize)
    rows = shape.rows_call / spec.mesh.shape["data"]
    ctx = padded_length(shape.prompt_len + rc.max_new_tokens, rc.block_size)
    out = {"context": ctx, "rows_per_device": rows, "budget": rc.max_budget,
           "compiled_bytes": probe and probe.bytes_accessed, "compiled_flops": probe and probe.flops}
    for name, budget in (("sparse", rc.max_budget), ("dense", 1 << 30)):
        c = cost_model.decode_token_cost(ms, [ctx], budget, block_size=rc.block_size, batch=rows)
        # Weights and KV heads are split over the model axis; rows over the data axis.
        out[f"model_{name}_bytes"] = float(c["bytes"][0] * rows / spec.mesh.shape["model"])
        out[f"model_{name}_flops"] = float(c["flops"][0] * rows / spec.mesh.shape["model"])
    return out


def _depth_text(depth: int, rollout_depth: int, layers: int) -> str:
    def one(d: int) -> str:
        return (f"compiled at {d} and {d + 1} layers, extrapolated to {layers}"
                if d and d + 1 < layers else f"compiled at full depth ({layers} layers)")
    if rollout_depth == depth:
        return one(depth)
    return f"rollout {one(rollout_depth)}; learner {one(depth)}"


def run_dryrun(target_name: str, model: Qwen3Config, *, headroom: float = 0.1,
               fit: bool = True, depth: int = 0, cost: bool = True,
               rollout_depth: int | None = None, kernels: bool = False) -> dict:
    """Compiles one RL step of the parsed gin configuration for `target_name`; the report.
    depth > 0: compile the model-sized programs at `depth` and `depth + 1` layers and
    extrapolate (`at_depth`); 0: at full depth. rollout_depth: the same for the rollout
    programs only (default: `depth`) - their layers are unrolled, so their compile time grows
    with depth, and their extrapolation is exact (measured; docs/dryrun.md), while the learner's
    scanned layers compile at full depth. cost=False skips the 1-step decode compile that only
    the cost check reads (not the memory verdict). kernels: also count the kernels one decode
    step launches (`kernel_census`, GPU targets: the decode program compiled again at 2-5
    layers)."""
    target = get_target(target_name)
    log.info("dryrun target %s; toolchain %s", target.describe(), toolchain_name(target))
    t0 = time.perf_counter()
    shape = step_shape(model, target)
    spec = build_spec(shape, target)
    data, limit = spec.mesh.shape["data"], (1 - headroom) * target.hbm_bytes
    rollout_depth = depth if rollout_depth is None else rollout_depth
    pool = None
    if shape.rollout.engine == Engine.PAGED:
        pool = paged_layout(shape, spec, shape.rows_call, target.hbm_bytes)
    rollout = at_depth(measure_rollout, shape, rollout_depth, spec, target, shape.rows_call,
                       probe=cost, pages_per_pool=pool and pool.pages_per_pool)
    probe = rollout.pop() if cost else None
    if shape.rows_call < shape.rows_step:
        rollout.append(compile_program(join_program(shape, spec), target.kernel_platform,
                                       shape.rows_step / data)[0])
    learn = at_depth(measure_learner, shape, depth, spec, target, shape.learner.micro_batch_size)
    _, state, params, _ = abstract_policy(shape, spec)
    persistent = {"master_params": device_bytes(state),
                  "optimizer_state": learn[-1].persistent_args - device_bytes(params),
                  "rollout_params": device_bytes(place(state, jax.tree.map(
                      lambda x: x.sharding, state), shape.compute_dtype))}
    t, rows = shape.rollout.max_new_tokens, shape.rows_step
    outputs = {"full": 3, "topk": 2, "none": 1}[shape.learner.alpha_mode]    # logp_old, alpha, ..
    analysis = sum(p.step_out for p in learn) or outputs * device_bytes(sds((rows, t), jnp.float32, spec))
    step_data = (device_bytes(abstract_trajectories(shape, rows, spec)) + analysis
                 + device_bytes(sds((rows,), jnp.float32, spec)))
    programs = rollout + learn
    transients = [p.transient for p in programs]
    base = sum(persistent.values()) + step_data
    peak = None if None in transients else base + max(transients)
    lc = shape.learner
    report = {
        "target": target.name, "target_description": target.describe(),
        "toolchain": toolchain_name(target), "hbm_bytes": target.hbm_bytes, "headroom": headroom,
        "limit_bytes": limit, "mesh": dict(spec.mesh.shape), "model_params": model.num_params(),
        "shape": {"rows_step": rows, "rows_call": shape.rows_call,
                  "rollout_calls": rows // shape.rows_call, "rows_call_per_device": shape.rows_call / data,
                  "ppo_mini_batch": lc.ppo_mini_batch_size or rows,
                  "micro_batch": lc.micro_batch_size or lc.ppo_mini_batch_size or rows,
                  "prompt_len": shape.prompt_len, "max_new_tokens": t,
                  "compute_dtype": jnp.dtype(shape.compute_dtype).name,
                  "master_dtype": jnp.dtype(shape.master_dtype).name, "remat": lc.remat,
                  "rollout_mode": shape.rollout.mode, "backend": shape.rollout.backend,
                  "rollout_engine": shape.rollout.engine},
        "persistent": persistent, "step_data": step_data,
        "programs": [dataclasses.asdict(p) | {"transient": p.transient} for p in programs],
        "peak_bytes": peak,
        "fits": peak is not None and peak <= limit and not any(p.error for p in programs),
        "cost_check": cost_check(shape, spec, probe) | {
            "probe_compile_s": probe.compile_s if probe else None},
        "decode_step_bytes": selection_cost.for_step(shape, spec, target, pool) if cost else None,
        "depth": _depth_text(depth, rollout_depth, model.num_hidden_layers),
    }
    if pool is not None:
        lay = pool
        report["paged_pool"] = {
            "pages_per_pool": lay.pages_per_pool, "pools": lay.pools,
            "bytes_per_device": lay.bytes_per_device, "source": lay.source,
            "tokens_per_pool": lay.pages_per_pool * shape.rollout.block_size,
            "slots_per_device": lay.slots_per_pool, "max_tokens_per_sample":
                lay.max_pages * shape.rollout.block_size,
            "chunk_steps": shape.rollout.chunk_steps}
    if kernels:
        report["decode_kernels"] = kernel_census.census_by_depth(shape, spec, target).as_dict()
    if fit:
        report["max_batches"] = fit_max_batches(shape, spec, target, rollout[:2], learn,
                                                limit - base, depth, rollout_depth)
    report["compile_s"] = time.perf_counter() - t0
    return report


# -- command line ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="one of: " + ", ".join(TARGETS))
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model_config", help="a Hugging Face config.json (or its directory)")
    group.add_argument("--preset", help="model shape by name: " + ", ".join(QWEN3_PRESETS))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--headroom", type=float, default=0.1,
                        help="fraction of HBM kept free (default 0.1)")
    parser.add_argument("--depth", default="full",
                        help="'full' (default), or N: compile model-sized programs at N and N+1 "
                             "layers and extrapolate - a quick estimate, exact for the rollout "
                             "but NOT for the learner (its update's temporaries came out 22%% "
                             "low at Qwen3-0.6B's shapes; see docs/dryrun.md)")
    parser.add_argument("--rollout_depth", default=None,
                        help="like --depth, for the rollout programs only (default: --depth): "
                             "their layers are unrolled (compile time grows with depth) and "
                             "their extrapolation is exact (measured, docs/dryrun.md); the "
                             "learner's scanned layers still compile at --depth")
    parser.add_argument("--no_fit", action="store_true",
                        help="skip the extra compiles that find the largest batches that fit")
    parser.add_argument("--no_cost", action="store_true",
                        help="skip the 1-step decode compile behind the per-step bytes check "
                             "(the memory verdict does not read it; CI's shipped-config guard)")
    parser.add_argument("--kernels", action="store_true",
                        help="GPU targets: also count the kernels one decode step launches, per "
                             "dense / sparse layer and outside (the decode program compiled "
                             "again at 2-5 layers; docs/dryrun.md)")


def _depth(value: str) -> int:
    """--depth -> layers to compile at (0 = full depth); at least the dense layers + 1 sparse."""
    if value == "full":
        return 0
    from sparrow_jax.rollout import RolloutConfig
    low = max(RolloutConfig().dense_layers, default=-1) + 2
    if not value.isdigit() or int(value) < low:
        raise SystemExit(f"sparrow dryrun: --depth must be 'full' or a number >= {low} (the dense "
                         f"layers plus one sparse layer), got {value!r}")
    return int(value)


def model_shape(args: argparse.Namespace) -> Qwen3Config:
    """--preset, --model_config, or the config's TrainConfig.model_path/config.json."""
    if args.preset:
        return qwen3_preset(args.preset)
    from sparrow_jax.train.config import TrainConfig
    path = Path(args.model_config or TrainConfig().model_path)
    path = path / "config.json" if path.suffix != ".json" else path
    if not path.is_file():
        raise ValueError(f"no model shape: {path} does not exist; pass --preset "
                         f"({', '.join(QWEN3_PRESETS)}) or --model_config config.json")
    return Qwen3Config.from_hf_dict(json.loads(path.read_text()), source=str(path))


def _reexec(args: argparse.Namespace) -> int:
    """This command again with the compile environment on PYTHONPATH, from a directory outside the
    repository (a `libtpu` folder in the working directory would shadow the package)."""
    argv = ["--log_level", args.log_level, "dryrun", *map(os.path.abspath, args.gin_files),
            "--target", args.target, "--headroom", str(args.headroom)]
    for p in args.gin_param:
        argv += ["--gin_param", p]
    argv += ["--model_config", os.path.abspath(args.model_config)] if args.model_config else []
    argv += (["--preset", args.preset] if args.preset else []) + ["--json"] * args.json
    argv += ["--no_fit"] * args.no_fit + ["--no_cost"] * args.no_cost + ["--depth", args.depth]
    argv += ["--kernels"] * args.kernels
    argv += ["--rollout_depth", args.rollout_depth] if args.rollout_depth else []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([str(COMPILE_ENV), str(REPO)]), JAX_PLATFORMS="cpu",
               **{_CHILD_ENV: "1"})
    log.info("toolchain not importable here: re-running with PYTHONPATH=%s", env["PYTHONPATH"])
    with tempfile.TemporaryDirectory(prefix="sparrow-dryrun-") as cwd:
        return subprocess.run([sys.executable, "-m", "sparrow_jax.cli", *argv], cwd=cwd,
                              env=env).returncode


def main(args: argparse.Namespace) -> int:
    try:
        target = get_target(args.target)
    except ValueError as e:
        raise SystemExit(f"sparrow dryrun: {e}") from None
    if args.kernels and target.platform != "cuda":
        raise SystemExit(f"sparrow dryrun: --kernels counts the kernels of a GPU decode step; "
                         f"{target.name} is a {target.platform} target")
    problem = toolchain_problem(target)
    if problem:
        if (COMPILE_ENV / ".sparrow-compile-env").exists() and not os.environ.get(_CHILD_ENV):
            return _reexec(args)
        raise SystemExit(f"sparrow dryrun: {problem}")
    # libtpu takes a machine-wide lock file by default (one process per TPU host); compile-only
    # processes touch no chip, so several dryruns (or a dryrun beside a test) may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not os.environ.get("JAX_PLATFORMS"):
        # Compile-only devices need no backend; CPU keeps libtpu / the CUDA plugin from probing
        # for hardware that is not there.
        jax.config.update("jax_platforms", "cpu")
    try:
        report = run_dryrun(args.target, model_shape(args), headroom=args.headroom,
                            fit=not args.no_fit, depth=_depth(args.depth),
                            cost=not args.no_cost,
                            rollout_depth=None if args.rollout_depth is None
                            else _depth(args.rollout_depth), kernels=args.kernels)
    except ValueError as e:
        raise SystemExit(f"sparrow dryrun: {e}") from None
    print(json.dumps(report, indent=1, default=str) if args.json else report_text.format_report(report),
          flush=True)
    return 0 if report["fits"] else 1
