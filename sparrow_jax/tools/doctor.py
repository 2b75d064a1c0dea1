"""`sparrow doctor`: the first command on new hardware - do the kernels and a rollout work here?

On the current device it runs every decode-kernel backend that can run there against the XLA
reference (itself checked against float64 NumPy), on the paged block-sparse kernel the rollout
uses: bf16 page pools in shuffled page order, Qwen3-1.7B and Qwen3-8B head shapes (Hq/Hkv/D =
16/8/128 and 32/8/128), ragged rows, a row with no KV at all and a row with no selected block;
sparse selections and "every block" (dense) selections. Block selection as one Pallas Triton
kernel (the GPU rollout's) against its XLA form: equal ids. Then a short rollout of a tiny random
Qwen3 on both engines with backend "auto". It prints a PASS / FAIL / SKIP table with kernel
times (and, on accelerators, the fraction of this device's copy bandwidth the kernel reached)
and exits 1 on any FAIL.

  GPU: pallas_triton, jax_triton (SKIP when jax-triton is not installed); TPU: pallas_tpu;
  CPU: pallas_tpu and pallas_triton in Pallas interpret mode (small shapes; times are not
  kernel speed), jax_triton SKIP (no interpret mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from sparrow_jax.runtime.bandwidth import copy_bandwidth, matmul_rate

HEADS = {"qwen3-1.7b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}
BLOCK = 16


@dataclasses.dataclass
class Result:
    check: str
    backend: str
    status: str            # PASS | FAIL | SKIP
    detail: str = ""
    ms: float | None = None
    bw_frac: float | None = None


@dataclasses.dataclass(frozen=True)
class Sizes:
    rows: int
    context: int           # tokens per row at most (a multiple of BLOCK)
    selected: int          # blocks selected per row and KV head (sparse case)
    iters: int


def sizes_for(platform: str) -> Sizes:
    # Interpret mode runs the kernel's grid step by step: keep CPU shapes small (< 60 s total).
    return Sizes(4, 64, 3, 1) if platform == "cpu" else Sizes(8, 4096, 64, 10)


def backends_for(platform: str) -> list[tuple[str, bool, str]]:
    """(backend, interpret, skip reason or "") for every non-reference backend on `platform`."""
    out = []
    for name in ("pallas_tpu", "pallas_triton", "jax_triton"):
        interpret = platform == "cpu" and name != "jax_triton"
        try:
            pk.resolve_backend(name, interpret=interpret, platform=platform)
            out.append((name, interpret, ""))
        except pk.BackendUnavailableError as e:
            if platform == "cpu" or (platform, name) in (("tpu", "pallas_triton"),
                                                         ("tpu", "jax_triton"),
                                                         ("gpu", "pallas_tpu")):
                out.append((name, interpret, f"cannot run on {platform}"))
            else:
                out.append((name, interpret, str(e)))
    return out


def make_case(seed: int, hq: int, hkv: int, d: int, sizes: Sizes, *, dense: bool):
    """Paged decode inputs in bf16: (q, k_pages, v_pages, page_table, block_indices,
    num_blocks, lengths) and the float64 NumPy answer (out, lse)."""
    rng = np.random.default_rng(seed)
    b, s = sizes.rows, sizes.context
    nblk = s // BLOCK
    lengths = rng.integers(BLOCK + 1, s + 1, size=b)
    lengths[0], lengths[1] = s, 0                  # a full row and a row with no KV
    lengths[-1] = s - 7                            # a partly filled last page
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
    n_pages = b * nblk + 3                         # spare pages hold noise: a wrong read shows
    k_pages = jnp.asarray(2 * rng.standard_normal((1, hkv, n_pages, BLOCK, d)), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal((1, hkv, n_pages, BLOCK, d)), jnp.bfloat16)
    table = rng.permutation(n_pages)[: b * nblk].reshape(b, nblk).astype(np.int32)
    kmax = nblk if dense else sizes.selected
    idx = np.zeros((b, hkv, kmax), np.int32)
    num = np.zeros((b, hkv), np.int32)
    for r in range(b):
        have = -(-int(lengths[r]) // BLOCK)
        for h in range(hkv):
            n = have if dense else min(have, sizes.selected)
            if not dense and r == 2 and h == 0:
                n = 0                              # a row/head with no selected block
            chosen = np.arange(n) if dense else np.sort(rng.choice(have, n, replace=False))
            idx[r, h, :n] = chosen
            idx[r, h, n:] = chosen[-1] if n else 0
            num[r, h] = n
    args = (q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(idx), jnp.asarray(num),
            jnp.asarray(lengths, jnp.int32))
    return args, _numpy_paged(*args)


def _numpy_paged(q, kp, vp, table, idx, num, lengths):
    q, kp, vp = (np.asarray(x, np.float64) for x in (q, kp, vp))
    table, idx, num, lengths = (np.asarray(x) for x in (table, idx, num, lengths))
    b, hq, d = q.shape
    hkv = kp.shape[1]
    out = np.zeros((b, hq, d))
    lse = np.full((b, hq), -np.inf)
    for r in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            blocks = idx[r, g, : num[r, g]]
            pos = np.concatenate([np.arange(x * BLOCK, (x + 1) * BLOCK) for x in blocks]) \
                if len(blocks) else np.zeros(0, int)
            pos = pos[pos < lengths[r]]
            if not len(pos):
                continue
            keys = kp[0, g, table[r, pos // BLOCK], pos % BLOCK]
            vals = vp[0, g, table[r, pos // BLOCK], pos % BLOCK]
            logits = keys @ q[r, h] / np.sqrt(d)
            m = logits.max()
            w = np.exp(logits - m)
            out[r, h] = w @ vals / w.sum()
            lse[r, h] = m + np.log(w.sum())
    return out, lse


def _compare(got, want, *, atol: float, rtol: float) -> str:
    """"" when close, else the worst mismatch in words."""
    out, lse = (np.asarray(x, np.float64) for x in got)
    if np.isnan(out).any() or np.isnan(lse).any():
        return "NaN in the output"
    if not np.array_equal(np.isneginf(lse), np.isneginf(want[1])):
        return "rows without KV (lse = -inf) differ"
    finite = ~np.isneginf(want[1])
    err = np.abs(out - want[0]).max()
    lerr = np.abs(lse[finite] - want[1][finite]).max() if finite.any() else 0.0
    if err > atol + rtol * np.abs(want[0]).max() or lerr > atol + rtol * np.abs(want[1][finite]).max():
        return f"max |out - ref| = {err:.3g}, max |lse - ref| = {lerr:.3g}"
    return ""


def _time(fn: Callable, args, iters: int) -> tuple[object, float]:
    result = jax.block_until_ready(fn(*args))      # compiles
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return result, statistics.median(times) * 1e3


def check_kernels(platform: str, copy_bw: float | None,
                  only: tuple[str, ...] = ()) -> list[Result]:
    """Every backend (or those in `only`) on every case; see the module docstring."""
    sizes = sizes_for(platform)
    results = []
    for model, (hq, hkv, d) in HEADS.items():
        for dense in (False, True):
            label = f"{model} {'dense' if dense else 'sparse'} paged bf16"
            args, want = make_case(hq + dense, hq, hkv, d, sizes, dense=dense)
            xla = jax.jit(lambda *a: pk.paged_block_sparse_decode(*a, backend="xla"))
            got_ref, ms = _time(xla, args, sizes.iters)
            # Reference vs float64: bf16 inputs, f32 accumulation.
            why = _compare(got_ref, want, atol=2e-2, rtol=2e-2)
            read = _bytes_read(args, d)
            results.append(Result(label, "xla", "FAIL" if why else "PASS",
                                  why or "vs float64 NumPy", ms, _frac(read, ms, copy_bw)))
            for name, interpret, skip in backends_for(platform):
                if only and name not in only:
                    continue
                if skip:
                    results.append(Result(label, name, "SKIP", skip))
                    continue
                fn = jax.jit(lambda *a, name=name, interpret=interpret:
                             pk.paged_block_sparse_decode(*a, backend=name, interpret=interpret))
                try:
                    got, ms = _time(fn, args, sizes.iters)
                    why = _compare(got, got_ref, atol=3e-2, rtol=3e-2)
                except Exception as e:  # noqa: BLE001 - a crashing kernel is a FAIL row
                    got, ms, why = None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                results.append(Result(label, name, "FAIL" if why else "PASS",
                                      why or ("vs xla" + (" (interpret)" if interpret else "")),
                                      ms, None if interpret else _frac(read, ms, copy_bw)))
    return results


def _bytes_read(args, d: int) -> int:
    """K and V bytes the selected blocks hold (what the kernel must read at least)."""
    blocks = int(np.asarray(args[5]).sum())        # over rows and KV heads
    return blocks * BLOCK * d * 2 * args[1].dtype.itemsize


def _frac(nbytes: int, ms: float | None, copy_bw: float | None) -> float | None:
    if not ms or not copy_bw:
        return None
    return nbytes / (ms / 1e3) / copy_bw


def check_rollout(platform: str) -> list[Result]:
    """A tiny random Qwen3, 2 prompts x 2 samples, static and paged engines, backend auto."""
    from flax import nnx

    from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM
    from sparrow_jax.rollout import generate
    from sparrow_jax.rollout.config import RolloutConfig

    # head_dim 128 as in Qwen3: the kernels' tiles see the real last dimension.
    mcfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen3ForCausalLM(mcfg, rngs=nnx.Rngs(0))
    prompts = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 40)), jnp.int32)
    plens = jnp.asarray([40, 23], jnp.int32)
    budgets = jnp.full((4,), 48, jnp.int32)
    new = 16
    samples, results = {}, []
    for engine in ("static", "paged"):
        cfg = RolloutConfig(max_new_tokens=new, mode="sparse", dense_layers=(0,), max_budget=64,
                            prefill_chunk=64, engine=engine, chunk_steps=8, stop_token_ids=(),
                            record_topk=0)
        label = f"rollout tiny Qwen3 sparse, {engine} engine"
        try:
            t0 = time.perf_counter()
            traj = generate(model, prompts, plens, cfg=cfg, budgets=budgets, bin_size=16,
                            group_size=2, rng=jax.random.key(0))
            toks = np.asarray(jax.block_until_ready(traj.tokens))
            ms = (time.perf_counter() - t0) * 1e3
            lengths, logp = np.asarray(traj.response_lengths), np.asarray(traj.logprobs)
            mask = np.asarray(traj.mask)
            why = ""
            if toks.shape != (4, new) or not (lengths == new).all():
                why = f"expected 4 rows of {new} tokens, got {toks.shape}, lengths {lengths}"
            elif toks.min() < 0 or toks.max() >= 64 or not np.isfinite(logp[mask]).all():
                why = "token ids out of the vocabulary or non-finite logprobs"
            samples[engine] = toks
            results.append(Result(label, "auto", "FAIL" if why else "PASS",
                                  why or f"4 x {new} tokens (incl. compile)", ms))
        except Exception as e:  # noqa: BLE001
            results.append(Result(label, "auto", "FAIL",
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    if len(samples) == 2:
        same = float((samples["static"] == samples["paged"]).mean())
        # Bit-identical samples hold on CPU; on accelerators GEMM tiling by row count can change
        # low bits, so sampled paths may diverge without a bug (reported, not failed).
        ok = same == 1.0 or platform != "cpu"
        results.append(Result("rollout static vs paged samples", "auto",
                              "PASS" if ok else "FAIL",
                              f"{same:.0%} of tokens equal" + ("" if platform == "cpu" else
                                                              " (need not be 100% here)")))
    return results


def format_table(results: list[Result]) -> str:
    head = f"{'check':<42} {'backend':<14} {'result':<6} {'ms':>9} {'copy BW':>7}  detail"
    lines = [head, "-" * len(head)]
    for r in results:
        ms = f"{r.ms:9.2f}" if r.ms is not None else " " * 9
        bw = f"{r.bw_frac:7.0%}" if r.bw_frac is not None else " " * 7
        lines.append(f"{r.check:<42} {r.backend:<14} {r.status:<6} {ms} {bw}  {r.detail}")
    return "\n".join(lines)


def check_selection(platform: str, only: tuple[str, ...] = ()) -> list[Result]:
    """Block selection as one Pallas Triton kernel against its XLA form: the ids must be equal
    (a wrong id is a silently wrong rollout, not a crash). Ties included. GPU: the 1.7B decode
    rows at an 8K cache (32 rows x 513 blocks, 64 selected); CPU: interpret mode, small."""
    from sparrow_jax.sparsity import selection
    rows, nb, width = (32, 513, 64) if platform != "cpu" else (4, 24, 8)
    rng = np.random.default_rng(7)
    scores = rng.integers(0, 50, (rows, nb)).astype(np.float32)        # many ties
    lengths = rng.integers(0, nb * BLOCK + 1, rows).astype(np.int32)
    budgets = rng.integers(3, width + 1, rows).astype(np.int32)
    args = tuple(jnp.asarray(a) for a in (scores, lengths, budgets))
    want = selection.select_from_scores(*args, max_selected=width)
    label = f"block selection {rows} x {nb} -> {width}"
    results = []
    for name, interpret, skip in backends_for(platform):
        if name != "pallas_triton" or (only and name not in only):
            continue
        if skip:
            results.append(Result(label, name, "SKIP", skip))
            continue
        fn = jax.jit(lambda *a, interpret=interpret: selection.select_from_scores(
            *a, max_selected=width, backend="pallas_triton", interpret=interpret))
        try:
            got, ms = _time(fn, args, 1 if interpret else 10)
            same = all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))
            why = "" if same else "ids differ from the XLA selection"
        except Exception as e:  # noqa: BLE001 - a crashing kernel is a FAIL row
            ms, why = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        results.append(Result(label, name, "FAIL" if why else "PASS",
                              why or ("same ids as xla" + (" (interpret)" if interpret else "")),
                              ms))
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip_rollout", action="store_true", help="kernels only")
    parser.add_argument("--backends", default="",
                        help="comma-separated kernel backends to check (default: all)")


def main(args: argparse.Namespace) -> int:
    platform = pk.dispatch.current_platform()
    devices = jax.devices()
    print(f"device: {len(devices)} x {devices[0].device_kind} (platform {platform}, "
          f"jax {jax.__version__})", flush=True)
    copy_bw = None
    if platform != "cpu":
        copy_bw = copy_bandwidth(1 << 28, 5)
        print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (kernel 'copy BW' = its bytes / time "
              "as a fraction of this)")
        print(f"bf16 matrix rate: {matmul_rate() / 1e12:.0f} TFLOP/s (8192^3 products on "
              "random data: the learner's FLOP/s is a share of this)", flush=True)
    only = tuple(b for b in getattr(args, "backends", "").split(",") if b)
    unknown = set(only) - set(pk.BACKENDS)
    if unknown:
        raise SystemExit(f"sparrow doctor: unknown --backends {sorted(unknown)}; choose from "
                         f"{pk.BACKENDS[2:]}")
    results = check_kernels(platform, copy_bw, only) + check_selection(platform, only)
    if not getattr(args, "skip_rollout", False):
        results += check_rollout(platform)
    print(format_table(results))
    failed = [r for r in results if r.status == "FAIL"]
    print(f"doctor: {'FAIL' if failed else 'PASS'} ({len(failed)} failed, "
          f"{sum(r.status == 'PASS' for r in results)} passed, "
          f"{sum(r.status == 'SKIP' for r in results)} skipped)")
    return 1 if failed else 0
