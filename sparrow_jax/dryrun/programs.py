"""The programs of one RL step as abstract calls, and their compilation for a dryrun target.

`sparrow dryrun` (see `sparrow_jax.dryrun.run`) compiles what `Trainer.rl_step` runs, at production
shapes, with nothing materialised. This module is the one place that knows those programs'
signatures: the rollout's `prefill_program` / `decode_program` (one call per sub-batch of
`TrainConfig.rollout_batch_prompts` prompts, on the compute-dtype param copy), the join of the
sub-batches' trajectories, and the learner's `analyze_program` / `grads_program` /
`apply_program` exactly as `Learner.step` calls them (f32 master params, AdamW state). Each
abstract argument carries the `NamedSharding` training would give it, and a role: persistent
model state, step data (alive from the rollout to the update) or the program's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import resource
import time
from typing import TYPE_CHECKING, Any, Callable

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import dispatch
from sparrow_jax.dryrun.targets import GiB, Target
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rl import learner
from sparrow_jax.rl import learner_programs as learner_programs_mod
from sparrow_jax.rollout import (batching, continuous, continuous_state, exact, page_pool, paged,
                                 paged_exact, static)
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.kv_cache import CACHE_AXES, KVCache
from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.runtime.sharding import ShardingSpec, state_shardings
from sparrow_jax.sparsity.mismatch import AlphaMode

if TYPE_CHECKING:
    from sparrow_jax.train.plan import RunPlan

log = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DryrunConfig:
    prompt_length: int = 2048          # prompt width the rollout is compiled for (tokens)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one RL step's programs are compiled for. Rows are global (all hosts together)."""
    model: Qwen3Config
    compute_dtype: Any
    master_dtype: Any
    mesh_model: int
    group_size: int
    hosts: int
    rows_step: int                     # rollouts per RL step
    rows_call: int                     # rows per rollout program call
    prompt_len: int                    # prompt width (a bucket of DryrunConfig.prompt_length)
    rollout: RolloutConfig
    learner: learner.LearnerConfig
    replay: learner.SparseReplay
    num_bins: int
    bin_size: int
    plan: RunPlan                      # the run plan it was read from (train/plan.py)


def step_shape(model: Qwen3Config, target: Target) -> StepShape:
    """The step of the parsed gin configuration's run plan (`train.plan.from_gin`, what
    `sparrow train` resolves) on `target`."""
    from sparrow_jax.train.plan import from_gin
    run = from_gin()
    tc, rc = run.train, run.rollout
    hosts = target.num_hosts           # prompts_per_step is per process, one process per host
    per_call = tc.rollout_batch_prompts or tc.prompts_per_step
    return StepShape(
        model=model, compute_dtype=jnp.bfloat16 if tc.dtype == "auto" else jnp.dtype(tc.dtype),
        master_dtype=jnp.dtype(tc.param_dtype), mesh_model=tc.mesh_model,
        group_size=tc.group_size, hosts=hosts, rows_step=tc.prompts_per_step * tc.group_size * hosts,
        rows_call=per_call * tc.group_size * hosts,
        prompt_len=rc.prompt_width(DryrunConfig().prompt_length), rollout=rc, learner=run.learner,
        replay=run.replay, num_bins=run.schedule.num_bins, bin_size=run.schedule.bin_size,
        plan=run)


# -- abstract inputs of each program: the one place that knows the programs' signatures -----------
def sds(shape, dtype, spec: ShardingSpec, axes=None) -> jax.ShapeDtypeStruct:
    """Abstract array; axes None = rows (leading axis) over the data axis, like every batch."""
    axes = ("batch",) + (None,) * (len(shape) - 1) if axes is None and shape else axes or ()
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=spec.sharding(axes, shape))


def place(tree, shardings, dtype=None):
    """Abstract arrays with `shardings`; dtype casts the floating ones (a compute-dtype copy)."""
    def one(x, s):
        cast = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(x.shape, dtype if cast else x.dtype, sharding=s)
    return jax.tree.map(one, tree, shardings)


def abstract_policy(shape: StepShape, spec: ShardingSpec):
    """The learner's model (master params, compute dtype) as `load_hf(mesh=)` places it, nothing
    materialised: (model, full state, Param state, rest), every state sharded."""
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(shape.model, dtype=shape.compute_dtype,
                                                    param_dtype=shape.master_dtype))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    placed = [place(s, state_shardings(s, spec.mesh, spec.rules))
              for s in (nnx.state(model), params, rest)]
    return (model, *placed)


