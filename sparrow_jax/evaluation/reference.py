"""Held-out evaluation without sampling noise, for tasks with one correct output (the synthetic
task): one teacher-forced pass over each prompt's reference solution gives

  p_exact = prod_t p(ref_t | prompt, ref_<t)   the exact probability that a T=1 sample (no
                                               top-k/top-p truncation) equals the reference;
  greedy  = all_t ref_t = argmax p(. | ...)    whether greedy decoding reproduces it (exact up to
                                               logit ties: ``margin`` = the smallest
                                               ref-logit minus best-other-logit);

under the dense policy (dense attention) and under the sparse actor at a schedule (the rollout's
block selection replayed, ``teacher_forced.sparse_attention_fn``). Both are exact per prompt,
so their held-out means carry only the prompt-sampling error, and per-prompt values pair
across runs (``eval_reference.jsonl`` in the run directory).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.rollout.teacher_forced import map_time_chunks, replay_hidden
from sparrow_jax.rollout.config import RolloutMode

__all__ = ["ReferenceEvalConfig", "reference_batch", "score_references", "summarize"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ReferenceEvalConfig:
    """data: a JSONL prompt file whose rows carry the reference (`solution`, kept in `meta`);
    None = off. prompts: how many of its rows. rows_per_call: rows per compiled forward.
    query_chunk: queries per attention block of the sparse replay (0 = one block: a faster
    compile, [rows, heads, S, S] scores in memory)."""
    data: str | None = None
    prompts: int = 128
    rows_per_call: int = 16
    query_chunk: int = 0


def reference_batch(records: Sequence[dict[str, Any]], tokenizer, *, eos_id: int,
                    block_size: int = 16) -> Trajectories:
    """Prompt records with ``meta['solution']`` -> a teacher-forcing batch: response = the
    tokenized reference + <eos>, padded to a multiple of ``block_size``."""
    refs = []
    for r in records:
        sol = (r.get("meta") or {}).get("solution")
        if not isinstance(sol, str):
            raise ValueError(f"record {r.get('id')!r} has no reference solution (meta['solution'])")
        refs.append(list(tokenizer.encode(sol, add_special_tokens=False)) + [int(eos_id)])
    b = len(records)
    plens = np.asarray([len(r["prompt_ids"]) for r in records], np.int32)
    rlens = np.asarray([len(x) for x in refs], np.int32)
    p = int(plens.max())
    t = -(-int(rlens.max()) // block_size) * block_size
    prompt = np.zeros((b, p), np.int32)
    toks = np.zeros((b, t), np.int32)
    for i, r in enumerate(records):
        prompt[i, :plens[i]] = r["prompt_ids"]
        toks[i, :rlens[i]] = refs[i]
    mask = np.arange(t)[None] < rlens[:, None]
    zeros = np.zeros((b, t), np.float32)
    return Trajectories(prompt_tokens=jnp.asarray(prompt), prompt_lengths=jnp.asarray(plens),
                        tokens=jnp.asarray(toks), logprobs=jnp.asarray(zeros),
                        topk_logprobs=jnp.zeros((b, t, 1)), topk_ids=jnp.zeros((b, t, 1), jnp.int32),
                        budgets=jnp.zeros((b, t), jnp.int32),
                        cached_lengths=jnp.asarray(plens[:, None] + np.arange(t)[None]),
                        mask=jnp.asarray(mask), response_lengths=jnp.asarray(rlens))


@functools.partial(jax.jit, static_argnames=("graphdef", "bin_size", "max_selected",
                                             "block_size", "dense_layers", "sparse",
                                             "query_chunk"))
def _score(graphdef, state, traj, budgets, *, bin_size, max_selected, block_size, dense_layers,
           sparse, query_chunk):
    model = nnx.merge(graphdef, state)
    hidden = replay_hidden(model, traj, budgets if sparse else None, bin_size=bin_size,
                           max_selected=max_selected, block_size=block_size,
                           dense_layers=dense_layers, query_chunk=query_chunk)

    def chunk(h, tok):
        logits = model.logits(h).astype(jnp.float32)                       # [B, c, V]
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[..., None], -1)[..., 0]
        ref = jnp.take_along_axis(logits, tok[..., None], -1)[..., 0]
        other = jnp.max(jnp.where(jax.nn.one_hot(tok, logits.shape[-1], dtype=bool), -jnp.inf,
                                  logits), -1)
        return lp, ref - other
    lp, margin = map_time_chunks(chunk, 256, hidden, traj.tokens)
    m = traj.mask
    miss = m & (margin <= 0)
    first_miss = jnp.where(miss.any(-1), jnp.argmax(miss, -1), traj.response_lengths)
    return (jnp.sum(jnp.where(m, lp, 0.0), -1), jnp.min(jnp.where(m, margin, jnp.inf), -1),
            first_miss)


def score_references(model, traj: Trajectories, *, budgets=None, bin_size: int = 2000,
                     max_budget: int = 4096, block_size: int = 16,
                     dense_layers: tuple[int, ...] = (0, 1), rows_per_call: int = 16,
                     query_chunk: int = 0) -> dict[str, np.ndarray]:
    """Per row: ``logp`` (log p_exact at T=1), ``p_exact``, ``margin``, ``greedy``
    (margin > 0: greedy decoding reproduces the reference) and ``first_miss`` (the first
    response position where greedy leaves the reference; its length if never). budgets None = the dense policy,
    else the sparse actor at those per-bin budgets. Rows go ``rows_per_call`` at a time
    (the last call padded by repeating rows)."""
    graphdef, state = nnx.split(model)
    sparse = budgets is not None
    budgets = jnp.zeros((1,), jnp.int32) if budgets is None else jnp.asarray(
        np.minimum(np.asarray(budgets, np.int64), np.iinfo(np.int32).max), jnp.int32)
    b = int(traj.tokens.shape[0])
    rows_per_call = max(1, min(rows_per_call, b))
    logp, margin, first = [], [], []
    for start in range(0, b, rows_per_call):
        idx = np.minimum(np.arange(start, start + rows_per_call), b - 1)
        part = jax.tree.map(lambda x: x[idx], traj)
        lp, mg, fm = _score(graphdef, state, part, budgets, bin_size=bin_size,
                        max_selected=max_budget // block_size, block_size=block_size,
                        dense_layers=tuple(dense_layers), sparse=sparse, query_chunk=query_chunk)
        n = min(rows_per_call, b - start)
        logp.append(np.asarray(lp)[:n])
        margin.append(np.asarray(mg)[:n])
        first.append(np.asarray(fm)[:n])
    logp, margin = np.concatenate(logp), np.concatenate(margin)
    return {"logp": logp, "p_exact": np.exp(logp), "margin": margin, "greedy": margin > 0,
            "first_miss": np.concatenate(first)}


def summarize(scores: dict[str, np.ndarray]) -> dict[str, float]:
    """Means over prompts with their standard errors (prompts are the random unit)."""
    n = len(scores["p_exact"])
    out = {}
    for key, name in (("p_exact", "ref_p_exact"), ("greedy", "ref_greedy"), ("logp", "ref_logp")):
        x = np.asarray(scores[key], np.float64)
        out[name] = float(x.mean())
        out[f"{name}_se"] = float(x.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return out


def append_rows(path, step: int, mode: str, ids: Sequence[str],
                scores: dict[str, np.ndarray]) -> None:
    """One JSON line per (step, mode): prompt ids and per-prompt logp / greedy (for pairing)."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "mode": mode, "ids": list(ids),
                            "logp": [round(float(v), 6) for v in scores["logp"]],
                            "greedy": [bool(v) for v in scores["greedy"]]}) + "\n")


