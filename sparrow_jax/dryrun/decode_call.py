"""The configured rollout's decode program at a chosen depth, for the compile-only reports of
what one decode step lowers to (`dryrun.hlo`, `dryrun.kernel_census`)."""

from __future__ import annotations

import dataclasses

from sparrow_jax.dryrun.programs import (Program, StepShape, decode_state, kernel_platform,
                                         paged_layout, paged_rollout_programs, rollout_programs)
from sparrow_jax.dryrun.targets import Target
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.rollout.config import Engine


@dataclasses.dataclass
class DecodeCall:
    """The configured rollout's decode program (the paged engine's decode chunk, or the static
    engine's decode loop) and what one call of it covers, per device."""
    program: Program
    rows: int                # rows (slots) per device
    blocks_per_row: int      # KV blocks one row can hold (its page table / cache width)
    pool_layer_bytes: int    # one layer's K (or V) page pool per device; 0 on the static engine


def decode_call(shape: StepShape, spec: ShardingSpec, target: Target, layers: int = 0
                ) -> DecodeCall:
    """The decode program of one rollout call of `shape.rows_call` rows; layers > 0: of the
    model cut to that many layers (real head and width shapes), whose paged pool keeps the
    full model's pages (every depth then compiles the same pool and page table shapes)."""
    rc, per_dev = shape.rollout, shape.rows_call / spec.mesh.shape["data"]
    full_pages = None
    if layers:
        if rc.engine == Engine.PAGED:
            full_pages = paged_layout(shape, spec, shape.rows_call, target.hbm_bytes).pages_per_pool
        shape = dataclasses.replace(shape, model=dataclasses.replace(
            shape.model, num_hidden_layers=layers))
    if rc.engine == Engine.PAGED:
        progs, layout = paged_rollout_programs(shape, spec, shape.rows_call, target.hbm_bytes,
                                               full_pages)
        pool_layer = layout.bytes_per_device // (2 * shape.model.num_hidden_layers)
        return DecodeCall(progs[-1], layout.slots_per_pool, layout.max_pages, pool_layer)
    prefill, decode = rollout_programs(shape, spec, shape.rows_call)
    with kernel_platform(target.kernel_platform):
        lowered = prefill.fn.lower(*prefill.args, **prefill.static)
    decode.args = (*decode.args[:2], decode_state(lowered, None, spec), decode.args[3])
    return DecodeCall(decode, int(per_dev), rc.cache_slots(shape.prompt_len) // rc.block_size, 0)
