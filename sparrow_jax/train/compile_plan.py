"""What a `sparrow train` run will compile, logged before its first rollout.

XLA compiles one program per distinct input shape, minutes each at full depth, and a run's
first step compiles its rollout and learner programs before anything else is logged. The plan
says which programs, how many at the start and at most how many in all, so that a user knows why
step 1 takes minutes (each compile's seconds are logged as it happens:
`sparrow_jax.runtime.compile_cache`; each new shape by `sparrow_jax.runtime.shapes.COMPILES`,
under the same program names as here; "eval/..." are the rollout and teacher-forced programs at
the held-out batch's shapes). Each entry also names the jitted function whose compile events
(`jit(function)`, `compile_cache.count_compiles`) it counts.

With `TrainConfig.warmup` (paged engine) the rollout's and the evaluation's programs before step
1 are the lists `rollout.warmup.programs` gives - every decode program of the first rollout's
grid, compiled up front - so the count before step 1 is exact: a tiny run's compiles equal it
(tests/test_compile_cache.py). Without it, the first rollout compiles the decode programs its
samples pass through, about one per slot bucket plus one per page bucket.

The shapes come from the functions the engines themselves call: prompt widths from
`RolloutConfig.prompt_width`, the learner's response lengths from `bucket_length` over its
length buckets (`rollout.batching.trim_to_bucket`), the paged engine's row, prefill-width and
page-table buckets from `rollout.continuous` and its pool layout from `rollout.page_pool`.
Prompt widths range over what the run can take (up to the longest prompt it keeps); a data set
of short prompts touches only the first few.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

from sparrow_jax.rollout.config import Engine, RolloutConfig, RolloutMode
from sparrow_jax.rollout.page_pool import pages_for
from sparrow_jax.rollout.continuous_state import (distinct, page_bucket, prefill_width, row_bucket,
                                                slot_bucket)
from sparrow_jax.runtime.shapes import bucket_length, default_buckets

if TYPE_CHECKING:
    from sparrow_jax.train.plan import RunPlan

log = logging.getLogger(__name__)

__all__ = ["Planned", "CompilePlan", "RunShape", "distinct", "prompt_widths", "response_lengths",
           "plan", "for_run", "for_trainer", "trainer_shape", "warm_for_run", "log_plan",
           "from_gin", "FUNCTIONS"]

# The jitted function each plan name counts (its compile events read "jit(<function>)").
FUNCTIONS = {"rollout/prefill": "prefill_program", "rollout/decode": "decode_program",
             "rollout/paged_prefill": "prefill_program",
             "rollout/paged_decode": "decode_chunk_program", "rollout/join": "join_program",
             "learner/analyze": "analyze_program", "learner/grads": "grads_program",
             "learner/apply": "apply_program", "distill/update": "distill_program",
             "eval/paged_prefill": "prefill_program", "eval/paged_decode": "decode_chunk_program"}


@dataclasses.dataclass(frozen=True)
class Planned:
    """Programs of one name (as `COMPILES` logs them): `first` of them compile before step 1
    ends (an upper bound where the shapes depend on the data), `most` in the whole run."""
    name: str
    per: str          # what selects a new program of this name
    first: int
    most: int

    @property
    def function(self) -> str:
        return FUNCTIONS.get(self.name, "")


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    programs: tuple[Planned, ...]

    @property
    def first(self) -> int:
        return sum(p.first for p in self.programs)

    @property
    def most(self) -> int:
        return sum(p.most for p in self.programs)

    def names(self) -> set[str]:
        return {p.name for p in self.programs}

    def first_by_function(self) -> dict[str, int]:
        """Programs before step 1 per jitted function (what `count_compiles` sees)."""
        out: dict[str, int] = {}
        for p in self.programs:
            if p.first and p.function:
                out[p.function] = out.get(p.function, 0) + p.first
        return out

    def lines(self) -> list[str]:
        head = (f"compile plan: about {self.first} programs before step 1 ends, at most "
                f"{self.most} in the run (a batch that reaches a new prompt-width or response-"
                "length bucket compiles its own; each compile's seconds are logged, and the "
                "compilation cache keeps them for a restart):")
        return [head] + [f"  {p.name}: {p.first} at the start, at most {p.most} ({p.per})"
                         for p in self.programs]


def prompt_widths(rc: RolloutConfig, longest_prompt: int) -> tuple[int, ...]:
    """The static prompt widths the rollout can be called with (`RolloutConfig.prompt_width`)."""
    return distinct(rc.prompt_width, 1, longest_prompt)


def response_lengths(buckets: Sequence[int], max_new_tokens: int, multiple: int
                     ) -> tuple[int, ...]:
    """The response widths the learner can see (`trim_to_bucket`: a bucket, at most the
    generated width)."""
    return tuple(sorted({min(b, max_new_tokens) for b in distinct(
        lambda n: bucket_length(n, buckets, multiple=multiple), 1, max_new_tokens)}))


def _span(values: Sequence[int]) -> str:
    return (f"{len(values)}: {values[0]}..{values[-1]}" if len(values) > 1
            else f"1: {values[0]}")


def _paged(rc: RolloutConfig, widths: Sequence[int], rows: int, group_size: int, data: int,
           prompts: int = 0, pool_pages: int | None = None) -> tuple[Planned, Planned]:
    """The paged engine's prefill and decode programs (`rollout.continuous`) for rollouts of
    `rows` samples at the prompt `widths`. Decode: one program per (running-slot bucket,
    page-table bucket); a rollout's slots only shrink while its rows grow, so one rollout
    touches about slots + pages - 1 of them. Prefill: one per prompt width and group-row
    bucket, and one per resume width (a preempted sample's prompt + generated tokens, one per
    pool and call). With the default pool size (every row at full length) the pool's page count
    follows the prompt width, so each width has its own programs; a fixed `pool_bytes` /
    `pool_fraction` pool shares them. A pool that holds every running sample at full length
    (the default; a fixed one of `pool_pages` that large) never preempts: no resumes."""
    slots = (rc.max_slots or rows) // max(data, 1)
    live = slots                                 # samples running at once per pool, at most
    groups = max(1, slots // group_size)         # groups admitted at once per pool, at most
    if prompts:
        groups = min(groups, -(-prompts // max(data, 1)))
        live = min(slots, groups * group_size)
    slot_buckets = len(distinct(lambda n: slot_bucket(n, slots, rc), 1, live))
    group_rows = len(distinct(lambda n: row_bucket(n, slots, rc), 1, groups))

    def page_buckets(width: int) -> set[int]:
        cap = pages_for(width + rc.max_new_tokens - 1, rc.block_size)
        return set(distinct(lambda n: page_bucket(n, cap, rc), 1, cap))

    fixed_pool = bool(rc.pool_bytes or rc.pool_fraction)
    full = pages_for(widths[-1] + rc.max_new_tokens - 1, rc.block_size) * live
    preempts = fixed_pool and (pool_pages is None or pool_pages < full)

    def resumes(lo: int, hi: int) -> int:
        if not preempts:
            return 0
        top = hi + rc.max_new_tokens - 1
        return len(distinct(lambda n: prefill_width(rc, n, top), lo, top))

    first_pages = len(page_buckets(widths[0]))
    if fixed_pool:       # one pool for every width: the table widths of all widths (the top
        # bucket is each width's own page cap)
        decode = slot_buckets * len(set().union(*map(page_buckets, widths)))
        prefill = group_rows * len(widths) + resumes(widths[0], widths[-1])
    else:
        decode = sum(slot_buckets * len(page_buckets(w)) for w in widths)
        prefill = sum(group_rows + resumes(w, w) for w in widths)
    pool = "a fixed pool" if fixed_pool else "the default pool: programs per prompt width"
    # Every group has a slot from the start (no slot cap below the rows): the first rollout
    # admits them in one prefill (pages permitting); else refills take smaller row buckets.
    first_prefill = 1 if slots * max(data, 1) >= rows else group_rows
    return (Planned("rollout/paged_prefill", f"paged engine, {rc.mode}; group-row buckets "
                    f"{group_rows} x prompt widths ({_span(widths)})"
                    + (", and resume widths after a preemption" if preempts else "")
                    + f"; {pool}", first_prefill, prefill),
            Planned("rollout/paged_decode", f"running-slot buckets {slot_buckets} x page-table "
                    f"buckets {first_pages} at the first width; ~{slot_buckets + first_pages - 1}"
                    " per rollout", slot_buckets + first_pages - 1, decode))


def plan(rc: RolloutConfig, *, group_size: int, prompts_per_call: int, calls_per_step: int,
         longest_prompt: int, length_buckets: Sequence[int], fused: bool, probe: bool = False,
         distill: bool = False, eval_width: int | None = None,
         eval_rows: int = 0, eval_modes: Sequence[str] = (), reference: bool = False,
         data_shards: int = 1, micro_rows: int = 0, pool_pages: int | None = None,
         eval_temperature: float | None = None, warm: Sequence = (),
         eval_at_start: bool = True) -> CompilePlan:
    """The plan of a run (see the module docstring). `prompts_per_call`: prompts of one rollout
    program call over all processes; `fused`: the learner's analysis runs inside its gradient
    program (`Learner.fused`); `probe`: the controller's teacher-forced replay may run the
    analysis program; `eval_width`, `eval_rows`: the held-out batch's prompt width (None: no
    evaluation) and rows over all processes (paged: run in the training rollout's slots);
    `pool_pages`: pages per pool of a fixed paged pool (None: unknown, preemption assumed);
    `eval_temperature`: the evaluation's (None: the rollout's; another one compiles its own);
    `warm`: the `rollout.warmup.Program`s compiled up front (`TrainConfig.warmup`): the paged
    rollout's and evaluation's programs before step 1 are exactly these; `eval_at_start`:
    False when the first evaluation comes after step 1 (its programs then count in `most`)."""
    widths = prompt_widths(rc, longest_prompt)
    responses = response_lengths(length_buckets, rc.max_new_tokens, rc.block_size)
    rows = prompts_per_call * group_size
    w, r = len(widths), len(responses)
    engine = f"{rc.engine} engine, {rc.mode}"
    out = []
    if rc.engine == Engine.PAGED:
        out += _paged(rc, widths, rows, group_size, data_shards, pool_pages=pool_pages)
    else:
        per = f"{engine}; {rows} rows; per prompt width ({_span(widths)})"
        out += [Planned("rollout/prefill", per, 1, w), Planned("rollout/decode", per, 1, w)]
    if calls_per_step > 1:
        out.append(Planned("rollout/join", f"{calls_per_step} calls per step; per prompt width",
                           1, w))
    micro = f"micro-batches of {micro_rows} rows; " if micro_rows else ""
    per = (f"{calls_per_step * rows} rows, {micro}per prompt width x response length "
           f"({_span(responses)})")
    if not fused or probe:
        why = "" if not fused else "controller probe; "
        out.append(Planned("learner/analyze", why + per, 0 if fused else 1, w * r))
    out.append(Planned("learner/grads", ("analysis fused in; " if fused else "") + per, 1, w * r))
    out.append(Planned("learner/apply", "the optimizer update", 1, 1))
    if distill:
        out.append(Planned("distill/update", per, 1, w * r))
    if warm:
        out = [_warmed(p, warm) for p in out]
    if eval_width is not None and eval_modes:
        n = len(eval_modes)
        if warm and eval_at_start:
            for name in ("eval/paged_prefill", "eval/paged_decode"):
                k = sum(w.name == name for w in warm)
                if k:
                    out.append(Planned(name, "the evaluation's own (warmed up), at prompt width "
                                       f"{eval_width}", k, k))
        elif rc.engine == Engine.PAGED:
            # In the training rollout's slots (Trainer.train_slots): the training mode's decode
            # programs are shared; prefill (one sample per prompt) is its own.
            first = most = 0
            for mode in eval_modes:
                p, d = _paged(dataclasses.replace(rc, mode=mode), (eval_width,), rows, 1,
                              data_shards, prompts=eval_rows or rows, pool_pages=pool_pages)
                # Dense decoding of a sparse run runs in its sparse programs (dense_via_sparse).
                shared = (mode in (rc.mode, RolloutMode.DENSE if rc.mode == RolloutMode.SPARSE
                                   else rc.mode)
                          and eval_width in widths
                          and eval_temperature in (None, rc.temperature))
                # One prefill program for every mode (continuous_state.prefill_config).
                once = mode == eval_modes[0]
                first += (p.first if once else 0) + (0 if shared else d.first)
                most += (p.most if once else 0) + (0 if shared else d.most)
            out.append(Planned("eval/rollout", f"{'/'.join(eval_modes)} at prompt width "
                               f"{eval_width}, paged in the training slots (its "
                               f"{rc.mode} decode shared), about", first, most))
        else:
            out.append(Planned("eval/rollout", f"prefill + decode per mode "
                               f"({'/'.join(eval_modes)}) at prompt width {eval_width}",
                               2 * n, 2 * n))
    if reference and eval_modes:    # with or without held-out prompts to decode
        out.append(Planned("eval/reference", "teacher-forced, dense and sparse", 2, 2))
    if (reference or eval_width is not None) and eval_modes and not eval_at_start:
        # no step-0 evaluation: its programs come later
        out = [dataclasses.replace(p, first=0, per=p.per + "; first evaluation after step 1")
               if p.name.startswith("eval/") else p for p in out]
    return CompilePlan(tuple(out))


def _warmed(p: Planned, warm: Sequence) -> Planned:
    k = sum(w.name == p.name for w in warm)
    if not p.name.startswith("rollout/paged_"):
        return p
    return dataclasses.replace(p, per=p.per + f"; {k} warmed up before step 1", first=k,
                               most=max(p.most, k))


def warm_list(rc: RolloutConfig, mcfg, dtype, *, rows: int, group_size: int, data: int = 1,
              model_shards: int = 1, eval_rows: int = 0, eval_width: int | None = None,
              eval_modes: Sequence[str] = (), eval_temperature: float | None = None,
              eval_samples: int = 1, train_slots: int = 0) -> list:
    """The paged programs `TrainConfig.warmup` compiles before step 1 (`rollout.warmup`): the
    training rollout's (`rows` samples over all processes, groups of `group_size`) at the
    smallest prompt width - a first batch of longer prompts compiles its own - then the
    evaluation's that differ from them (its modes, temperature; in the training slots,
    `train_slots`). `mcfg`, `dtype`: the model's config and compute dtype (the pool)."""
    from sparrow_jax.rollout import warmup
    from sparrow_jax.rollout.page_pool import pool_layout

    if rc.engine != Engine.PAGED:
        return []

    def listed(rc_, rows_, width, n, name):
        layout = pool_layout(mcfg, rc_, dtype, rows=rows_, prompt_width=width, group_size=n,
                             data=data, model=model_shards)
        return warmup.programs(rc_, layout, rows=rows_, prompt_width=width, group_size=n,
                               dtype=dtype, name=name)

    lists = [listed(rc, rows, rc.prompt_width(1), group_size, "rollout")]
    if eval_width is not None:
        temp = rc.temperature if eval_temperature is None else eval_temperature
        for mode in eval_modes:
            erc = dataclasses.replace(rc, mode=mode, temperature=temp,
                                      max_slots=train_slots or rc.max_slots,
                                      dense_via_sparse=rc.mode == RolloutMode.SPARSE)   # as Trainer
            lists.append(listed(erc, eval_rows * eval_samples, eval_width, eval_samples,
                                "eval"))
    return warmup.distinct_programs(*lists)


