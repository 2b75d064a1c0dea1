"""Held-out evaluation under dense and sparse decoding (responses decoded and scored by
sparrow_jax.rewards.scoring, as in the train loop)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np

from sparrow_jax.evaluation import metrics
from sparrow_jax.rewards import scoring
from sparrow_jax.rewards.pool import RewardPool
from sparrow_jax.rollout import RolloutConfig
from sparrow_jax.rollout.api import generate_timed
from sparrow_jax.runtime import multihost
from sparrow_jax.runtime.sharding import ShardingSpec


def batch_records(records: Sequence[dict[str, Any]], pad_id: int, *, rows: int | None = None,
                  filler: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prompt records (data.prompts format) -> a right-padded batch like PromptIterator yields.

    rows: pad the batch to this many rows with copies of `filler` (default: the first record):
    a real prompt, so the padded rows prefill and decode like any other. `valid` [rows] bool
    marks the real rows; `evaluate` masks the others out of every metric.
    """
    rows = len(records) if rows is None else rows
    if rows < len(records):
        raise ValueError(f"rows={rows} is fewer than the {len(records)} records")
    filler = filler if filler is not None else (records[0] if records else None)
    if rows > len(records) and filler is None:
        raise ValueError("padding an empty record list needs a filler record")
    padded = list(records) + [filler] * (rows - len(records))
    if not padded:
        raise ValueError("batch_records: no records")
    lengths = np.asarray([len(r["prompt_ids"]) for r in padded], np.int32)
    ids = np.full((rows, int(lengths.max())), pad_id, np.int32)
    for i, r in enumerate(padded):
        ids[i, :lengths[i]] = r["prompt_ids"]
    return {"prompt_ids": ids, "prompt_lengths": lengths,
            "answers": [r["answer"] for r in padded], "prompts": [r["prompt"] for r in padded],
            "metas": [r.get("meta") for r in padded],
            "valid": np.arange(rows) < len(records)}


def data_shards(spec: ShardingSpec | None) -> int:
    """How many ways the rows of a rollout batch are split (the mesh's batch axis; 1 unsharded)."""
    if spec is None:
        return 1
    return int(spec.mesh.shape[spec.rules.get("batch") or "data"])


