"""`sparrow bench rollout --engine paged`: dense vs block-sparse decode at fixed contexts on the
paged engine (the one `configs/qwen3_1p7b_gpu.gin` ships), beside the static engine's bench.

Each run is one whole paged rollout (`rollout.continuous.PagedRollout`) of `batch` samples of
one random prompt of (context - new_tokens) tokens: its prefill writes the prompt's pages once,
shared by every sample, and decode chunks of `RolloutConfig.chunk_steps` steps follow until
every sample has `new_tokens` tokens. The chunks run one at a time (`overlap_chunks` off), so
each chunk's wall time, from its dispatch to its records read back, is decode time alone; their
sum over the rollout, divided by the steps the chunks ran, is the decode step's time. Prefill
and the host's bookkeeping between chunks are reported apart (`prefill_s`: a run's wall time
outside its chunks). One untimed run per program compiles it; then `--repeats` timed runs,
dense and sparse interleaved (median).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

import jax
import numpy as np

from sparrow_jax.bench import bytes_limit
from sparrow_jax.bench.rollout_runs import SparseRun, selection_path, sparse_config
from sparrow_jax.rollout import continuous
from sparrow_jax.rollout.state import check_budgets, prepare_prompts


class ChunkTimedRollout(continuous.PagedRollout):
    """A paged rollout that records each decode chunk's wall time, from its dispatch to its
    records read back (`chunk_seconds`). Meant for `overlap_chunks = False`: one chunk in
    flight at a time, so the times are decode time and add up."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_seconds: list[float] = []
        self.chunk_started = 0.0

    def decode(self, budgets, pending=None):
        t0 = time.perf_counter()
        chunk = super().decode(budgets, pending)
        if chunk is not None:
            self.chunk_started = t0
        return chunk

    def harvest(self, chunk, idle: bool) -> None:
        super().harvest(chunk, idle)
        self.chunk_seconds.append(time.perf_counter() - self.chunk_started)


def timed_rollout(model, prompt: np.ndarray, lengths: np.ndarray, cfg, budgets, bin_size: int,
                  group: int, key) -> tuple[float, ChunkTimedRollout]:
    """(wall seconds, the finished rollout) of one paged rollout."""
    t0 = time.perf_counter()
    budgets = check_budgets(cfg, budgets)
    tokens, lens = prepare_prompts(prompt, lengths, cfg=cfg, group_size=group, spec=None)
    ro = ChunkTimedRollout(model, tokens, lens, cfg=cfg, group_size=group, rng=key, spec=None)
    ro.run(budgets, bin_size)
    return time.perf_counter() - t0, ro


def bench_context(model, context: int, args, base_cfg, variants: Sequence[SparseRun],
                  bandwidth: float) -> list[dict[str, Any]]:
    """Dense + every sparse variant at one context on the paged engine; one result dict per
    variant, with the bytes-limit fields (`bench.bytes_limit`) of both."""
    from sparrow_jax.rollout.config import padded_length
    batch, new_tokens = args.batch, args.new_tokens
    if context <= new_tokens + 1:
        raise SystemExit(f"sparrow bench rollout: --context {context} must exceed --new_tokens "
                         f"{new_tokens} + 1")
    if any(v.before for v in variants) or getattr(args, "profile", None):
        raise SystemExit("sparrow bench rollout: --before and --profile time the static engine "
                         "only (drop --engine paged)")
    rng = np.random.default_rng(args.seed)
    plen = context - new_tokens
    prompt = np.zeros((1, padded_length(plen, base_cfg.block_size)), np.int32)
    prompt[0, :plen] = rng.integers(1, model.config.vocab_size, plen)
    lengths = np.asarray([plen], np.int32)
    key = jax.random.key(args.seed)
    paged = dataclasses.replace(base_cfg, engine="paged", overlap_chunks=False,
                                max_new_tokens=new_tokens)
    progs: dict[str, tuple[Any, np.ndarray, int]] = {
        "dense": (dataclasses.replace(paged, mode="dense"), np.full(20, 1 << 20, np.int32), 2000)}
    for v in variants:
        cfg, budgets = sparse_config(paged, v, context, new_tokens)
        progs[v.key] = (cfg, budgets, v.bin_size)

    def run(name: str) -> tuple[float, ChunkTimedRollout]:
        cfg, budgets, bin_size = progs[name]
        return timed_rollout(model, prompt, lengths, cfg, budgets, bin_size, batch, key)

    first = {name: run(name)[0] for name in progs}        # compiles every program
    decode_s: dict[str, list[float]] = {name: [] for name in progs}
    other_s: dict[str, list[float]] = {name: [] for name in progs}
    steps: dict[str, int] = {}
    for _ in range(args.repeats):
        for name in progs:       # interleaved: background load affects dense and sparse alike
            wall, ro = run(name)
            decode_s[name].append(sum(ro.chunk_seconds))
            other_s[name].append(wall - sum(ro.chunk_seconds))
            steps[name] = len(ro.chunk_seconds) * progs[name][0].chunk_steps

    def rate(name: str) -> dict[str, float]:
        t = statistics.median(decode_s[name])
        return {"tok_s": batch * (new_tokens - 1) / t, "ms_per_step": 1e3 * t / steps[name],
                "s_per_step": t / steps[name]}

    dense = rate("dense")
    results = []
    for v in variants:
        sparse = rate(v.key)
        cfg, budgets, bin_size = progs[v.key]
        shape = bytes_limit.model_shape(model.config, model.dtype, v.dense_layers)
        ctx = plen + 1 + np.repeat(np.arange(steps[v.key])[:, None], batch, axis=1)
        results.append({
            "engine": "paged", "chunk_steps": cfg.chunk_steps, "steps": steps[v.key],
            "context": context, "prompt_tokens": plen,
            "budget": int(v.budgets[0]) if v.fixed else None,
            "schedule": None if v.fixed else v.label, "bin_size": v.bin_size,
            "dense_layers": list(v.dense_layers), "before": False,
            "xla_selection": v.xla_selection, "selection": selection_path(cfg),
            "record_topk": cfg.record_topk,
            "dense_tok_s": dense["tok_s"], "sparse_tok_s": sparse["tok_s"],
            "ratio": sparse["tok_s"] / dense["tok_s"],
            "dense_ms_per_step": dense["ms_per_step"], "sparse_ms_per_step": sparse["ms_per_step"],
            "prefill_s": statistics.median(other_s[v.key]),
            "first_run_s": {name: round(first[name], 2) for name in ("dense", v.key)},
            "copy_bw_gbs": bandwidth / 1e9,
            **bytes_limit.limit_fields("dense", bytes_limit.mean_step_bytes(
                shape, ctx, None, bin_size, paged=True), bandwidth, dense["s_per_step"]),
            **bytes_limit.limit_fields("sparse", bytes_limit.mean_step_bytes(
                shape, ctx, budgets, bin_size, paged=True), bandwidth, sparse["s_per_step"]),
        })
    return results
