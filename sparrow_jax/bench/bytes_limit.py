"""The bytes-limit columns of `sparrow bench rollout` (issue 55), for every workload.

A decode step must read its weights once, each row's KV as attended and the selection metadata
(`sparsity.cost_model.decode_step_bytes`); those bytes over the copy bandwidth measured in the
same run (`runtime.bandwidth.copy_bandwidth`) are the shortest time the step can take: its bytes
limit. A measured step's "% of the bytes limit" is that time over the measured one (100% = the
step runs at the copy kernel's bandwidth). Contexts and budgets are those each timed step
attended, looked up as the engines do (`rollout.state.budget_for_lengths`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from sparrow_jax.sparsity.cost_model import ModelShape, StepBytes, decode_step_bytes


def model_shape(mcfg, dtype: Any, dense_layers: Sequence[int]) -> ModelShape:
    """The cost model's shape of a `Qwen3Config` run in `dtype` (weights and KV alike), with
    the layers that stay dense in sparse decoding."""
    fields = {f.name: getattr(mcfg, f.name) for f in dataclasses.fields(mcfg)}
    return ModelShape.from_hf_config(fields, dense_layers=tuple(dense_layers),
                                     dtype_bytes=np.dtype(dtype).itemsize)


def budgets_at(budgets: np.ndarray, bin_size: int, contexts: np.ndarray) -> np.ndarray:
    """The schedule's budget of each context (tokens attended), the engines' bin lookup."""
    table = np.asarray(budgets)
    return table[np.minimum(np.asarray(contexts) // bin_size, len(table) - 1)]


def tokens_bytes(shape: ModelShape, contexts: np.ndarray, budgets: np.ndarray | None,
                 bin_size: int, *, steps: int, paged: bool) -> StepBytes:
    """The bytes of `steps` decode steps that attended `contexts` (every row of every step,
    flattened): the KV, centroids and metadata of each, the weights once per step.
    `budgets`: the schedule (sparse), or None (dense)."""
    ctx = np.asarray(contexts, np.int64).reshape(-1)
    per_token = decode_step_bytes(shape, ctx, None if budgets is None else
                                  budgets_at(budgets, bin_size, ctx), paged=paged)
    return dataclasses.replace(per_token, weights=per_token.weights * steps)


def mean_step_bytes(shape: ModelShape, contexts: np.ndarray, budgets: np.ndarray | None,
                    bin_size: int, *, paged: bool) -> StepBytes:
    """The mean bytes of one step over `contexts` [steps, rows]."""
    ctx = np.asarray(contexts, np.int64)
    total = tokens_bytes(shape, ctx, budgets, bin_size, steps=ctx.shape[0], paged=paged)
    n = ctx.shape[0]
    return StepBytes(*(getattr(total, f.name) / n for f in dataclasses.fields(StepBytes)))


def limit_fields(prefix: str, bytes_: StepBytes, bandwidth: float, seconds: float
                 ) -> dict[str, float]:
    """`<prefix>_bytes_*` (weights, kv, centroids, metadata, total), `<prefix>_limit_ms` and
    `<prefix>_pct_of_limit` (the bytes limit over the measured `seconds`, in %) for a JSON line."""
    limit = bytes_.limit_seconds(bandwidth)
    out = {f"{prefix}_bytes_{k}": v for k, v in bytes_.as_dict().items()}
    out[f"{prefix}_limit_ms"] = 1e3 * limit
    out[f"{prefix}_pct_of_limit"] = 100.0 * limit / seconds
    return out


def bytes_line(record: dict[str, Any], prefixes: Sequence[str], unit: str = "MB") -> str:
    """One line of bytes per step for each prefix: weights + KV + centroids + metadata =
    total, the limit and its share, from `limit_fields` records."""
    scale = {"MB": 1e6, "GB": 1e9}[unit]
    parts = []
    for p in prefixes:
        b = {k: record[f"{p}_bytes_{k}"] / scale
             for k in ("weights", "kv", "centroids", "metadata", "total")}
        parts.append(f"{p}: weights {b['weights']:.3f} + KV {b['kv']:.3f} + centroids "
                     f"{b['centroids']:.3f} + metadata {b['metadata']:.3f} = {b['total']:.3f} "
                     f"{unit} -> limit {record[f'{p}_limit_ms']:.3f} ms, "
                     f"{record[f'{p}_pct_of_limit']:.1f}% of it")
    return " | ".join(parts)