def abstract_trajectories(shape: StepShape, rows: int, spec: ShardingSpec) -> Trajectories:
    """Trajectories [rows, ...] at the maximum lengths (the learner's bucket trim is a no-op)."""
    t, k, i32, f32 = shape.rollout.max_new_tokens, shape.rollout.record_topk, jnp.int32, jnp.float32
    return Trajectories(
        prompt_tokens=sds((rows, shape.prompt_len), i32, spec), prompt_lengths=sds((rows,), i32, spec),
        tokens=sds((rows, t), i32, spec), logprobs=sds((rows, t), f32, spec),
        topk_logprobs=sds((rows, t, k), f32, spec), topk_ids=sds((rows, t, k), i32, spec),
        budgets=sds((rows, t), i32, spec), cached_lengths=sds((rows, t), i32, spec),
        mask=sds((rows, t), jnp.bool_, spec), response_lengths=sds((rows,), i32, spec))


@dataclasses.dataclass
class Program:
    """A jitted program and its abstract call. roles: one per positional argument, "state"
    (persistent model state), "step" (step data), "local" (the program's own) or "static".
    step_out: bytes of its outputs that become step data; "all": every output."""
    name: str
    fn: Callable
    args: tuple
    roles: tuple[str, ...]
    static: dict
    step_out: int | str = 0


