"""The rollout's decode program stays sort-free on accelerators (issue 30), and a GPU decode
step launches no more kernels than today (issue 55): the paged decode chunk of the Qwen3-1.7B GPU
config, compiled for H100 and for TPU v5p without the hardware, has no `sort` and no top-k wider
than XLA's small-k GPU kernel in its optimised HLO, and no copy of a page pool (the pools are
updated in place); its H100 step has at most today's kernels per dense layer, per sparse layer
and outside the layers (`sparrow_jax/dryrun/kernel_census.py`, `step_kernels.py`), and no
per-layer branch.

Compile-only, in a subprocess with the compile environment (.compile-env) on PYTHONPATH, like
tests/test_dryrun.py. For CI time it compiles a few layers (every layer of a kind lowers alike):
on v5p 3 layers (2 dense + 1 sparse) and 8 prompts x 8 samples per step instead of 64 x 8; on
H100 the config's own 64 x 8 rows (the per-row shapes of a real step) at 5 layers (2 dense + 3
sparse), and the kernel census's compiles at 2, 3 (the third layer dense) and 4 layers, all in one
process that the H100 tests share. Heads, widths, the 32K+2K context (2176 blocks per row), the
selection width (512 blocks) and the 32-step chunk are the config's own.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hf_fixtures import require_compile_env

from sparrow_jax.dryrun import kernel_census, step_kernels
from sparrow_jax.rollout.config import RolloutConfig

REPO = Path(__file__).resolve().parents[1]
# SPARROW_COMPILE_ENV: another jax version's compile environment (.ci/second_jax.sh).
COMPILE_ENV = Path(os.environ.get("SPARROW_COMPILE_ENV") or REPO / ".compile-env").absolute()


def _decode_ops(target: str, *extra: str) -> dict:
    if os.environ.get("SPARROW_SKIP_COMPILE_CHECK") == "1":
        pytest.skip("SPARROW_SKIP_COMPILE_CHECK=1")
    require_compile_env(COMPILE_ENV)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(COMPILE_ENV), str(REPO)]))
    argv = [sys.executable, "-m", "sparrow_jax.dryrun.hlo", str(REPO / "configs/qwen3_1p7b_gpu.gin"),
            "--target", target, "--preset", "qwen3-1.7b", "--json", "--no_bytes", *extra]
    with tempfile.TemporaryDirectory(prefix="sparrow-hlo-test-") as cwd:  # no `libtpu` shadowing
        r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def h100_decode() -> dict:
    """The H100 decode chunk at 5 layers with its kernel census (one process, shared)."""
    return _decode_ops("h100x8", "--layers", "5")


@pytest.mark.compile
@pytest.mark.parametrize("target", ["h100x8", "v5p-8"])
def test_paged_decode_has_no_sort_or_large_topk(target, request):
    gpu = target.startswith("h100")
    report = (request.getfixturevalue("h100_decode") if gpu else _decode_ops(
        target, "--layers", "3", "--gin_param", "TrainConfig.prompts_per_step = 8"))
    assert report["program"] == "rollout.paged_decode" and report["engine"] == "paged"
    sparse = report["sparse_layers_compiled"]
    assert sparse == report["layers_compiled"] - 2 and report["blocks_per_row"] == 2176
    assert report["max_selected"] == 512
    # alpha_mode = "full" reads no vocabulary top-k: the rollout records none.
    assert report["record_topk"] == 0
    assert report["large_sorts"] == [], report["large_sorts"]
    assert report["sort"] == [] and report["topk"] == []
    # The fed token's K/V is written into the page pools in place (issue 31): a row scatter made
    # the TPU compiler copy every layer's pool out of its layout and back, 22 GiB of temporaries
    # in the 8B pod's decode chunk.
    assert report["pool_copies"] == [], report["pool_copies"]
    # Block selection is one Pallas Triton kernel per sparse layer on GPU (scores, selection and
    # page lookup fused; no dense/sparse switch around it), the XLA form on TPU.
    launches = report["kernel_launches"]
    assert launches["block_select_kernels"] == (sparse if gpu else 0), launches
    assert launches["sort"] == 0 and launches["total"] > 0


# Kernels of one H100 decode step of this config, counted on 2026-11-28 after issue 55's fusions
# (docs/benchmarks.md, "Kernels per decode step": 17 / 30 / 27 before them; the target:
# 10 per dense layer, 12 per sparse layer - what is left, and why, is listed there). A change
# that adds kernels fails here - lower these with it when a change removes some.
MAX_PER_DENSE_LAYER = 12
MAX_PER_SPARSE_LAYER = 13
MAX_OUTSIDE_IN_LOOP = 25           # embedding, final norm, LM head, sampling, bookkeeping
MAX_OUTSIDE_PER_CALL = 12          # per 32-step chunk


@pytest.mark.compile
@pytest.mark.slow       # ~1 min: one more H100 compile
def test_exact_paged_chunk_of_a_per_bin_plan_copies_no_pool():
    """The exact_sparse paged chunk with a per-bin plan (three round branches), compiled for
    H100 at 3 layers: no page-pool copy. Under `lax.switch` this program held 24 copies of
    bf16[8, 217872, 128] pools (~0.45 GB each: the pools copied every round; 2026-11-29);
    `verify.run_one_branch` aliases them (the CPU twins: tests/test_exact_sparse.py,
    tests/test_paged_exact.py)."""
    report = _decode_ops("h100x8", "--layers", "3", "--no_kernels",
                         "--gin_param", "TrainConfig.rollout_mode = 'exact_sparse'",
                         "--gin_param", "RolloutConfig.gamma = 2",
                         "--gin_param", "RolloutConfig.gamma_by_bin = (0, 1, 2)",
                         "--gin_param", "TrainConfig.adapt_schedule = False")
    assert report["program"] == "rollout.paged_decode[exact_sparse]", report["program"]
    assert report["pool_copies"] == [], report["pool_copies"]


@pytest.mark.compile
def test_decode_step_kernels_do_not_grow(h100_decode):
    k = h100_decode["kernels_per_step"]
    listing = kernel_census.format_lists(k)
    assert k["steps_per_call"] == 32 and k["layers"] == 28 and k["sparse_layers"] == 26, listing
    assert k["flags"] == [], listing
    assert k["per_dense_layer"] <= MAX_PER_DENSE_LAYER, listing
    assert k["per_sparse_layer"] <= MAX_PER_SPARSE_LAYER, listing
    assert k["outside_in_loop"] <= MAX_OUTSIDE_IN_LOOP, listing
    assert k["outside_per_call"] <= MAX_OUTSIDE_PER_CALL, listing
    # No branch per sparse layer (a conditional launches a kernel of its own and one for its
    # predicate): one attention kernel serves rows covered by their budget and the others.
    assert k["sparse_layer_conditionals"] == [], listing
    assert not any("conditional" in n for n in k["sparse_layer_kernels"]), listing
    # Every kernel has a name that says where it belongs.
    for names in (k["dense_layer_kernels"], k["sparse_layer_kernels"]):
        assert all(not n.startswith("step ") for n in names), listing


# -- the census itself, on a hand-written module: what counts, loops, branches -------------------
_MODULE = """HloModule jit_decode, is_scheduled=true