@dataclasses.dataclass(frozen=True)
class RunShape:
    """Where a run's programs run, besides its plan: what selects their shapes.

    processes: JAX processes; data_shards / model_shards: the mesh's data axis and the KV heads'
    split over the model axis (1 when the heads do not divide it); dtype: the rollout's compute
    dtype (sizes the page pool); eval_rows / eval_width: the held-out batch's rows over all
    processes and its prompt width bucket (None: no evaluation, or not before step 1);
    started: False for a fresh run (step 0), whose first evaluation comes before step 1."""
    processes: int = 1
    data_shards: int = 1
    model_shards: int = 1
    dtype: Any = None
    eval_rows: int = 0
    eval_width: int | None = None
    started: bool = False


def warm_for_run(run: RunPlan, mcfg, shape: RunShape, rollout: RolloutConfig | None = None
                 ) -> list:
    """`warm_list` of a run: the paged programs `TrainConfig.warmup` compiles before step 1
    (empty without it)."""
    cfg, rc = run.train, rollout or run.rollout
    if not cfg.warmup:
        return []
    rows = (cfg.rollout_batch_prompts or cfg.prompts_per_step) * shape.processes * cfg.group_size
    return warm_list(rc, mcfg, shape.dtype, rows=rows, group_size=cfg.group_size,
                     data=shape.data_shards, model_shards=shape.model_shards,
                     eval_rows=shape.eval_rows,
                     eval_width=shape.eval_width if cfg.eval_at_start and not shape.started
                     else None, eval_modes=run.eval_modes,
                     eval_temperature=cfg.eval_temperature, eval_samples=cfg.eval_samples,
                     train_slots=rc.max_slots or rows)


