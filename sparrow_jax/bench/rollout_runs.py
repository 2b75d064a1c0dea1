"""The sparse runs `sparrow bench rollout` compares with dense at each context: every budget or
schedule x dense-layer set (x the former selection with --before, x XLA's selection with
--xla_selection), and the swap that times the former selection."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SparseRun:
    """One sparse configuration compared against the dense run of the same context."""
    label: str                      # budget in tokens, or the schedule's name
    budgets: np.ndarray             # [num_bins] tokens
    bin_size: int
    dense_layers: tuple[int, ...]
    fixed: bool                     # one budget for every bin
    before: bool = False            # the former selection (top_k + sort) and top-20 record
    xla_selection: bool = False     # block selection in XLA where it would be one kernel

    @property
    def key(self) -> str:
        tail = (":before" if self.before else "") + (":xla_selection" if self.xla_selection
                                                     else "")
        return f"sparse:{self.label}:{','.join(map(str, self.dense_layers)) or 'none'}{tail}"


BEFORE_TOPK = 20     # the per-step vocabulary record every rollout made before issue 30


@contextlib.contextmanager
def former_selection(active: bool):
    """The engines select blocks through `selection.select_from_scores`, looked up when a program
    is traced: swapped for the former top_k + sort while a --before program compiles and runs."""
    from sparrow_jax.sparsity import selection
    saved = selection.select_from_scores

    def former(scores, lengths, budget_blocks, *, max_selected, block_size=16, **_):
        # XLA only, as it was: the backend / radix / interpret choices of today's form go
        return selection.select_from_scores_reference(scores, lengths, budget_blocks,
                                                      max_selected=max_selected,
                                                      block_size=block_size)
    if active:
        selection.select_from_scores = former
    try:
        yield
    finally:
        selection.select_from_scores = saved


def sparse_config(base_cfg, v: SparseRun, context: int, new_tokens: int):
    """(the RolloutConfig, the [num_bins] budget table) of sparse run `v` at `context` tokens.
    The static selection width is the largest budget this context reaches (the trainer's rule,
    RolloutConfig.fit_selection_width): a wider one gathers padding blocks every step. Bins
    beyond reach are never looked up: they take the last reachable bin's budget."""
    from sparrow_jax.rollout.config import padded_length
    last_bin = min(context // v.bin_size, len(v.budgets) - 1)
    reachable = v.budgets[: last_bin + 1]
    budgets = np.concatenate([reachable, np.repeat(reachable[-1:], len(v.budgets) - last_bin
                                                   - 1)]).astype(np.int32)
    cfg = dataclasses.replace(base_cfg, mode="sparse", max_budget=max(
        base_cfg.max_budget, padded_length(int(reachable.max()), base_cfg.block_size)),
        max_new_tokens=new_tokens, dense_layers=v.dense_layers,
        selection="xla" if v.xla_selection else base_cfg.selection)
    cfg, _ = cfg.fit_selection_width(reachable)
    return cfg, budgets


def selection_path(cfg) -> str:
    """Where a sparse program's block selection runs: "pallas_triton" (one kernel) or "xla"."""
    from sparrow_jax.sparsity import selection
    return selection.selection_backend(cfg.selection_backend)


def _dense_layer_sets(specs: Sequence[str] | None, default: tuple[int, ...]
                      ) -> list[tuple[int, ...]]:
    if specs is None:
        return [tuple(default)]
    return [() if s.strip().lower() in ("", "none") else tuple(int(x) for x in s.split(","))
            for s in specs]


def schedule_arg(spec: str):
    """`--schedule`: a name, a JSON table, or "config" - the gin files' `make_schedule` (a
    shipped config's schedule, e.g. configs/qwen3_1p7b_gpu.gin's qwen3-1.7b-0.86)."""
    from sparrow_jax.sparsity.schedule import resolve_schedule
    return resolve_schedule(None if spec.strip() == "config" else spec)


def sparse_runs(args: argparse.Namespace, default_dense_layers: tuple[int, ...]
                ) -> list[SparseRun]:
    """Every (budget or schedule) x (dense layer set) to compare with dense."""
    budgets = args.budget if args.budget is not None else ([] if args.schedule else [1024])
    tables = [(str(b), np.full(20, b, np.int32), 2000, True) for b in budgets]
    if args.schedule:
        s = schedule_arg(args.schedule)
        tables.append((s.name or "schedule", np.asarray(s.budgets, np.int32), s.bin_size, False))
    runs = [SparseRun(label, b, bin_size, layers, fixed, before)
            for layers in _dense_layer_sets(args.dense_layers, default_dense_layers)
            for label, b, bin_size, fixed in tables
            for before in ((False, True) if getattr(args, "before", False) else (False,))]
    if getattr(args, "xla_selection", False):
        runs += [dataclasses.replace(r, xla_selection=True) for r in runs if not r.before]
    return runs
