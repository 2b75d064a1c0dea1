"""The paged engine's programs of a rollout, listed ahead of it and compiled up front.

A rollout picks its decode programs as it goes: one per (running-slot bucket, page-table bucket)
its samples pass through, which depends on when they finish. `programs` lists every program a
rollout of the given shape can take (its first prefill and the whole decode grid at its prompt
width: slot buckets x page-table buckets) by the scheduler's own bucket functions and pool
layout, each with the key that selects a compiled program (static config, pool, shapes);
`warm` compiles a list of them ahead of time (`jit(...).lower(...).compile()`: the executable
the rollout's own call then finds in jax's cache) with one progress line per program. The
compile plan (`train/compile_plan.py`) counts these same lists, so what `sparrow train`
compiles before step 1 is what its plan says (tests/test_compile_cache.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rollout import paged, paged_exact
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.page_pool import PoolLayout, pool_layout
from sparrow_jax.rollout.continuous_state import (distinct, page_bucket, prefill_config,
                                                program_config, row_bucket, slot_bucket)
from sparrow_jax.runtime.shapes import COMPILES
from sparrow_jax.runtime.sharding import ShardingSpec

log = logging.getLogger(__name__)

__all__ = ["Program", "programs", "distinct_programs", "warm"]


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program a rollout can take. `name`: the compile plan's (and COMPILES')
    program name; `function`: the jitted function (its compile events read `jit(function)`);
    `key`: what selects the compiled program - equal keys are one program; `shapes`: the
    dimensions, as COMPILES logs them."""
    name: str
    function: str
    key: tuple
    shapes: tuple[tuple[str, object], ...]
    cfg: RolloutConfig
    pools: int

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.shapes)


