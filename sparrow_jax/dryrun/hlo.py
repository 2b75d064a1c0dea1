"""What the rollout's decode program lowers to on a target, without the hardware: the `sort` and
top-k ops in its optimised HLO, and the bytes XLA's cost analysis counts for block selection per
decode step (issue 30: a large-k top-k or a sort is a full sort on GPU, per sparse layer per step).

    python -m sparrow_jax.dryrun.hlo CONFIG.gin [--gin_param ...] --target h100x8
        [--preset qwen3-1.7b] [--layers N] [--json] [--no_bytes]

Needs the compile environment on PYTHONPATH and JAX_PLATFORMS=cpu (as `sparrow dryrun` runs its
compiles; see tests/test_decode_hlo.py). --layers N compiles the model at N layers (real head and
width shapes; every layer of a kind lowers alike, so the op census holds at full depth).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import jax

from sparrow_jax.dryrun import kernel_census, selection_cost, step_kernels

# Top-k widths XLA's GPU TopK kernel handles directly; a wider top-k becomes a sort.
SMALL_TOPK = 16
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][\w\-]*)\(", re.M)
_FIRST_DIMS = re.compile(r"\[([\d,]*)\]")


def sort_and_topk_ops(hlo: str) -> dict[str, list]:
    """Every `sort` instruction and every top-k (the `topk` op, a TopK custom call) in HLO text,
    metadata ignored: {"sort": [shape, ...], "topk": [(k, opcode or target), ...]}."""
    out: dict[str, list] = {"sort": [], "topk": []}
    for line in hlo.splitlines():
        m = _OPCODE.match(line)
        if not m:
            continue
        shape, op = m.group(1), m.group(2)
        if op == "sort":
            out["sort"].append(shape)
        elif op == "topk":
            k = re.search(r"\bk=(\d+)", line)
            out["topk"].append((int(k.group(1)) if k else -1, op))
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            if target and "topk" in target.group(1).lower():
                dims = _FIRST_DIMS.search(shape)
                k = int(dims.group(1).split(",")[-1]) if dims and dims.group(1) else -1
                out["topk"].append((k, target.group(1)))
    return out


_LAUNCHES = ("fusion", "custom-call", "copy", "sort")
_COMPUTATION = re.compile(r"\n(?=%|ENTRY)")


def kernel_launches(hlo: str) -> dict[str, int]:
    """The instructions of an optimised GPU module that each launch work - fusions, custom calls,
    copies, sorts - outside fused computations (whose instructions run inside their fusion's
    kernel), counted once per program text: a loop body once, both sides of a branch each.
    Plus "block_select_kernels": the custom calls of the one-kernel block selection (the
    fused scores + selection + page lookup of `pallas_triton_select.select_pages_triton`, or
    the selection from scores alone)."""
    counts = dict.fromkeys(_LAUNCHES, 0)
    for comp in _COMPUTATION.split(hlo):
        if re.match(r"%(fused|wrapped|gemm_fusion|triton|command_buffer)", comp):
            continue
        for line in comp.splitlines():
            m = _OPCODE.match(line)
            if m and m.group(2) in counts:
                counts[m.group(2)] += 1
    counts["total"] = sum(counts.values())
    counts["block_select_kernels"] = len(re.findall(
        r"custom-call\([^\n]*sparrow_(?:block_select|select_pages)_triton", hlo))
    return counts


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def large_copies(hlo: str, min_bytes: int) -> list[str]:
    """Shapes of the `copy` instructions of at least `min_bytes` (a copy of a page pool: the TPU
    compiler relayouting the whole pool around a row scatter costs a pool's size per layer)."""
    out = []
    for line in hlo.splitlines():
        m = _OPCODE.match(line)
        if not m or m.group(2) != "copy":
            continue
        t = re.match(r"(\w+)\[([\d,]*)\]", m.group(1))
        if t and t.group(1) in _BYTES:
            size = _BYTES[t.group(1)] * math.prod(int(x) for x in t.group(2).split(",") if x)
            if size >= min_bytes:
                out.append(m.group(1).split("{")[0])
    return out


def large_sorts(ops: dict[str, list]) -> list[str]:
    """The sorts and the top-k wider than SMALL_TOPK among `sort_and_topk_ops`' findings."""
    return ([f"sort {s}" for s in ops["sort"]]
            + [f"{name} k={k}" for k, name in ops["topk"] if k < 0 or k > SMALL_TOPK])


def decode_ops(target_name: str, model, layers: int = 0, selection_bytes: bool = True,
               kernels: bool = True) -> dict:
    """Compiles the configured rollout's decode program (the paged engine's decode chunk, or the
    static engine's decode loop) for `target_name`, at `layers` layers (0 = all); its sort/top-k
    census, per-step selection bytes and (kernels, GPU targets) the kernels one decode step
    launches (`kernel_census`: more compiles, at the depths it needs). Reads the parsed gin
    configuration as `sparrow dryrun`."""
    from sparrow_jax.dryrun.decode_call import decode_call
    from sparrow_jax.dryrun.programs import compile_program, step_shape
    from sparrow_jax.dryrun.run import build_spec
    from sparrow_jax.dryrun.targets import get_target
    target = get_target(target_name)
    shape = step_shape(model, target)
    spec = build_spec(shape, target)
    rc, m = shape.rollout, shape.model
    per_dev = shape.rows_call / spec.mesh.shape["data"]
    t0 = time.perf_counter()
    call = decode_call(shape, spec, target, layers)
    decode, compiled_layers = call.program, layers or m.num_hidden_layers
    measured, _, compiled = compile_program(decode, target.kernel_platform, per_dev)
    if compiled is None:
        raise RuntimeError(f"{decode.name} did not compile for {target.name}: {measured.error}")
    hlo = compiled.as_text()
    ops = sort_and_topk_ops(hlo)
    sparse_layers = rc.num_sparse_layers(compiled_layers)
    full_sparse = rc.num_sparse_layers(model.num_hidden_layers)
    per_step = selection_cost.decode_step_bytes(shape, spec, target, rows=call.rows,
                                                blocks=call.blocks_per_row,
                                                sparse_layers=full_sparse,
                                                compile_selection=selection_bytes)
    compile_s = time.perf_counter() - t0
    census = None
    if kernels and target.platform == "cuda":
        known = {kernel_census.Depth(compiled_layers): step_kernels.step_census(hlo)}
        census = kernel_census.census_by_depth(shape, spec, target, known)
    return {
        "target": target.name, "program": decode.name, "engine": rc.engine,
        "layers_compiled": compiled_layers, "layers_model": model.num_hidden_layers,
        "sparse_layers_compiled": sparse_layers, "compile_s": compile_s,
        "sort": ops["sort"], "topk": ops["topk"], "large_sorts": large_sorts(ops),
        "rows_per_device": call.rows, "blocks_per_row": call.blocks_per_row,
        "max_selected": per_step["max_selected"], "record_topk": rc.record_topk,
        # Copies of a layer's pool or more (paged engine): none when the pool updates in place.
        "pool_copies": large_copies(hlo, call.pool_layer_bytes // 2) if call.pool_layer_bytes
        else [],
        "kernel_launches": kernel_launches(hlo),
        "kernels_per_step": census.as_dict() if census else None,
        "kernels_s": time.perf_counter() - t0 - compile_s,
        "per_step_bytes": per_step,
    }


def format_report(r: dict) -> str:
    verdict = "none" if not r["large_sorts"] else "; ".join(r["large_sorts"])
    return "\n".join([
        f"{r['program']} for {r['target']} ({r['engine']} engine, compiled at "
        f"{r['layers_compiled']} of {r['layers_model']} layers, {r['compile_s']:.0f}s): "
        f"sorts / large-k top-k in the optimised HLO: {verdict}; small top-k: "
        f"{[k for k, _ in r['topk'] if 0 <= k <= SMALL_TOPK]}; launching instructions "
        f"{r['kernel_launches']['total']} (block selection kernels "
        f"{r['kernel_launches']['block_select_kernels']})",
        selection_cost.format_line(r["rows_per_device"], r["blocks_per_row"],
                                   r["per_step_bytes"])]
        + ([kernel_census.format_lists(r["kernels_per_step"])] if r["kernels_per_step"] else []))


def main(argv: list[str] | None = None) -> int:
    from sparrow_jax.dryrun import programs  # noqa: F401 - its gin configurables, before parsing
    from sparrow_jax.model.config import qwen3_preset
    from sparrow_jax.runtime.gin_files import parse_gin
    from sparrow_jax.train import trainer  # noqa: F401 - the configurables a run's files bind
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gin_files", nargs="*")
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--target", required=True)
    ap.add_argument("--preset", required=True, help="model shape, e.g. qwen3-1.7b")
    ap.add_argument("--layers", type=int, default=0, help="compile at N layers (0 = all)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no_bytes", action="store_true",
                    help="skip the selection-alone compiles that count its bytes per step")
    ap.add_argument("--no_kernels", action="store_true",
                    help="skip the kernel census of a GPU target's decode step (its compiles "
                         "at 1-4 layers)")
    args = ap.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    parse_gin(args.gin_files, args.gin_param)
    report = decode_ops(args.target, qwen3_preset(args.preset), args.layers,
                        selection_bytes=not args.no_bytes, kernels=not args.no_kernels)
    print(json.dumps(report, default=str) if args.json else format_report(report), flush=True)
    return 0 if not report["large_sorts"] else 1


if __name__ == "__main__":
    sys.exit(main())
