"""Per decode step and device: the bytes XLA's cost analysis counts for block selection (scores +
selection of one sparse layer, compiled alone for the target, x sparse layers) against the bytes
the attention reads of K and V at the full selection width (issue 30: selection must stay a
small part of what sparsity saves). Read by `sparrow dryrun` (its decode line) and
`sparrow_jax.dryrun.hlo`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparrow_jax.dryrun.programs import StepShape, compiled_cost, kernel_platform
from sparrow_jax.dryrun.targets import Target, target_devices
from sparrow_jax.rollout.page_pool import PoolLayout
from sparrow_jax.runtime.sharding import ShardingSpec


def selection_bytes(target: Target, rows: int, hq: int, hkv: int, pages: int, d: int, dtype,
                    max_selected: int, block_size: int) -> dict[str, float | None]:
    """Bytes XLA counts for one layer's block selection (scores + selection over
    [rows, Hkv, pages] blocks), sort-free vs the former top_k + sort, compiled alone for one
    device of `target`: {"sort_free": bytes, "top_k_sort": bytes} (None: no cost analysis)."""
    from sparrow_jax.sparsity import block_scores, selection
    dev = jax.sharding.SingleDeviceSharding(target_devices(target)[0])

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=dev)

    args = (sds((rows, hq, d), dtype), sds((rows, hkv, pages, d), dtype),
            sds((rows,), jnp.int32), sds((rows,), jnp.int32))
    out = {}
    for name, select in (("sort_free", selection.select_from_scores),
                         ("top_k_sort", selection.select_from_scores_reference)):
        def fn(q, c, lengths, budget, select=select):
            scores = block_scores.centroid_scores(q, c)
            ln = jnp.broadcast_to(lengths[:, None], scores.shape[:2])
            bb = jnp.broadcast_to(budget[:, None], scores.shape[:2])
            return select(scores, ln, bb, max_selected=max_selected, block_size=block_size)
        with kernel_platform(target.kernel_platform):
            compiled = jax.jit(fn).lower(*args).compile()
        out[name] = compiled_cost(compiled)[1]
    return out


def selection_form(rc, target: Target) -> str:
    """Where the rollout's block selection runs on `target`: "pallas_triton" (one kernel per
    sparse layer, `RolloutConfig.selection = 'auto'` on a GPU) or "xla" (the sort-free form)."""
    from sparrow_jax.sparsity import selection
    with kernel_platform(target.kernel_platform):
        return selection.selection_backend(rc.selection_backend)


def decode_step_bytes(shape: StepShape, spec: ShardingSpec, target: Target, *, rows: int,
                      blocks: int, sparse_layers: int, compile_selection: bool = True) -> dict:
    """Per decode step per device, for `rows` rows of `blocks` KV blocks each and `sparse_layers`
    sparse layers: {"selection_sort_free", "selection_top_k_sort" (None unless
    compile_selection), "attention_kv_at_max_budget", "sparse_layers", "max_selected"}."""
    rc, m = shape.rollout, shape.model
    model_axis = spec.mesh.shape.get("model", 1)
    split = model_axis if m.num_key_value_heads % model_axis == 0 else 1   # KV heads per device
    hkv, hq = m.num_key_value_heads // split, m.num_attention_heads // split
    max_selected = min(rc.max_budget // rc.block_size, blocks)
    sel = {"sort_free": None, "top_k_sort": None}
    if compile_selection and sparse_layers:
        sel = selection_bytes(target, rows, hq, hkv, blocks, m.head_dim, shape.compute_dtype,
                              max_selected, rc.block_size)
    # Attention proper reads K and V of the selected blocks: budget tokens per row, per layer.
    kv_token = 2 * hkv * m.head_dim * jnp.dtype(shape.compute_dtype).itemsize
    return {
        "selection_sort_free": None if sel["sort_free"] is None
        else sel["sort_free"] * sparse_layers,
        "selection_top_k_sort": None if sel["top_k_sort"] is None
        else sel["top_k_sort"] * sparse_layers,
        "attention_kv_at_max_budget": rows * max_selected * rc.block_size * kv_token
        * sparse_layers,
        "sparse_layers": sparse_layers, "max_selected": max_selected,
        "selection_form": selection_form(rc, target)}


def for_step(shape: StepShape, spec: ShardingSpec, target: Target,
             pool: PoolLayout | None) -> dict | None:
    """`sparrow dryrun`'s figures: `decode_step_bytes` at the step's own decode shape (a page
    pool's slots and pages per slot, or the static engine's rows per device and cache blocks)
    and every sparse layer of the model, with the rows and blocks; None for a dense rollout."""
    rc, m = shape.rollout, shape.model
    sparse = rc.num_sparse_layers(m.num_hidden_layers)
    if not sparse:
        return None
    if pool is not None:                                # one page pool per data shard
        rows, blocks = pool.slots_per_pool, pool.max_pages
    else:
        rows = max(1, shape.rows_call // spec.mesh.shape["data"])
        blocks = rc.cache_slots(shape.prompt_len) // rc.block_size
    return {"rows_per_device": rows, "blocks_per_row": blocks} | decode_step_bytes(
        shape, spec, target, rows=rows, blocks=blocks, sparse_layers=sparse)


def format_line(rows: int, blocks: int, b: dict) -> str:
    def gb(x):
        return "-" if x is None else f"{x / 1e9:.3f} GB"
    head = (f"per decode step per device ({rows} rows x {blocks} blocks, {b['sparse_layers']} "
            f"sparse layers), bytes XLA counts: ")
    xla = (f"{gb(b['selection_sort_free'])} sort-free (top_k + sort: "
           f"{gb(b['selection_top_k_sort'])})")
    if b.get("selection_form") == "pallas_triton":
        # A Pallas Triton custom call's bytes are not in XLA's cost analysis: say which form
        # runs, and give the XLA forms' counts as what the kernel replaces.
        sel = (f"selection runs as one Pallas Triton kernel per sparse layer (not in XLA's count; "
               f"the XLA forms it replaces: {xla})")
    else:
        sel = f"selection {xla}"
    return (head + sel + f" vs attention K/V reads at the full selection width "
            f"{gb(b['attention_kv_at_max_budget'])}")
