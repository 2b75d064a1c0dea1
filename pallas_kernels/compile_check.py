"""Real ahead-of-time compiles of the decode kernels for TPU and H100, without the hardware.

Run in the separate compile environment (see .ci/compile_env.sh), from a directory that has no
``libtpu`` folder (it would shadow the package):

    JAX_PLATFORMS=cpu PYTHONPATH=<repo>/.compile-env:<repo> <venv>/bin/python \
        -m pallas_kernels.compile_check [--targets tpu,cuda,jax_triton]
    TRITON_INTERPRET=1 ... -m pallas_kernels.compile_check --targets triton_interpret

* TPU: libtpu + ``jax.experimental.topologies.get_topology_desc("v5e:2x2", platform="tpu")``
  gives compile-only devices; ``jit(...).lower(...).compile()`` runs Mosaic and the TPU backend,
  which reject bad tilings and VMEM overflows exactly as on a real chip.
* H100: the jax CUDA plugin builds a compile-only GPU topology from a GpuTargetConfigProto
  (text proto below), and XLA compiles the Pallas->Triton kernel to an sm_90 cubin (lowered
  with that H100 as the default device: jax >= 0.11 reads the Triton target from it).
* jax_triton: lowered through the same H100 topology (triton_call emits PTX at lowering), plus a
  direct ``triton.compile`` to an sm_90 cubin checking the shared-memory footprint.
* triton_interpret (needs TRITON_INTERPRET=1 in the environment): runs the raw Triton kernel in
  Triton's CPU interpreter and compares with the XLA reference, since no GPU executes it here.
Every Pallas / jax_triton target also compiles the paged form (PAGED_SHAPE: one page pool shared
by a batch of 64 rows, behind the page-table lookup). Each target also compiles a deliberately
oversized kernel that must FAIL with its own error (VMEM / shared memory overflow, matched by
text): proof that the check really compiles instead of silently accepting anything - or
rejecting everything. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

# Realistic decode shapes: (name, batch, Hq, Hkv, D, context S, budget in tokens).
SHAPES = [
    ("qwen3-8b", 8, 32, 8, 128, 32768, 4096),
    ("qwen3-1.7b", 4, 16, 8, 128, 131072, 4096),
    # Large batch x budget: the TPU block table (1 MiB) exceeds SMEM and is split over several
    # calls. bf16 only: the f32 cache (17 GB) does not fit a v5e's 16 GiB HBM.
    ("qwen3-8b-b32-16k", 32, 32, 8, 128, 32768, 16384),
]
BF16_ONLY = {"qwen3-8b-b32-16k"}
# Paged decode as the rollout engine runs it: Qwen3-1.7B (Hq 16, Hkv 8, D 128), bf16, 64 rows
# sharing one pool (G = 1) of 16384 pages of 16 tokens, page tables of 2048 pages (32K tokens)
# per row, 256 selected entries (a 4K-token budget).
# (name, batch, Hq, Hkv, D, pools G, pages per pool N, page-table width P, entries K)
PAGED_SHAPE = ("qwen3-1.7b-paged", 64, 16, 8, 128, 1, 16384, 2048, 256)


def _dtypes(name: str) -> tuple:
    return (jnp.bfloat16,) if name in BF16_ONLY else (jnp.bfloat16, jnp.float32)
TPU_TOPOLOGIES = ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"]
BLOCK = 16
H100_SMEM_OPTIN = 232448     # bytes of shared memory a block may opt into on H100

# Hardware description of an H100 SXM (80 GB HBM3) for compile-only GPU topologies; fields are
# those of stream_executor.GpuTargetConfigProto (public H100 specifications).
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_results: list[tuple[str, bool, str]] = []


def _check(name: str, fn, *, expect_error: str | None = None) -> None:
    """Runs one compile; records PASS/FAIL. A negative control (`expect_error`, a regular
    expression) passes only when compiling fails with an error that matches it: an unrelated
    failure (a harness that cannot compile anything) must not pass as the expected rejection."""
    t0 = time.time()
    try:
        info = fn() or ""
        ok, msg = expect_error is None, info
        if expect_error is not None:
            msg = "compiled, but this oversized kernel must be rejected"
    except Exception as e:  # noqa: BLE001 - report every compiler error as a failed check
        text = str(e).strip()
        first = text.splitlines()[0][:200] if text else type(e).__name__
        if expect_error is None:
            ok, msg = False, f"{type(e).__name__}: {e}"
        elif re.search(expect_error, text):
            ok, msg = True, f"rejected as expected: {first}"
        else:
            ok = False
            msg = f"rejected, but not with the expected error /{expect_error}/: {first}"
        if not ok:
            traceback.print_exc()
    _results.append((name, ok, msg))
    print(f"{'PASS' if ok else 'FAIL'} {name} ({time.time() - t0:.1f}s) {msg}", flush=True)


def _args(sharding, b, hq, hkv, d, s, budget, dtype, sparse=True):
    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    q, k = sds((b, hq, d), dtype), sds((b, hkv, s, d), dtype)
    ln = sds((b,), jnp.int32)
    if not sparse:
        return q, k, k, ln
    kk = budget // BLOCK
    return q, k, k, sds((b, hkv, kk), jnp.int32), sds((b, hkv), jnp.int32), ln


def _paged_args(sharding, dtype=jnp.bfloat16):
    """Abstract inputs of the public paged form: q, k_pages, v_pages, page_table, block_indices,
    num_blocks, lengths at PAGED_SHAPE."""
    _, b, hq, hkv, d, pools, n_pages, p_width, kk = PAGED_SHAPE

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    pages = sds((pools, hkv, n_pages, BLOCK, d), dtype)
    return (sds((b, hq, d), dtype), pages, pages, sds((b, p_width), jnp.int32),
            sds((b, hkv, kk), jnp.int32), sds((b, hkv), jnp.int32), sds((b,), jnp.int32))


def _views(kernel, tiling, **kw) -> dict:
    """A backend's paged kernel behind dispatch's three views, as dispatch runs them (dispatch
    itself refuses these backends on a CPU host): sparse (contiguous), dense, paged."""
    from pallas_kernels import dispatch
    return {"sparse": functools.partial(dispatch.contiguous_view, kernel, **kw),
            "dense": functools.partial(dispatch.dense_view, kernel, tiling, **kw),
            "paged": functools.partial(dispatch.page_table_view, kernel, **kw)}


def _compile(fn, args, needle: str) -> str:
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    if needle not in text:
        raise AssertionError(f"compiled module has no {needle!r} custom call: kernel missing")
    return f"ok ({needle})"


def _check_views(label: str, view: dict, sh: SingleDeviceSharding, needle: str) -> None:
    """A backend's kernel views (`_views`) compile for one device, each module holding its
    custom call `needle`: sparse at every SHAPES row and dtype, dense in bf16, paged."""
    for name, b, hq, hkv, d, s, budget in SHAPES:
        for dtype in _dtypes(name):
            _check(f"{label} sparse {name} {jnp.dtype(dtype).name}", lambda: _compile(
                view["sparse"], _args(sh, b, hq, hkv, d, s, budget, dtype), needle))
        _check(f"{label} dense {name} bf16", lambda: _compile(
            view["dense"], _args(sh, b, hq, hkv, d, s, budget, jnp.bfloat16, False), needle))
    _check(f"{label} paged {PAGED_SHAPE[0]} bfloat16", lambda: _compile(
        view["paged"], _paged_args(sh), needle))


def check_tpu() -> None:
    from jax.experimental import topologies
    from pallas_kernels import pallas_tpu
    view = _views(pallas_tpu.paged_block_sparse_decode_tpu, pallas_tpu.dense_tiling, interpret=False)
    for topo_name in TPU_TOPOLOGIES:
        topo = topologies.get_topology_desc(topo_name, platform="tpu")
        dev = topo.devices[0]
        sh = SingleDeviceSharding(dev)
        tag = f"tpu[{topo_name} {dev.device_kind}]"
        _check_views(f"{tag} pallas_tpu", view, sh, "tpu_custom_call")
        # Negative control: one 32K-token tile (page) per step needs > 32 MiB of VMEM buffers.
        _, b, hq, hkv, d, s, _ = SHAPES[0]
        _check(f"{tag} negative control (VMEM overflow)", lambda: _compile(
            lambda q, k, v, bi, nb, ln: pallas_tpu.paged_block_sparse_decode_tpu(
                q, k.reshape(1, hkv, 1, s, d), v.reshape(1, hkv, 1, s, d), bi, bi, nb, ln,
                scale=0.1, blocks_per_step=1),
            _args(sh, 1, hq, hkv, d, s, s, jnp.bfloat16)[:3]
            + (jax.ShapeDtypeStruct((1, hkv, 1), jnp.int32, sharding=sh),
               jax.ShapeDtypeStruct((1, hkv), jnp.int32, sharding=sh),
               jax.ShapeDtypeStruct((1,), jnp.int32, sharding=sh)),
            "tpu_custom_call"), expect_error=r"(?i)vmem")


def _h100_sharding() -> SingleDeviceSharding:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG,
                                        topology="1x1x1")
    return SingleDeviceSharding(topo.devices[0])


def _on_h100(sh: SingleDeviceSharding):
    """The context in which Pallas Triton lowers for the compile-only H100. jax >= 0.11 reads
    the target GPU from the default device (or an abstract mesh's device) and raises "No
    supported GPU devices found" on a CPU host; making the topology's H100 the default device
    gives it that device's kind (sm_90). jax 0.10 lowers for sm_90 when no GPU is attached and
    ignores this. (An abstract mesh with the H100's kind also sets the target, but then jit
    looks for a local "gpu" backend, which a CPU host lacks.)"""
    return jax.default_device(next(iter(sh.device_set)))


def _lowering_target() -> str:
    """The compute capability Pallas Triton lowers for in the current context (jax >= 0.11;
    on 0.10 the lowering's own no-GPU fallback is sm_90)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return f"jax {jax.__version__} lowers for sm_90 without a local GPU"
    cc = gpu_info.get_gpu_info().compute_capability
    if cc != 90:
        raise AssertionError(f"Pallas Triton would lower for compute capability {cc}, not 90")
    return f"jax {jax.__version__} lowers for sm_{cc} ({gpu_info.get_device_kind()})"


def check_cuda() -> None:
    sh = _h100_sharding()
    with _on_h100(sh):
        _check_cuda(sh)


def _check_cuda(sh: SingleDeviceSharding) -> None:
    from pallas_kernels import dispatch
    from pallas_kernels import pallas_triton as ptriton
    tag = "cuda[H100 sm_90]"
    view = _views(ptriton.paged_block_sparse_decode_triton, ptriton.dense_tiling)
    _check(f"{tag} pallas_triton lowering target", _lowering_target)
    _check_views(f"{tag} pallas_triton", view, sh, "__gpu$xla.gpu.triton")
    # Block selection as one kernel: the 1.7B decode rows (batch 4 x 8 KV heads) at an 8K and
    # a 32K cache (513 / 2049 blocks of 16, 64 selected) and 512 rows at 128K (8193 blocks, 256).
    from pallas_kernels import pallas_triton_select
    for rows, nb, width, bits in ((32, 513, 64, 1), (32, 2049, 64, 1), (32, 2049, 64, 2),
                                  (32, 2049, 64, 4), (512, 8193, 256, 1)):
        _check(f"{tag} pallas_triton block selection {rows} x {nb} -> {width}, {bits}-bit "
               "digits", lambda: _compile(
            functools.partial(pallas_triton_select.select_ids_triton, width=width, radix_bits=bits),
            (jax.ShapeDtypeStruct((rows, nb), jnp.float32, sharding=sh),
             jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sh),
             jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sh)), "__gpu$xla.gpu.triton"))
    _check_fused_layer(tag, sh)
    _, b, hq, hkv, d, s, budget = SHAPES[0]
    _check(f"{tag} negative control (shared memory overflow)", lambda: _compile(
        functools.partial(dispatch.contiguous_view, ptriton.paged_block_sparse_decode_triton,
                          blocks_per_step=256, num_stages=4),
        _args(sh, b, hq, hkv, d, s, budget, jnp.bfloat16), "__gpu$xla.gpu.triton"),
        expect_error=r"Shared memory size limit exceeded")


