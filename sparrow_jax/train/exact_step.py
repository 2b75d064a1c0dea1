"""`sparrow train` with `TrainConfig.rollout_mode = "exact_sparse"` (rollout/exact.py): the step
metrics that show the samples are the dense policy's (the drafts' selection width is the run
plan's, train/plan.py).

Exact sparse rollout samples from the dense policy (sparse drafts, dense verify), and records
the dense logprobs. So the learner needs no mismatch correction: its TIS weights are 1 up to f32
rounding, no token is rejected and no sequence vetoed; the step checks this (`exact/*`
metrics beside the learner's `loss/tis_*`). The controller does not run (there is no mismatch
tail to control): the drafts use the schedule's budgets as they are.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sparrow_jax.rollout import exact
from sparrow_jax.rollout.state import Trajectories
from sparrow_jax.runtime import multihost
from sparrow_jax.train import schedule_step


def _global(x) -> np.ndarray:
    """Every process's rows of a [B, ...] trajectory array."""
    return multihost.all_rows(multihost.local_rows(x))


def acceptance_rows(traj: Trajectories, *, gamma: int | Sequence[int], bin_size: int
                    ) -> list[dict]:
    """Every process's verified rounds per length bin (`exact.acceptance_by_bin_arrays`),
    each row's last round left out (a stop or the length cap may have cut it short)."""
    acc, alpha, mask, cached, used = (_global(traj.accepted), _global(traj.alpha),
                                      _global(traj.mask), _global(traj.cached_lengths),
                                      _global(traj.budgets))
    return exact.acceptance_by_bin_arrays(acc, alpha, mask & (used == 0), cached, gamma=gamma,
                                          bin_size=bin_size, drop_last_round=True)


def acceptance_metrics(traj: Trajectories, budgets, *, gamma: int | Sequence[int],
                       bin_size: int, num_layers: int, num_sparse_layers: int,
                       rows: list[dict] | None = None) -> dict[str, float]:
    """Per length bin: the measured tokens per verify pass, the alpha prediction
    (1 - a^(gamma+1)) / (1 - a) from the bin's mean alpha, the mean alpha and the rounds; and
    overall: the share of tokens accepted from the draft, the mean alpha, and the whole model's
    KV read relative to dense decoding, `exact/kv_read_model` = (gamma x the drafts' read at
    the schedule's `budgets` [num_bins] + 1 dense verify) / tokens per pass (above 1 when
    drafts are rejected more than they save: `kv/read_*` count the samples' dense reads).
    gamma: one, or per bin (`RolloutConfig.gamma_by_bin`): then the gamma in that formula is
    the rounds' mean, and `exact_gamma/bin_xx` records each bin's.
    Rounds counted: each row's verified rounds but its last, which a stop token or the length
    cap may have cut short (a cut round counted as a full one lowers the mean: 1-3% at 63
    tokens a row, docs/benchmarks.md); a row's unverified tokens (approximate bins, which
    record their budget) are no rounds. `exact/approximate_frac`: their share of the tokens.
    rows: `acceptance_rows` of traj, when the caller has them."""
    acc, alpha, mask, cached, used = (_global(traj.accepted), _global(traj.alpha),
                                      _global(traj.mask), _global(traj.cached_lengths),
                                      _global(traj.budgets))
    verified = mask & (used == 0)
    if rows is None:
        rows = acceptance_rows(traj, gamma=gamma, bin_size=bin_size)
    m: dict[str, float] = {}
    for r in rows:
        b = f"bin_{r['bin']:02d}"
        m[f"exact_tokens_per_pass/{b}"] = r["tokens_per_pass"]
        m[f"exact_predicted/{b}"] = r["predicted"]
        m[f"exact_alpha/{b}"] = r["mean_alpha"]
        m[f"exact_rounds/{b}"] = float(r["rounds"])
        if np.ndim(gamma):
            m[f"exact_gamma/{b}"] = float(r["gamma"])
    rounds = sum(r["rounds"] for r in rows)
    mean_gamma = sum(r["rounds"] * r["gamma"] for r in rows) / max(rounds, 1)
    tokens = sum(r["rounds"] * r["tokens_per_pass"] for r in rows)
    finite = np.isfinite(alpha) & mask
    per_pass = tokens / max(rounds, 1)
    budgets = np.asarray(budgets)
    per_token = budgets[np.minimum(cached // bin_size, len(budgets) - 1)]
    draft = schedule_step.kv_read(per_token, cached, mask, num_layers=num_layers,
                                  num_sparse_layers=num_sparse_layers, bin_size=bin_size,
                                  num_bins=len(budgets))["kv/read_model"]
    m.update({"exact/tokens_per_pass": per_pass,
              "exact/kv_read_model": (mean_gamma * draft + 1.0) / per_pass,
              "exact/approximate_frac": float((mask & ~verified).sum() / max(mask.sum(), 1)),
              "exact/accepted_frac": float(acc[mask].mean()) if mask.any() else float("nan"),
              "exact/alpha_mean": float(alpha[finite].mean()) if finite.any() else float("nan")})
    return m


def logprob_agreement(traj: Trajectories, logp_old) -> dict[str, float]:
    """max |recorded logprob - the learner's dense logprob| over verified tokens: the recorded
    logprobs are the dense policy's, so this is f32 rounding (TIS weight exp(diff) = 1). An
    approximate bin's tokens (`RolloutConfig.approximate_from_bin`; they record their budget)
    carry the draft's logprob, which the learner's TIS corrects as in sparse mode: left out."""
    verified = _global(traj.mask) & (_global(traj.budgets) == 0)
    diff = np.abs(_global(traj.logprobs) - _global(logp_old))
    return {"exact/logp_max_abs_diff": float(diff[verified].max()) if verified.any() else 0.0}