def shard_eval_batch(records: Sequence[dict[str, Any]], pad_id: int,
                     spec: ShardingSpec | None = None) -> dict[str, Any]:
    """This process's share of the held-out `records` as one batch.

    Process p takes records p, p + P, ... (P processes). Every process gets the same row count,
    padded so that the global batch divides the data axis (the rollout shards rows over it);
    with 5 prompts on an 8-way data axis that is 8 rows, 3 of them masked padding.
    """
    if not records:
        raise ValueError("no held-out prompts to evaluate")
    n_proc = jax.process_count()
    unit = math.lcm(data_shards(spec), n_proc)
    total = -(-len(records) // unit) * unit
    mine = list(records[jax.process_index()::n_proc])
    return batch_records(mine, pad_id, rows=total // n_proc, filler=records[0])


def evaluate(model, tokenizer, pool: RewardPool, batch: dict[str, Any], *, cfg: RolloutConfig,
             budgets, bin_size: int, rng, spec=None, diagnostics: dict[str, RewardPool] | None = None,
             samples: int = 1) -> dict[str, float]:
    """One pass over held-out prompts in cfg.mode; reward, length and tokens/s over the rows that
    `batch["valid"]` marks real (all rows when the batch has no mask).

    samples > 1: that many samples per prompt, and also `avg@n` and the unbiased `pass@k` for
    k = 1, 2, 4, ... <= n with standard errors over prompts (sparrow_jax.evaluation.metrics, as
    `sparrow eval` computes them; a sample is correct when its reward is > 0).

    The program is compiled by a first call, so callers that compare speeds should evaluate
    each mode once before timing (the train loop's evaluations after the first do that).
    """
    traj, seconds = generate_timed(model, batch["prompt_ids"], batch["prompt_lengths"], cfg=cfg,
                                   budgets=budgets, bin_size=bin_size, group_size=samples,
                                   rng=rng, spec=spec)
    texts = scoring.decode_responses(tokenizer, traj)
    if samples > 1:     # rows are prompt-major groups: repeat the per-prompt fields
        batch = {**{k: [x for x in batch[k] for _ in range(samples)]
                    for k in ("answers", "prompts", "metas")},
                 "valid": np.repeat(np.asarray(batch.get("valid", np.ones(len(texts) // samples,
                                                                          bool)), bool), samples)}
    # Padding rows (batch["valid"] False, see shard_eval_batch) are neither scored nor counted.
    valid = np.asarray(batch.get("valid", np.ones(len(texts), bool)), bool)
    keep = np.flatnonzero(valid)

    def scored(reward_pool: RewardPool) -> np.ndarray:
        out = np.zeros(len(texts), np.float32)  # same shape on every process, for all_rows
        if keep.size:
            out[keep] = scoring.score(reward_pool, [texts[i] for i in keep],
                                      [batch["answers"][i] for i in keep],
                                      [batch["prompts"][i] for i in keep],
                                      [batch["metas"][i] for i in keep]).rewards
        return multihost.all_rows(out)

    # Means over every process's real prompts.
    mask = multihost.all_rows(valid)
    lengths = multihost.all_rows(multihost.local_rows(traj.response_lengths))[mask]
    rewards = scored(pool)
    out = {"reward": float(rewards[mask].mean()), "response_length": float(lengths.mean()),
           "tokens_per_s": float(lengths.sum() / seconds), "seconds": seconds}
    if samples > 1:
        correct = (rewards[mask] > 0).reshape(-1, samples)
        ks = [k for k in (2 ** i for i in range(samples.bit_length())) if k <= samples]
        per = [metrics.problem_metrics(list(c), [None] * samples, ks) for c in correct]
        out.update({k: v for k, v in metrics.aggregate(per, samples).items()
                    if not k.startswith("maj@")})
    for name, diag in (diagnostics or {}).items():
        out[f"reward_{name}"] = float(scored(diag)[mask].mean())
    return out


def short_line(d: dict[str, float], modes: Sequence[str] = ("dense", "sparse")) -> str:
    """One short console line per evaluation (the full dict is in metrics.jsonl/TensorBoard)."""
    def pair(key: str, spec: str) -> str:
        return " / ".join(format(d[f"eval_{m}/{key}"], spec) for m in modes
                          if f"eval_{m}/{key}" in d)
    speed = pair("tokens_per_s", ".0f")   # absent at step 0 (that evaluation compiles)
    return (f"reward {' / '.join(modes)} {pair('reward', '.3f')}, length "
            f"{pair('response_length', '.0f')}" + (f", {speed} tokens/s" if speed else ""))


# Below this p(T=1 sample = reference) prints as 0.0000: the summary gives log p instead.
UNDERFLOW_P = 5e-5


def summary_lines(first: dict[str, float], last: dict[str, float],
                  modes: Sequence[str] = ("dense", "sparse")) -> tuple[list[str], dict[str, float]]:
    """The end-of-run summary: held-out reward per decoding mode (first -> last) and the
    measured speed of the actor's mode vs dense. Returns (lines, last + the speed ratio)."""
    lines = []

    def start(key: str, spec: str) -> str:      # no step-0 evaluation (eval_at_start = False)
        return format(first[key], spec) if key in first else "(not evaluated at step 0)"
    for mode in modes:
        key = f"eval_{mode}/reward"
        if key in last:
            lines.append(f"held-out reward ({mode} decoding): {start(key, '.3f')} "
                         f"-> {last[key]:.3f}")
    for mode in modes:      # teacher-forced reference metrics (sparrow_jax.evaluation.reference)
        key = f"eval_{mode}/ref_p_exact"
        if key not in last:
            continue
        greedy = (f"greedy reproduces it: {start(f'eval_{mode}/ref_greedy', '.3f')} -> "
                  f"{last.get(f'eval_{mode}/ref_greedy', math.nan):.3f}")
        logp = f"eval_{mode}/ref_logp"
        if logp in last and max(last[key], first.get(key, 0.0)) < UNDERFLOW_P:
            # Long references (4.5K tokens: log p ~ -40) print 0.0000 -> 0.0000: give log p.
            lines.append(f"held-out log p(reference) ({mode}; p(T=1 sample = reference) < "
                         f"{UNDERFLOW_P:g}): {start(logp, '.2f')} -> {last[logp]:.2f} (+- "
                         f"{last.get(logp + '_se', math.nan):.2f}); {greedy}")
            continue
        lines.append(f"held-out p(T=1 sample = reference) ({mode}): "
                     f"{start(key, '.4f')} -> {last[key]:.4f} (+- "
                     f"{last.get(key + '_se', math.nan):.4f}); {greedy}")
    actor = modes[-1]
    if "eval_dense/tokens_per_s" in last and f"eval_{actor}/tokens_per_s" in last and (
            actor != "dense"):
        ratio = last[f"eval_{actor}/tokens_per_s"] / last["eval_dense/tokens_per_s"]
        lines.append(f"measured rollout speed, {actor} vs dense (same prompts, one run): "
                     f"{last[f'eval_{actor}/tokens_per_s']:.0f} vs "
                     f"{last['eval_dense/tokens_per_s']:.0f} tokens/s = {ratio:.2f}x")
        last = {**last, f"speedup_{actor}_over_dense": ratio}
    return lines, last