class ReferenceEvaluator:
    """The trainer's reference evaluation: the batch built once, scores per (step, mode) cached
    (a repeated evaluation of the same step and mode is not scored again), per-prompt rows
    appended to ``rows_path`` by process 0."""

    def __init__(self, config: ReferenceEvalConfig, records: Sequence[dict[str, Any]], tokenizer,
                 *, block_size: int, rows_path: str | None):
        self.config = config
        self.records = list(records)[:config.prompts]
        self.ids = [str(r.get("id", i)) for i, r in enumerate(self.records)]
        self.batch = reference_batch(self.records, tokenizer, eos_id=tokenizer.eos_token_id,
                                     block_size=block_size)
        self.rows_path = rows_path
        self._cache: dict[tuple[int, str], dict[str, float]] = {}

    def __call__(self, model, mode: str, step: int, *, budgets, bin_size: int, max_budget: int,
                 block_size: int, dense_layers: tuple[int, ...]) -> dict[str, float]:
        """mode "dense": the dense policy; "sparse": the actor at ``budgets``."""
        key = (step, mode)
        if key not in self._cache:
            scores = score_references(
                model, self.batch, budgets=None if mode == RolloutMode.DENSE else budgets,
                bin_size=bin_size, max_budget=max_budget, block_size=block_size,
                dense_layers=dense_layers, rows_per_call=self.config.rows_per_call,
                query_chunk=self.config.query_chunk)
            self._cache = {k: v for k, v in self._cache.items() if k[0] == step}
            self._cache[key] = summarize(scores)
            if self.rows_path and jax.process_index() == 0:
                append_rows(self.rows_path, step, mode, self.ids, scores)
        return self._cache[key]