def for_run(run: RunPlan, mcfg, shape: RunShape, rollout: RolloutConfig | None = None,
            warm: Sequence | None = None) -> CompilePlan:
    """The compile plan of run plan `run` for a model of config `mcfg` (a `Qwen3Config`)
    placed as `shape` says: what `sparrow train` logs at start-up, and what tests and docs
    count for configs shipped for hardware this machine lacks. `rollout`: the run's rollout
    config when it differs from the plan's in the tokenizer's ids only (the trainer's);
    `warm`: `warm_for_run`'s list where the caller has it."""
    from sparrow_jax.rollout.page_pool import page_bytes
    from sparrow_jax.runtime import faults
    from sparrow_jax.train.config import gin_value

    cfg, rc = run.train, rollout or run.rollout
    per_call = (cfg.rollout_batch_prompts or cfg.prompts_per_step) * shape.processes
    step_rows = cfg.prompts_per_step * cfg.group_size * shape.processes
    eval_at_start = cfg.eval_at_start and not shape.started
    pool = None
    if rc.pool_bytes:                    # pages per pool of a fixed pool (rollout.page_pool)
        per_device = page_bytes(mcfg, shape.dtype, rc.block_size) // shape.model_shards
        pool = rc.pool_bytes // per_device
    if warm is None:
        warm = warm_for_run(run, mcfg, shape, rollout)
    return plan(rc, group_size=cfg.group_size, prompts_per_call=per_call,
                calls_per_step=cfg.prompts_per_step // (cfg.rollout_batch_prompts
                                                        or cfg.prompts_per_step),
                longest_prompt=faults.prompt_capacity(
                    mcfg.max_position_embeddings, rc.max_new_tokens,
                    gin_value("make_prompt_iterator.max_prompt_len")),
                length_buckets=run.length_buckets, fused=run.fused(step_rows),
                probe=run.probes, distill=run.distills, eval_width=shape.eval_width,
                eval_rows=shape.eval_rows, eval_modes=run.eval_modes,
                reference=bool(run.reference.data), data_shards=shape.data_shards,
                micro_rows=run.learner.micro_batch_size, pool_pages=pool,
                eval_temperature=cfg.eval_temperature, warm=warm, eval_at_start=eval_at_start)