def programs(cfg: RolloutConfig, layout: PoolLayout, *, rows: int, prompt_width: int,
             group_size: int, dtype, name: str = "rollout") -> list[Program]:
    """The programs of one paged rollout of `rows` samples (groups of `group_size`) at
    `prompt_width` in the pool `layout`: the prefill that admits its first groups (all of
    them where slots and pages allow, as the scheduler does), and the decode grid - every
    running-slot bucket up to the live samples per pool times every page-table bucket up to a
    sample's full length. Refills (fewer slots than samples) and resumes (a fixed pool that
    runs out) take prefill shapes of their own, not listed here."""
    dt = jnp.dtype(dtype).name
    pools, per_pool = layout.pools, layout.slots_per_pool
    groups = -(-rows // group_size)
    groups_per_pool = min(-(-groups // pools), per_pool // group_size)
    live = min(per_pool, groups_per_pool * group_size)
    pre_rows = row_bucket(groups_per_pool, per_pool, cfg) * pools
    pre_cfg, dec_cfg = prefill_config(cfg), program_config(cfg)
    shapes = (("dtype", dt), ("group_size", group_size), ("pages", layout.pages_per_pool),
              ("replay", False), ("rows", pre_rows), ("width", prompt_width))
    out = [Program(f"{name}/paged_prefill", "prefill_program",
                   ("prefill", pre_cfg, pools, shapes), shapes, pre_cfg, pools)]
    for s in distinct(lambda n: slot_bucket(n, per_pool, cfg), 1, live):
        for p in distinct(lambda n: page_bucket(n, layout.max_pages, cfg), 1, layout.max_pages):
            shapes = (("dtype", dt), ("mode", dec_cfg.mode), ("pages", layout.pages_per_pool),
                      ("pages_per_slot", p), ("slots", s * pools), ("steps", cfg.chunk_steps))
            out.append(Program(f"{name}/paged_decode", "decode_chunk_program",
                               ("decode", dec_cfg, pools, shapes), shapes, dec_cfg, pools))
    return out


def distinct_programs(*lists: Sequence[Program]) -> list[Program]:
    """The programs of several rollouts, each once (the first list's name wins: a program the
    training rollout shares with the evaluation is the training rollout's)."""
    seen, out = set(), []
    for ps in lists:
        for p in ps:
            if p.key not in seen:
                seen.add(p.key)
                out.append(p)
    return out


def layout_for(model, cfg: RolloutConfig, *, rows: int, prompt_width: int, group_size: int,
               spec: ShardingSpec | None) -> PoolLayout:
    """The pool the scheduler builds for this rollout (`continuous.PagedRollout.__init__`)."""
    data = heads = 1
    if spec is not None:
        data_axis, heads_axis = paged.mesh_axes(spec, model.config.num_key_value_heads)
        data = spec.mesh.shape[data_axis] if data_axis else 1
        heads = spec.mesh.shape[heads_axis] if heads_axis else 1
    return pool_layout(model.config, cfg, model.dtype, rows=rows, prompt_width=prompt_width,
                       group_size=group_size, data=data, model=heads)


def _rows(x: np.ndarray, spec: ShardingSpec | None) -> jax.Array:
    """As the scheduler places its host rows (`continuous.PagedRollout`): the same shardings."""
    if spec is None:
        return jnp.asarray(x)
    from sparrow_jax.runtime import multihost
    return multihost.host_to_global(x, spec.sharding(("batch",) + (None,) * (x.ndim - 1),
                                                     x.shape))


def _abstract_kv(model, p: Program, spec: ShardingSpec | None) -> paged.PagedKV:
    mcfg, pages = model.config, dict(p.shapes)["pages"]
    kv_shape = (p.pools, mcfg.num_key_value_heads, pages, p.cfg.block_size, mcfg.head_dim)
    c_shape = kv_shape[:3] + kv_shape[4:]

    def sds(shape, axes):
        # As `paged.init_pages` makes them: unplaced without a mesh (a placed abstract array
        # lowers to another program than the rollout's call, which then compiles its own).
        sharding = None if spec is None else spec.sharding(axes, shape)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(model.dtype), sharding=sharding)

    layers = range(mcfg.num_hidden_layers)
    return paged.PagedKV(tuple(sds(kv_shape, paged.POOL_AXES) for _ in layers),
                         tuple(sds(kv_shape, paged.POOL_AXES) for _ in layers),
                         tuple(sds(c_shape, paged.CENTROID_AXES) for _ in layers))


def _lower(model, p: Program, *, spec, budgets, bin_size: int, rng):
    from flax import nnx
    graphdef, params = nnx.split(model)
    kv, sh, i32 = _abstract_kv(model, p, spec), dict(p.shapes), np.int32
    if p.function == "prefill_program":
        r, w, n = sh["rows"], sh["width"], sh["group_size"]
        host = [np.zeros((r, w), i32), np.ones((r,), i32),
                np.zeros((r, n, w // p.cfg.block_size), i32), np.zeros((r, n), i32),
                np.zeros((r, n), i32), np.ones((r,), i32)]
        args = [_rows(x, spec) for x in host]
        return paged.prefill_program.lower(
            graphdef, params, kv, *args[:5], rng, args[5], jnp.asarray(budgets, jnp.int32),
            cfg=p.cfg, spec=spec, bin_size=bin_size, replay=False)
    s, width = sh["slots"], sh["pages_per_slot"]
    slots = paged.Slots(*(_rows(np.zeros(s, t), spec) for t in (i32, i32, i32, bool, i32)),
                        _rows(np.zeros((s, width), i32), spec))
    # exact_sparse: the chunk of draft + verify rounds the scheduler dispatches in that mode.
    chunk = (paged_exact.decode_chunk_program_for(p.cfg) if p.cfg.mode == RolloutMode.EXACT_SPARSE
             else paged.decode_chunk_program_for(p.cfg))
    cfg, table = p.cfg.traced_plan(len(budgets))    # re-planning: the gamma table an input
    return chunk.lower(
        graphdef, params, kv, slots, jnp.asarray(np.asarray(budgets, np.int32)), rng,
        *(() if table is None else (jnp.asarray(table),)), cfg=cfg, steps=sh["steps"],
        bin_size=bin_size, spec=spec)


def warm(model, progs: Sequence[Program], *, spec: ShardingSpec | None, budgets,
         bin_size: int, rng: jax.Array | None = None) -> float:
    """Compiles `progs` for `model` (the rollout's model: its dtype and shardings) ahead of the
    rollouts that use them, logging "warm-up i/n: name (shapes): s" per program; the rollouts'
    own calls then compile nothing (a program already in jax's cache, or the persistent
    cache's, is only looked up). `budgets`, `bin_size`, `rng`: as the rollouts get them (the
    budget table's length and the bin size select programs). Returns the seconds."""
    rng = jax.random.key(0) if rng is None else rng
    start = time.perf_counter()
    for i, p in enumerate(progs, 1):
        t0 = time.perf_counter()
        _lower(model, p, spec=spec, budgets=budgets, bin_size=bin_size, rng=rng).compile()
        COMPILES.note(p.name.replace("eval/", "rollout/"), **dict(p.shapes))
        log.info("warm-up %d/%d: %s (%s): %.1f s", i, len(progs), p.name, p.describe(),
                 time.perf_counter() - t0)
    total = time.perf_counter() - start
    log.info("warm-up: %d programs compiled in %.1f s", len(progs), total)
    return total