def rollout_programs(shape: StepShape, spec: ShardingSpec, rows: int) -> list[Program]:
    """One rollout call of `rows` rows on the compute-dtype param copy (`compute_copy`): prefill,
    then decode (its state argument is filled in from the prefill's outputs, `decode_state`)."""
    model, state, _, _ = abstract_policy(shape, spec)
    state = place(state, jax.tree.map(lambda x: x.sharding, state), shape.compute_dtype)
    graphdef, rc, n = nnx.graphdef(model), shape.rollout, shape.group_size
    rng = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=spec.sharding((), ()))
    budgets = sds((shape.num_bins,), jnp.int32, spec, (None,))
    # Re-planning exact_sparse: the per-bin gamma table is an input (RolloutConfig.traced_plan).
    table = (budgets,) if rc.replans else ()
    traj = device_bytes(abstract_trajectories(shape, rows, spec))
    prompts = (sds((rows // n, shape.prompt_len), jnp.int32, spec), sds((rows // n,), jnp.int32, spec))
    return [Program("rollout.prefill", static.prefill_program, (graphdef, state, *prompts, rng),
                    ("static", "state", "local", "local", "local"),
                    dict(cfg=rc, group_size=n, spec=spec), traj),
            Program("rollout.decode", exact.decode_program_for(rc)
                    if rc.mode == RolloutMode.EXACT_SPARSE else static.decode_program_for(rc),
                    (graphdef, state, None, budgets) + table,
                    ("static", "state", "local", "local") + ("local",) * len(table),
                    dict(cfg=rc.without_traced_plan, bin_size=shape.bin_size, spec=spec),
                    traj)]


def paged_layout(shape: StepShape, spec: ShardingSpec, rows: int,
                 hbm_bytes: int) -> page_pool.PoolLayout:
    """The page pool the configured paged rollout of `rows` samples gets on this mesh."""
    return page_pool.pool_layout(shape.model, shape.rollout, shape.compute_dtype, rows=rows,
                                 prompt_width=shape.prompt_len, group_size=shape.group_size,
                                 data=spec.mesh.shape["data"],
                                 model=spec.mesh.shape.get("model", 1), memory_limit=hbm_bytes)


def paged_rollout_programs(shape: StepShape, spec: ShardingSpec, rows: int, hbm_bytes: int,
                           pages_per_pool: int | None = None
                           ) -> tuple[list[Program], page_pool.PoolLayout]:
    """The paged engine's programs for one rollout call of `rows` samples (`rollout/paged.py`):
    prefill of new groups (every slot's prompt at once, the worst case), prefill of a resumed
    sample (its prompt + every new token but the last: the widest), and one decode chunk over
    every slot at the widest page table; the page pool is their own (donated) argument.
    pages_per_pool: the pool's pages instead of the configured size (a shallower copy of the
    model compiled for a depth extrapolation keeps the full model's pages: a pool sized in
    bytes would otherwise hold more pages of fewer layers)."""
    model, state, _, _ = abstract_policy(shape, spec)
    state = place(state, jax.tree.map(lambda x: x.sharding, state), shape.compute_dtype)
    graphdef, rc, n, m = nnx.graphdef(model), shape.rollout, shape.group_size, shape.model
    data = spec.mesh.shape["data"]
    layout = paged_layout(shape, spec, rows, hbm_bytes)
    if pages_per_pool is not None:
        layout = dataclasses.replace(layout, pages_per_pool=pages_per_pool)
    kv = jax.eval_shape(lambda: paged.PagedKV(*(tuple(
        jnp.zeros(shp, shape.compute_dtype) for _ in range(m.num_hidden_layers))
        for shp in [(data, m.num_key_value_heads, layout.pages_per_pool, rc.block_size,
                     m.head_dim)] * 2 + [(data, m.num_key_value_heads, layout.pages_per_pool,
                                          m.head_dim)])))
    kv = paged.PagedKV(*(tuple(sds(x.shape, x.dtype, spec, axes) for x in part)
                         for part, axes in ((kv.k, paged.POOL_AXES), (kv.v, paged.POOL_AXES),
                                            (kv.centroids, paged.CENTROID_AXES))))
    rng = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=spec.sharding((), ()))
    budgets = sds((shape.num_bins,), jnp.int32, spec, (None,))
    i32 = jnp.int32
    cfg = dataclasses.replace(rc.without_traced_plan, pool_bytes=0, pool_fraction=0.0,
                              max_slots=0)
    table = (budgets,) if rc.replans else ()     # the gamma table (as the budgets: [bins])

    def prefill(name, per_pool, width, fan, replay):
        r, bs = per_pool * data, rc.block_size
        args = (graphdef, state, kv, sds((r, width), i32, spec), sds((r,), i32, spec),
                sds((r, fan, width // bs), i32, spec), sds((r, fan), i32, spec),
                sds((r, fan), i32, spec), rng, sds((r,), i32, spec), budgets)
        return Program(name, paged.prefill_program, args,
                       ("static", "state", "local") + ("local",) * 8,
                       dict(cfg=cfg, spec=spec, bin_size=shape.bin_size, replay=replay))

    # The scheduler's largest prefills: every slot's group at once (rows per pool on the slot
    # ladder), and one resumed sample per pool of prompt + all but one new token.
    groups_per_pool = continuous_state.row_bucket(max(1, layout.slots_per_pool // n),
                                            layout.slots_per_pool, rc)
    longest = shape.prompt_len + rc.max_new_tokens - 1
    widest = continuous_state.prefill_width(rc, longest, longest)
    s = layout.slots_per_pool * data
    slots = paged.Slots(sds((s,), i32, spec), sds((s,), i32, spec), sds((s,), i32, spec),
                        sds((s,), jnp.bool_, spec), sds((s,), i32, spec),
                        sds((s, layout.max_pages), i32, spec))
    # exact_sparse: the chunk of draft + verify rounds (rollout/paged_exact.py), named so.
    exact_mode = rc.mode == RolloutMode.EXACT_SPARSE
    decode = Program("rollout.paged_decode" + ("[exact_sparse]" if exact_mode else ""),
                     paged_exact.decode_chunk_program_for(cfg) if exact_mode
                     else paged.decode_chunk_program_for(cfg),
                     (graphdef, state, kv, slots, budgets, rng) + table,
                     ("static", "state", "local", "local", "local", "local")
                     + ("local",) * len(table),
                     dict(cfg=cfg, steps=rc.chunk_steps, bin_size=shape.bin_size, spec=spec))
    return [prefill("rollout.paged_prefill", groups_per_pool, shape.prompt_len, n, False),
            prefill("rollout.paged_prefill[resume]", 1, widest, 1, rc.mode == RolloutMode.SPARSE),
            decode], layout


def join_program(shape: StepShape, spec: ShardingSpec) -> Program:
    """The step's sub-batch trajectories joined into one batch (a copy: both alive meanwhile)."""
    calls = shape.rows_step // shape.rows_call
    parts = tuple(abstract_trajectories(shape, shape.rows_call, spec) for _ in range(calls))
    return Program("rollout.join", batching.join_program, (parts,), ("step",),
                   dict(num_processes=shape.hosts, rows=parts[0].tokens.sharding))


def learner_programs(shape: StepShape, spec: ShardingSpec, micro: int) -> list[Program]:
    """What `Learner.step` runs at micro-batch size `micro`: the analysis pass (unless fused into
    the gradient program), the gradient program of one mini-batch, the optimizer update."""
    model, state, params, rest = abstract_policy(shape, spec)
    lc = dataclasses.replace(shape.learner, micro_batch_size=micro)
    # The placed model: the learner reads its mesh off the parameters (sequence-parallel residuals).
    lrn = learner.Learner(nnx.merge(nnx.graphdef(model), state), lc, shape.plan.loss,
                          group_size=shape.group_size, sampling=shape.rollout.sampling)
    traj = abstract_trajectories(shape, shape.rows_step, spec)
    rows, t = shape.rows_step, shape.rollout.max_new_tokens
    budgets = sds((shape.num_bins,), jnp.int32, spec, (None,))
    replay = shape.replay if lc.alpha_mode == AlphaMode.FULL else None
    fused, num_mini = lrn.fused(rows), lrn.num_mini_batches(rows)
    batch = learner.LearnerBatch(traj=traj, advantages=sds((rows,), jnp.float32, spec),
                                 logp_old=None if fused else sds((rows, t), jnp.float32, spec))
    progs = [] if fused else [Program(
        "learner.analyze", learner_programs_mod.analyze_program,
        (nnx.graphdef(model), state, traj, budgets), ("static", "state", "step", "local"),
        dict(replay=replay, opts=lrn.opts, **lrn.micro_batch_layout(traj.tokens, 1)), "all")]
    index = sds((), jnp.int32, spec, ())
    progs.append(Program(
        "learner.grads" + ("[fused analysis]" if fused else ""), learner_programs_mod.grads_program,
        (params, rest, batch, budgets, index), ("state", "state", "step", "local", "local"),
        dict(graphdef=lrn.graphdef, opts=lrn.opts, loss_cfg=lrn.loss_cfg, replay=replay,
             num_mini=num_mini, **lrn.micro_batch_layout(traj.tokens, num_mini)),
        -device_bytes(params) if fused else 0))      # fused: every output but the grads
    opt_state = place(jax.eval_shape(lrn.tx.init, params),
                       learner_programs_mod.opt_state_shardings(lrn.tx, params))
    progs.append(Program("learner.apply", learner_programs_mod.apply_program,
                         (params, opt_state, params), ("state", "state", "local"), dict(tx=lrn.tx)))
    return progs


def decode_state(prefill_lowered, compiled, spec: ShardingSpec, tokens: int = 0):
    """The decode program's input: the prefill's outputs with their compiled shardings (the
    rules' shardings when the prefill did not compile). tokens > 0: record only that many
    tokens over the same cache (the per-step cost probe)."""
    out = prefill_lowered.out_info
    if compiled is not None:
        out = place(out, compiled.output_shardings)
    else:
        out = jax.tree.map(lambda x: sds(x.shape, x.dtype, spec), out)
        c = out.cache
        out.cache = KVCache(*[tuple(sds(x.shape, x.dtype, spec, CACHE_AXES) for x in part)
                              for part in (c.k, c.v, c.centroids)], c.lengths)
    if tokens:
        narrow = {f: getattr(out, f) for f in ("tokens", "logprobs", "topk_logprobs", "topk_ids",
                                               "budgets")}
        out = dataclasses.replace(out, **{f: jax.ShapeDtypeStruct(
            (x.shape[0], tokens) + x.shape[2:], x.dtype, sharding=x.sharding)
            for f, x in narrow.items()})
    return out


def device_bytes(tree) -> int:
    """Bytes per device of abstract arrays (the shard shape of each)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
            total += math.prod(shard) * getattr(x.dtype, "itemsize", 8)
    return total


# -- compiling and measuring -------------------------------------------------------------------------
@contextlib.contextmanager
def kernel_platform(platform: str):
    """pallas_kernels picks a backend from `jax.default_backend()`, "cpu" in a compile-only
    process; "auto" must resolve as on the target (pallas_tpu / pallas_triton), never to the CPU
    reference, so the platform it sees is the target's while a program is traced."""
    saved = dispatch.current_platform
    dispatch.current_platform = lambda: platform
    try:
        yield
    finally:
        dispatch.current_platform = saved


@dataclasses.dataclass
class Measured:
    """Per-device numbers of one compiled program (bytes; None where the compiler gave none)."""
    name: str
    rows_per_device: float
    compile_s: float = 0.0
    compile_cpu_s: float = 0.0         # CPU seconds of this process (all threads): less load-
                                       # dependent than compile_s on a shared machine
    argument: int | None = None
    output: int | None = None
    alias: int | None = None
    temp: int | None = None
    code: int | None = None
    peak: int | None = None
    persistent_args: int = 0
    step_args: int = 0
    local_args: int = 0
    step_out: int = 0
    flops: float | None = None
    bytes_accessed: float | None = None
    largest: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def transient(self) -> int | None:
        """Peak minus what is counted elsewhere: the persistent / step-data arguments (jit drops
        unused arguments from the executable, but those buffers stay alive, so the compiled
        arguments are replaced by the program's own) and outputs that become step data."""
        if self.peak is None:
            return None
        if self.argument is None:      # a TPU compile that did not fit: only its total
            return self.peak - self.persistent_args - self.step_args - self.step_out
        return self.peak - self.argument + self.local_args - self.step_out


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# libtpu: "... memory required for HLO temporaries (24.00G) exceeds available HBM (15.75G)" or
# "Used 151.2G of 95.7G hbm": the first figure is what the program needs.
_OOM_NEED = re.compile(r"(?:required[^(]*\(|Used )([\d.]+)([KMGT])")
_HLO_VALUE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = ([a-z]+\d*)\[([\d,]*)\]\S* ([\w\-]+)\(", re.M)
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4,
             "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _largest(prog: Program, hlo: str, n: int = 3) -> list[str]:
    """The program's largest arguments, then its largest values in the optimised HLO (shapes
    there are per device; those values need not be alive together)."""
    named = [(device_bytes(leaf), f"arg {jax.tree_util.keystr(path)}")
             for arg, role in zip(prog.args, prog.roles) if role != "static"
             for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]]
    values: dict[str, int] = {}
    for dtype, dims, op in _HLO_VALUE.findall(hlo):
        if op not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            size = math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
            values[f"{op} {dtype}[{dims}]"] = size
    top = sorted(named, reverse=True)[:n] + sorted(((v, k) for k, v in values.items()),
                                                    reverse=True)[:n]
    return [f"{name} {gib(b)} GiB" for b, name in top]


def compiled_cost(compiled) -> tuple[float | None, float | None]:
    """(FLOPs, bytes accessed) per device. The CUDA plugin's compile-only executables have no
    cost analysis; XLA's HloCostAnalysis of their optimised (per-device) module is the same
    figure, so it runs on the host backend's client instead."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if not cost:
        try:
            from jax._src.lib import xla_client
            module = compiled.runtime_executable().hlo_modules()[0]
            cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        except Exception as e:  # noqa: BLE001 - private API: no cost figure rather than no report
            log.warning("no cost analysis for this target: %s", e)
            cost = {}
    return cost.get("flops"), cost.get("bytes accessed")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def compile_program(prog: Program, platform: str, rows_per_device: float):
    """Lowers and compiles `prog` for the target; returns (Measured, lowered, compiled or None)."""
    t0, c0 = time.perf_counter(), _cpu_s()
    with kernel_platform(platform):
        lowered = prog.fn.lower(*prog.args, **prog.static)
    m = Measured(prog.name, rows_per_device)
    for arg, role in zip(prog.args, prog.roles):
        m.persistent_args += device_bytes(arg) if role == "state" else 0
        m.step_args += device_bytes(arg) if role == "step" else 0
        m.local_args += device_bytes(arg) if role == "local" else 0
    compiled, hlo = None, ""
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a compile failure is a finding, not a crash
        text = str(e).strip() or type(e).__name__
        m.error = text.splitlines()[0][:400]
        need = _OOM_NEED.search(text)
        if need:          # the TPU compiler's own figure for a program that does not fit
            m.peak = int(float(need.group(1)) * _UNITS[need.group(2)])
    if compiled is not None:
        mem = compiled.memory_analysis()
        m.argument, m.output = mem.argument_size_in_bytes, mem.output_size_in_bytes
        m.alias, m.temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
        m.code = mem.generated_code_size_in_bytes
        m.peak = m.argument + m.output - m.alias + m.temp + m.code
        hlo = compiled.as_text()
    if compiled is not None:
        m.flops, m.bytes_accessed = compiled_cost(compiled)
    out = prog.step_out
    m.step_out = (m.output or 0) + (0 if out == "all" else out) if out == "all" or out < 0 else out
    m.largest = _largest(prog, hlo)
    m.compile_s, m.compile_cpu_s = time.perf_counter() - t0, _cpu_s() - c0
    log.info("%s: %.1fs (%.1f CPU-s), peak %s GiB/device%s", prog.name, m.compile_s,
             m.compile_cpu_s, gib(m.peak),
             f" ({m.error})" if m.error else "")
    return m, lowered, compiled