def trainer_shape(trainer) -> RunShape:
    """The `RunShape` of a built `sparrow_jax.train.trainer.Trainer`."""
    import jax

    from sparrow_jax.rollout import paged

    spec, mcfg = trainer.spec, trainer.model.config
    data = heads = 1
    if spec is not None:
        data_axis, heads_axis = paged.mesh_axes(spec, mcfg.num_key_value_heads)
        data = spec.mesh.shape[data_axis] if data_axis else 1
        heads = spec.mesh.shape[heads_axis] if heads_axis else 1
    batch = trainer.eval_batch
    rows, width = (0, None) if batch is None else batch.prompt_ids.shape
    return RunShape(processes=jax.process_count(), data_shards=data, model_shards=heads,
                    dtype=trainer.rollout_model().dtype, eval_rows=rows * jax.process_count(),
                    eval_width=None if width is None else trainer.rollout_cfg.prompt_width(
                        int(width)),
                    started=trainer.step > 0)


def for_trainer(trainer, warm: Sequence | None = None) -> CompilePlan:
    """The plan of a built `Trainer`: its run plan at its devices and held-out batch."""
    return for_run(trainer.plan, trainer.model.config, trainer_shape(trainer),
                   rollout=trainer.rollout_cfg, warm=warm)


def log_plan(p: CompilePlan) -> None:
    for line in p.lines():
        log.info("%s", line)