def _check_fused_layer(tag: str, sh: SingleDeviceSharding) -> None:
    """The kernels of a decode layer as the fewest kernels (sparrow_jax/rollout/fused.py) at
    PAGED_SHAPE, each reading the raw heads of one [B, Hq + 2 Hkv, D] array and finishing them
    (RMSNorm + RoPE): the K/V/centroid write (aliased, in place), the fused scores + selection
    + page lookup, and the attention reading every row's page table or, covered or not, its
    selection; plus the static cache's forms (page i = block i) and a batch of 4 (split-K
    partials merged after the kernel)."""
    from pallas_kernels import pallas_triton as ptriton
    from pallas_kernels import pallas_triton_select, pallas_triton_write
    from pallas_kernels.reference import HeadFinish, SelectedPages
    _, b, hq, hkv, d, pools, n_pages, p_width, kk = PAGED_SHAPE
    heads = hq + 2 * hkv

    def sds(shape, dt=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    def finish(rows):
        return HeadFinish(sds((d,), jnp.bfloat16), sds((rows, d), jnp.float32),
                          sds((rows, d), jnp.float32), 1e-6)

    pool = sds((pools, hkv, n_pages, BLOCK, d), jnp.bfloat16)
    cents = sds((pools, hkv, n_pages, d), jnp.bfloat16)
    qkv = sds((b, heads, d), jnp.bfloat16)
    _check(f"{tag} pallas_triton token write (K, V, centroid) {PAGED_SHAPE[0]}", lambda: _compile(
        lambda kp, vp, cp, x, pg, off, w, f: pallas_triton_write.write_token_triton(
            kp, vp, cp, x, x, pg, off, w, k_finish=f, k_first=hq, v_first=hq + hkv),
        (pool, pool, cents, qkv, sds((b,)), sds((b,)), sds((b,), jnp.bool_), finish(b)),
        "__gpu$xla.gpu.triton"))
    _check(f"{tag} pallas_triton scores + selection + pages {PAGED_SHAPE[0]}", lambda: _compile(
        lambda x, cp, t, ln, bud, f: pallas_triton_select.select_pages_triton(
            x, cp, t, ln, bud, width=kk, block_size=BLOCK, q_finish=f, q_heads=hq),
        (qkv, cents, sds((b, p_width)), sds((b,)), sds((b,)), finish(b)),
        "__gpu$xla.gpu.triton"))
    for rows in (b, 4):
        _check(f"{tag} pallas_triton attention, table or selection per row, {rows} rows",
               lambda rows=rows: _compile(
                   lambda x, kp, vp, t, pid, blk, nb, cov, ln, f:
                   ptriton.paged_table_decode_triton(
                       x, kp, vp, t, ln, selection=SelectedPages(pid, blk, nb), covered=cov,
                       q_finish=f, q_heads=hq),
                   (sds((rows, heads, d), jnp.bfloat16), pool, pool, sds((rows, p_width)),
                    sds((rows, hkv, kk)), sds((rows, hkv, kk)), sds((rows, hkv)),
                    sds((rows,), jnp.bool_), sds((rows,)), finish(rows)),
                   "__gpu$xla.gpu.triton"))
    blocks = p_width // 4                       # a contiguous cache of 8K tokens per row
    rows_pool = sds((4, hkv, blocks, BLOCK, d), jnp.bfloat16)
    _check(f"{tag} pallas_triton static-cache selection and attention (page i = block i)",
           lambda: _compile(
               lambda x, kp, vp, cp, ln, bud, cov, f: ptriton.identity_decode_triton(
                   x, kp, vp, ln, selection=pallas_triton_select.select_pages_triton(
                       x, cp, None, ln, bud, width=kk // 4, block_size=BLOCK, q_finish=f,
                       q_heads=hq)[0], covered=cov, q_finish=f, q_heads=hq),
               (sds((4, heads, d), jnp.bfloat16), rows_pool, rows_pool,
                sds((4, hkv, blocks, d), jnp.bfloat16), sds((4,)), sds((4,)),
                sds((4,), jnp.bool_), finish(4)), "__gpu$xla.gpu.triton"))


def _triton_cubin(meta: dict, dtype, num_warps: int = 4, num_stages: int = 2) -> str:
    """Compiles the jax_triton kernel straight to an sm_90 cubin with triton's own ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pallas_kernels import jax_triton as pjt
    fn = pjt.sparse_decode_kernel
    elt = {"bfloat16": "*bf16", "float32": "*fp32"}[jnp.dtype(dtype).name]
    ptrs = dict(q_ptr=elt, k_ptr=elt, v_ptr=elt, pid_ptr="*i32", blk_ptr="*i32", nb_ptr="*i32",
                len_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32")
    sig = {n: ptrs.get(n, "constexpr") for n in fn.arg_names}
    src = ASTSource(fn, signature=sig, constexprs=meta)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    if not c.asm.get("cubin"):
        raise AssertionError("triton produced no cubin")
    if c.metadata.shared > H100_SMEM_OPTIN:
        raise AssertionError(f"shared memory {c.metadata.shared} B > H100 limit {H100_SMEM_OPTIN}")
    return f"cubin {len(c.asm['cubin'])} B, shared memory {c.metadata.shared} B"


def check_jax_triton() -> None:
    from pallas_kernels import jax_triton as pjt
    ok, why = pjt.available()
    if not ok:
        raise RuntimeError(f"jax_triton is not importable in the compile env: {why}")
    # jax_triton sets TRITON_CACHE_DIR="" at import (no cache); triton.compile needs one.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparrow-triton-cache-")
    from pallas_kernels import pallas_triton as ptriton
    sh = _h100_sharding()
    tag = "cuda[H100 sm_90]"
    view = _views(pjt.paged_block_sparse_decode_jax_triton, ptriton.dense_tiling,
                  compute_capability=90)
    for name, b, hq, hkv, d, s, budget in SHAPES:
        for dtype in _dtypes(name):
            dn = jnp.dtype(dtype).name
            _check(f"{tag} jax_triton lower+compile {name} {dn}", lambda: _compile(
                view["sparse"],
                _args(sh, b, hq, hkv, d, s, budget, dtype), "triton_kernel_call"))
            meta = pjt.kernel_constexprs(b, hq, hkv, s // BLOCK, d, budget // BLOCK, dtype,
                                         block_size=BLOCK, scale=d ** -0.5, blocks_per_step=None,
                                         num_splits=None)
            meta.pop("N_SPLIT")
            _check(f"{tag} jax_triton cubin {name} {dn}", lambda: _triton_cubin(meta, dtype))
        _check(f"{tag} jax_triton dense lower+compile {name} bf16", lambda: _compile(
            view["dense"],
            _args(sh, b, hq, hkv, d, s, budget, jnp.bfloat16, False), "triton_kernel_call"))
    name, b, hq, hkv, d, pools, n_pages, _, kk = PAGED_SHAPE
    _check(f"{tag} jax_triton paged lower+compile {name} bfloat16", lambda: _compile(
        view["paged"], _paged_args(sh), "triton_kernel_call"))
    paged_meta = pjt.kernel_constexprs(b, hq, hkv, n_pages, d, kk, jnp.bfloat16, block_size=BLOCK,
                                       scale=d ** -0.5, blocks_per_step=None, num_splits=None,
                                       pools=pools)
    paged_meta.pop("N_SPLIT")
    _check(f"{tag} jax_triton paged cubin {name} bfloat16",
           lambda: _triton_cubin(paged_meta, jnp.bfloat16))
    _, b, hq, hkv, d, s, budget = SHAPES[0]
    big = pjt.kernel_constexprs(b, hq, hkv, s // BLOCK, d, budget // BLOCK, jnp.float32,
                                block_size=BLOCK, scale=0.1, blocks_per_step=16, num_splits=1)
    big.pop("N_SPLIT")
    _check(f"{tag} jax_triton negative control (shared memory overflow)",
           lambda: _triton_cubin(big, jnp.float32, num_stages=3),
           expect_error=r"shared memory \d+ B > H100 limit|out of resource: shared memory")


def _interpret_case(dtype_name: str, shared_pool: bool) -> str:
    """Runs the raw Triton kernel in Triton's CPU interpreter on torch tensors and compares the
    merged result with the contiguous XLA reference (the jax_triton kernel is otherwise only
    compiled). shared_pool False: the contiguous cache viewed as one pool per row (page id =
    block id); True: both rows' pages shuffled into one pool with spare pages of noise."""
    import numpy as np
    import torch
    from pallas_kernels import jax_triton as pjt
    from pallas_kernels.dispatch import block_sparse_decode
    from pallas_kernels.pallas_triton import merge_partials
    b, hkv, g, s, d, kk = 2, 2, 4, 128, 32, 5
    nblk = s // BLOCK
    tdt = {"float32": torch.float32, "float16": torch.float16}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hkv * g, d, generator=gen).to(tdt)
    k = torch.randn(b, hkv, s, d, generator=gen).to(tdt)
    v = torch.randn(b, hkv, s, d, generator=gen).to(tdt)
    if shared_pool:
        n_pages = b * nblk + 3
        table = torch.randperm(n_pages, generator=gen)[:b * nblk].reshape(b, nblk).numpy()
        kp = (3 * torch.randn(1, hkv, n_pages, BLOCK, d, generator=gen)).to(tdt)
        vp = (3 * torch.randn(1, hkv, n_pages, BLOCK, d, generator=gen)).to(tdt)
        for r in range(b):
            for i in range(nblk):
                kp[0, :, table[r, i]] = k[r, :, i * BLOCK:(i + 1) * BLOCK]
                vp[0, :, table[r, i]] = v[r, :, i * BLOCK:(i + 1) * BLOCK]
    else:
        n_pages = nblk
        table = np.tile(np.arange(nblk), (b, 1))
        kp, vp = k.reshape(b, hkv, nblk, BLOCK, d), v.reshape(b, hkv, nblk, BLOCK, d)
    meta = pjt.kernel_constexprs(b, hkv * g, hkv, n_pages, d, kk, jnp.dtype(dtype_name),
                                 block_size=BLOCK, scale=d ** -0.5, blocks_per_step=2,
                                 num_splits=2, pools=kp.shape[0])
    n_split, gp, k_pad = meta.pop("N_SPLIT"), meta["GP"], meta["K_PAD"]
    sel = np.array([0, 2, 3, 5, 5], np.int32)
    idx = np.tile(np.concatenate([sel, np.full(k_pad - kk, 5, np.int32)]), (b, hkv, 1))
    pid = np.take_along_axis(table[:, None, :], idx, axis=2).astype(np.int32)
    nb = np.array([[4, 3], [0, 2]], np.int32)
    ln = np.array([100, 90], np.int32)
    qg = torch.zeros(b, hkv, gp, d, dtype=tdt)
    qg[:, :, :g] = q.reshape(b, hkv, g, d)
    acc = torch.zeros(n_split, b, hkv, gp, d)
    m = torch.zeros(n_split, b, hkv, gp)
    l = torch.zeros(n_split, b, hkv, gp)
    pjt.sparse_decode_kernel[(b, hkv, n_split)](
        qg, kp.contiguous(), vp.contiguous(), torch.from_numpy(pid), torch.from_numpy(idx),
        torch.from_numpy(nb), torch.from_numpy(ln), acc, m, l, **meta)
    out, lse = merge_partials(*(jnp.asarray(x.numpy()[:, :, :, :g]) for x in (acc, m, l)))
    to_j = lambda t: jnp.asarray(t.float().numpy(), jnp.dtype(dtype_name))
    want = block_sparse_decode(to_j(q), to_j(k), to_j(v), jnp.asarray(idx[..., :kk]),
                               jnp.asarray(nb), jnp.asarray(ln), backend="xla")
    tol = 1e-5 if dtype_name == "float32" else 3e-2
    err_o = float(jnp.max(jnp.abs(out.reshape(b, -1, d) - want[0].astype(jnp.float32))))
    ok_l = np.allclose(np.asarray(lse.reshape(b, -1)), np.asarray(want[1]), atol=tol, rtol=tol)
    if err_o > tol or not ok_l:
        raise AssertionError(f"interpreted kernel differs from reference: max|out err|={err_o}, "
                             f"lse {np.asarray(lse.reshape(b, -1))} vs {np.asarray(want[1])}")
    return f"matches reference (max out err {err_o:.2e})"