%fused_dot (p0: bf16[8,64], p1: bf16[64,64]) -> f32[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_norm (p0: f32[8,64]) -> bf16[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %r = f32[8,64]{1,0} rsqrt(%p0)
  ROOT %c = bf16[8,64]{1,0} convert(%r)
}

%fused_any (p0: s32[8]) -> pred[] {
  %p0 = s32[8]{0} parameter(0)
  ROOT %cmp = pred[] compare(%p0, %p0), direction=LT
}

%fused_add (p0: s32[]) -> s32[] {
  %p0 = s32[] parameter(0)
  ROOT %a = s32[] add(%p0, %p0)
}

%dense_branch (param: (f32[8,64])) -> (f32[8,64]) {
  %param = (f32[8,64]{1,0}) parameter(0)
  %gte = f32[8,64]{1,0} get-tuple-element(%param), index=0
  %call.1 = f32[8,64]{1,0} custom-call(%gte), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(decode_program)/while/body/closed_call/jit(_layer_attention)/shard_map/cond/branch_1_fun/my_attention_kernel/pallas_call"}
  ROOT %t = (f32[8,64]{1,0}) tuple(%call.1)
}

%sparse_branch (param: (f32[8,64])) -> (f32[8,64]) {
  %param = (f32[8,64]{1,0}) parameter(0)
  %gte = f32[8,64]{1,0} get-tuple-element(%param), index=0
  %select.1 = f32[8,64]{1,0} custom-call(%gte), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(decode_program)/while/body/closed_call/jit(_layer_attention)/shard_map/cond/branch_0_fun/my_select_kernel/pallas_call"}
  %norm.1 = bf16[8,64]{1,0} fusion(%select.1), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(decode_program)/while/body/closed_call/jit(_layer_attention)/shard_map/cond/branch_0_fun/mul"}
  %call.2 = f32[8,64]{1,0} custom-call(%gte), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(decode_program)/while/body/closed_call/jit(_layer_attention)/shard_map/cond/branch_0_fun/my_attention_kernel/pallas_call"}
  ROOT %t = (f32[8,64]{1,0}) tuple(%call.2)
}

%inner_body (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %add.2 = s32[] fusion(%p), kind=kLoop, calls=%fused_add, metadata={op_name="jit(decode_program)/while/body/closed_call/mlp/add"}
}

%inner_cond (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  ROOT %lt = pred[] fusion(%p), kind=kLoop, calls=%fused_any, metadata={op_name="jit(decode_program)/while/body/closed_call/mlp/lt"}
}

%step_body (p: (s32[], s32[8], bf16[8,64], bf16[64,64])) -> (s32[], s32[8], bf16[8,64], bf16[64,64]) {
  %p = (s32[], s32[8]{0}, bf16[8,64]{1,0}, bf16[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %len = s32[8]{0} get-tuple-element(%p), index=1
  %x = bf16[8,64]{1,0} get-tuple-element(%p), index=2
  %w = bf16[64,64]{1,0} get-tuple-element(%p), index=3
  %gemm.1 = f32[8,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(decode_program)/while/body/closed_call/qkv_proj/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %pred.1 = pred[] fusion(%len), kind=kInput, calls=%fused_any, metadata={op_name="jit(decode_program)/while/body/closed_call/jit(_layer_attention)/shard_map/reduce_and"}
  %tup = (f32[8,64]{1,0}) tuple(%gemm.1)
  %cond.1 = (f32[8,64]{1,0}) conditional(%pred.1, %tup, %tup), true_computation=%dense_branch, false_computation=%sparse_branch, metadata={op_name="jit(decode_program)/while/body/closed_call/jit(_layer_attention)/shard_map/cond"}
  %inner = s32[] while(%i), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_add, metadata={op_name="jit(decode_program)/while/body/add"}
  ROOT %out = (s32[], s32[8]{0}, bf16[8,64]{1,0}, bf16[64,64]{1,0}) tuple(%next, %len, %x, %w)
}

%step_cond (p: (s32[], s32[8], bf16[8,64], bf16[64,64])) -> pred[] {
  %p = (s32[], s32[8]{0}, bf16[8,64]{1,0}, bf16[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt.1 = pred[] fusion(%i), kind=kLoop, calls=%fused_any, metadata={op_name="jit(decode_program)/while/cond/lt"}
}

ENTRY %main (a: s32[8], x: bf16[8,64], w: bf16[64,64]) -> s32[8] {
  %a = s32[8]{0} parameter(0)
  %x = bf16[8,64]{1,0} parameter(1)
  %w = bf16[64,64]{1,0} parameter(2)
  %copy.1 = s32[8]{0} copy(%a)
  %zero = s32[] constant(0)
  %init = (s32[], s32[8]{0}, bf16[8,64]{1,0}, bf16[64,64]{1,0}) tuple(%zero, %copy.1, %x, %w)
  %loop = (s32[], s32[8]{0}, bf16[8,64]{1,0}, bf16[64,64]{1,0}) while(%init), condition=%step_cond, body=%step_body, metadata={op_name="jit(decode_program)/while"}, backend_config={"known_trip_count":{"n":"32"}}
  ROOT %r = s32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_census_counts_loops_branches_and_names_kernels():
    c = step_kernels.step_census(_MODULE)
    assert c.trip_count == 32 and c.flags == []
    assert dict(c.call) == {"step copy s32[8]": 1}                    # outside the step loop
    assert dict(c.step) == {
        "qkv_proj gemm (triton) f32[8,64]": 1,
        "cond predicate: attention compare pred[]": 1,
        "attention conditional (sets the branch)": 1,
        # the taken branch: index 0, a lax.cond's false branch (here the sparse one)
        "pallas my_select_kernel": 1, "attention rms_norm bf16[8,64]": 1,
        "pallas my_attention_kernel": 1,
        "mlp add s32[]": 3, "mlp compare pred[]": 3,                    # a 3-trip inner loop,
        "step while (sets the loop condition)": 4,                      # its 3 + the step's 1
        "step add s32[]": 1, "step compare pred[]": 1}                  # + the loop condition
    assert c.per_step == sum(c.step.values()) + 1 / 32
    (cond,) = c.conditionals
    assert [sum(b.values()) for b in cond.branches] == [3, 1]
    assert cond.predicate == "attention compare pred[]"


def test_layer_census_differences_and_full_depth():
    """Censuses at depths n built from known per-layer parts come apart into those parts, and
    extrapolate to the full depth."""
    rc = RolloutConfig(mode="sparse", dense_layers=(0, 1))
    outside, dense, sparse = (collections.Counter({"out": 5}), collections.Counter({"d": 3}),
                              collections.Counter({"s": 4, "cond": 1}))

    def census(depth: kernel_census.Depth) -> step_kernels.StepCensus:
        n_dense, n_sparse = depth.counts(rc)
        step = outside + collections.Counter({k: v * n_dense for k, v in dense.items()}) \
            + collections.Counter({k: v * n_sparse for k, v in sparse.items()})
        return step_kernels.StepCensus(32, step, collections.Counter({"copy": 8}), [], [])

    dense_pair, sparse_pair = kernel_census.layer_depths(rc, 28)
    assert dense_pair == (kernel_census.Depth(2), kernel_census.Depth(3, made_dense=2))
    assert sparse_pair == (kernel_census.Depth(4), kernel_census.Depth(5))
    lc = kernel_census.layer_census({d: census(d) for d in dense_pair + sparse_pair}, rc, 28)
    assert (lc.per_dense_layer, lc.per_sparse_layer) == (3, 5)
    assert lc.outside == 5 + 8 / 32 and lc.flags == []
    assert lc.per_step == 5.25 + 2 * 3 + 26 * 5 and lc.per_step_dense == 5.25 + 28 * 3
    line = kernel_census.format_line(lc.as_dict())
    assert line.startswith("decode step kernels: 3 per dense layer, 5 per sparse layer"), line
    assert "~89 / ~141 per step at 28 layers dense / sparse" in line, line
    # Dense mode: no sparse layer, every depth dense.
    dense_rc = RolloutConfig(mode="dense")
    assert kernel_census.layer_depths(dense_rc, 28) == (
        (kernel_census.Depth(2), kernel_census.Depth(3)), None)


def test_decode_compiler_options_reach_the_decode_programs_only():
    """`RolloutConfig.decode_command_buffers` / `decode_split_k` become XLA options of the decode
    programs (`*_program_for`): none at the defaults (the plain jitted program), one cached jit
    per setting otherwise, which compiles on CPU too (GPU options, ignored there); bad values
    fail at config time."""
    import jax
    import jax.numpy as jnp

    from sparrow_jax.rollout import paged, static
    from sparrow_jax.runtime import compiler_options

    assert RolloutConfig().decode_compiler_options == ()
    assert paged.decode_chunk_program_for(RolloutConfig()) is paged.decode_chunk_program
    assert static.decode_program_for(RolloutConfig()) is static.decode_program
    cfg = RolloutConfig(decode_command_buffers="off", decode_split_k=1)
    assert cfg.decode_compiler_options == (("xla_gpu_enable_command_buffer", ""),
                                           ("xla_gpu_experimental_force_split_k", "1"))
    loop = dict(RolloutConfig(decode_command_buffers="loop").decode_compiler_options)
    assert "WHILE" in loop["xla_gpu_enable_command_buffer"].split(",")
    program = paged.decode_chunk_program_for(cfg)
    assert program is not paged.decode_chunk_program
    assert program is paged.decode_chunk_program_for(cfg)
    double = compiler_options.with_options(jax.jit(lambda x: 2 * x), {},
                                           cfg.decode_compiler_options)
    assert float(double(jnp.ones(()))) == 2.0
    with pytest.raises(ValueError, match="decode_command_buffers"):
        RolloutConfig(decode_command_buffers="sometimes")
    with pytest.raises(ValueError, match="decode_split_k"):
        RolloutConfig(decode_split_k=-1)