def from_gin(mcfg, *, data_shards: int, processes: int = 1, model_shards: int = 1,
             eval_prompt_len: int = 256) -> CompilePlan:
    """The plan of the parsed gin config (`train.plan.from_gin`) for a model of shape `mcfg`
    (e.g. `qwen3_preset`) without weights or data, as `for_trainer` would give it on a mesh of
    `data_shards` x `model_shards`. `eval_prompt_len`: the held-out prompts' longest (its
    width bucket selects the evaluation's programs)."""
    import jax.numpy as jnp

    from sparrow_jax.train import plan as run_plan

    run = run_plan.from_gin()
    cfg, rc = run.train, run.rollout
    evaluated = bool(cfg.eval_data) and cfg.eval_prompts > 0
    unit = math.lcm(data_shards, processes)
    split = model_shards if mcfg.num_key_value_heads % model_shards == 0 else 1
    dtype = jnp.dtype("bfloat16" if cfg.dtype == "auto" else cfg.dtype)   # "auto": accelerator
    return for_run(run, mcfg, RunShape(
        processes=processes, data_shards=data_shards, model_shards=split, dtype=dtype,
        eval_rows=-(-cfg.eval_prompts // unit) * unit,
        eval_width=rc.prompt_width(eval_prompt_len) if evaluated else None))