def check_triton_interpret() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("run with TRITON_INTERPRET=1 (set before triton is imported)")
    # Not bfloat16: Triton 3.9's interpreter computes bf16 tl.dot wrongly (a bare 16x16 bf16
    # dot is off by ~1e10 there); f16 exercises the same 16-bit kernel branch, and the bf16
    # kernel is compiled to a real sm_90 cubin by the jax_triton target.
    for dt in ("float32", "float16"):
        _check(f"triton-interpreter jax_triton kernel numerics {dt}",
               lambda: _interpret_case(dt, shared_pool=False))
    # The paged layout proper (shuffled pages of one shared pool), once: same kernel code.
    _check("triton-interpreter jax_triton kernel numerics paged shared pool float32",
           lambda: _interpret_case("float32", shared_pool=True))


CHECKS = {"tpu": check_tpu, "cuda": check_cuda, "jax_triton": check_jax_triton,
          "triton_interpret": check_triton_interpret}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="tpu,cuda,jax_triton",
                    help="comma-separated subset of: " + ",".join(CHECKS))
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(CHECKS)
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}")
    print(f"jax {jax.__version__}; targets {targets}", flush=True)
    for t in targets:
        try:
            CHECKS[t]()
        except Exception as e:  # noqa: BLE001 - a target that cannot even start is a failure
            traceback.print_exc()
            _results.append((f"{t} setup", False, f"{type(e).__name__}: {e}"))
            print(f"FAIL {t} setup: {type(e).__name__}: {e}", flush=True)
    failed = [r for r in _results if not r[1]]
    print(f"SUMMARY {len(_results) - len(failed)}/{len(_results)} passed", flush=True)
    return 1 if failed or not _results else 0


if __name__ == "__main__":
    sys.exit(main())
