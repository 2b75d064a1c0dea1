"""Cost model of exact sparse rollout (draft gamma tokens sparse, verify densely), and the choice
of gamma and the per-bin budget for the best predicted throughput (issue 42).

One verify round of a sequence at context ``ctx`` costs, in the eFLOPs of cost_model.py:

- draft: ``gamma`` sparse decode steps at the bin's budget (``decode_token_cost``);
- verify: one dense pass of ``gamma + 1`` tokens: the linear layers' FLOPs for each token but
  their weights read once, attention FLOPs for each token, and the whole KV read once.

It yields E = (1 - a^(gamma+1)) / (1 - a) tokens on average at acceptance rate a (alpha of the
budget at that length), so the cost per token is (draft + verify) / E. The engine runs one
static gamma per run and a traced budget per bin: `plan_exact` picks, for each candidate gamma,
the cheapest budget per bin, then the gamma whose run is cheapest over the bins' weights.
A fixed gamma (``gammas=(4,)``) is the simple setting.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from sparrow_jax.sparsity.cost_model import (Hardware, ModelShape, _model, decode_token_cost,
                                             get_hardware)
from sparrow_jax.sparsity.schedule import DENSE_BUDGET


def tokens_per_pass(alpha: Any, gamma: int) -> np.ndarray:
    """(1 - a^(gamma+1)) / (1 - a) (gamma + 1 at a = 1): expected tokens per verify round."""
    a = np.asarray(alpha, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (1.0 - a ** (gamma + 1)) / (1.0 - a)
    return np.where(a >= 1.0, gamma + 1.0, out)


def exact_token_eflops(model: ModelShape | str, hardware: Hardware | str, ctx: Any, budget: Any,
                       alpha: Any, gamma: int, *, block_size: int = 16,
                       batch: int = 1) -> dict[str, np.ndarray]:
    """Per generated token of one sequence: ``draft``, ``verify`` and ``total`` eFLOPs and the
    dense decode's ``dense`` eFLOPs at the same ctx ([N] arrays), plus ``tokens_per_pass``."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    m, hw = _model(model), get_hardware(hardware)
    ctx = np.asarray(ctx, np.float64)
    sparse = decode_token_cost(m, ctx, budget, block_size=block_size, batch=batch)
    dense = decode_token_cost(m, ctx, DENSE_BUDGET, block_size=block_size, batch=batch)
    e_sparse = sparse["flops"] + hw.intensity * sparse["bytes"]
    e_dense = dense["flops"] + hw.intensity * dense["bytes"]
    verify = ((gamma + 1) * (dense["linear_flops"] + dense["attn_flops"])
              + hw.intensity * (dense["linear_bytes"] + dense["kv_bytes"]))
    e = tokens_per_pass(alpha, gamma)
    draft = gamma * e_sparse
    return {"draft": draft / e, "verify": verify / e, "total": (draft + verify) / e,
            "dense": e_dense, "tokens_per_pass": np.broadcast_to(e, ctx.shape)}


def plan_exact(model: ModelShape | str, hardware: Hardware | str, bin_ctx: Sequence[float],
               alpha_by_budget: Mapping[int, Sequence[float]], *,
               gammas: Sequence[int] = (4,), weights: Sequence[float] | None = None,
               block_size: int = 16, batch: int = 256) -> dict[str, Any]:
    """The best gamma (one per run) and budget per bin for exact sparse rollout.

    bin_ctx [num_bins]: a representative context per length bin (e.g. its middle);
    alpha_by_budget: budget (tokens) -> [num_bins] measured alpha at that budget (calibration);
    weights [num_bins]: tokens generated per bin (default equal).
    Returns {"gamma", "budgets" [num_bins], "speedup" (dense / exact cost over the weights),
    "per_gamma": [{"gamma", "budgets", "speedup", "bin_speedup" [num_bins]}]}.
    """
    ctx = np.asarray(bin_ctx, np.float64)
    w = np.ones_like(ctx) if weights is None else np.asarray(weights, np.float64)
    if not alpha_by_budget or any(len(a) != len(ctx) for a in alpha_by_budget.values()):
        raise ValueError(f"alpha_by_budget needs one alpha per bin ({len(ctx)}) for each budget")
    budgets = sorted(alpha_by_budget)
    per_gamma = []
    for g in gammas:
        costs = np.stack([exact_token_eflops(model, hardware, ctx, b, alpha_by_budget[b], g,
                                             block_size=block_size, batch=batch)["total"]
                          for b in budgets])                                  # [K, bins]
        dense = exact_token_eflops(model, hardware, ctx, budgets[0], 1.0, g,
                                   block_size=block_size, batch=batch)["dense"]
        best = np.argmin(costs, axis=0)
        chosen = costs[best, np.arange(len(ctx))]
        per_gamma.append({"gamma": int(g), "budgets": [int(budgets[i]) for i in best],
                          "speedup": float(np.dot(w, dense) / np.dot(w, chosen)),
                          "bin_speedup": (dense / chosen).tolist()})
    top = max(per_gamma, key=lambda r: r["speedup"])
    return {"gamma": top["gamma"], "budgets": top["budgets"], "speedup": top["speedup"],
            "per_gamma": per_gamma}
