"""Cost model of exact sparse rollout (draft gamma tokens sparse, verify densely), and the choice
of gamma and the draft budget per length bin for the best predicted throughput (issue 42).

A verify round of a sequence in a bin drafts ``gamma`` tokens at a budget ``b`` and verifies
them in one dense pass; when each draft is accepted with probability a - for sampled decoding
alpha of the budget in the bin, for greedy decoding the rate at which the draft's and the
dense argmax agree (alpha is not an acceptance probability there) - it yields
E = (1 - a^(gamma+1)) / (1 - a) tokens on average and costs
gamma * c_draft(b) + c_verify(gamma). Dense decoding yields 1 token per c_dense. `choose_per_bin`
picks per bin the (gamma, budget) with the most tokens per unit cost, dense (gamma 0, no
draft) included, from costs measured (ms of a draft step, of a verify pass, of a dense step)
or modelled (`modelled_costs`: the eFLOPs of cost_model.py, where the verify of gamma + 1
tokens pays the linear layers' FLOPs per token but reads the weights and the whole KV once).
The static engine runs the chosen gamma per bin (`RolloutConfig.gamma_by_bin`, rollout/exact.py);
a fixed gamma (`RolloutConfig.gamma`) stays the simple setting.

`plan_modes` is the one planner across modes (issue 57): per bin dense, exact sparse (gamma,
draft budget) or approximate sparse - unverified drafts at the budget the controller's rule
certified there (`RolloutConfig.approximate_from_bin`) - whichever is predicted fastest among
the safe choices. Approximate bins run as a suffix of the bins, so it picks the suffix.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import integrate, special

from sparrow_jax.sparsity.cost_model import (Hardware, ModelShape, decode_token_cost,
                                             get_hardware, get_model_shape)
from sparrow_jax.sparsity.schedule import DENSE_BUDGET

log = logging.getLogger(__name__)


def tokens_per_pass(alpha: Any, gamma: int) -> np.ndarray:
    """(1 - a^(gamma+1)) / (1 - a) (gamma + 1 at a = 1): expected tokens per verify round."""
    a = np.asarray(alpha, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (1.0 - a ** (gamma + 1)) / (1.0 - a)
    return np.where(a >= 1.0, gamma + 1.0, out)


def lockstep_rounds(alpha: float, gamma: int, tokens: int, rows: int) -> float:
    """Expected verify rounds for a batch of `rows` rows, each to generate `tokens` tokens, when
    the batch runs rounds in lock step until its slowest row is done (the static engine; a
    paged decode chunk alike): E[max over rows of one row's rounds].

    A round yields X tokens, P(X = k + 1) = a^k (1 - a) for k < gamma, P(X = gamma + 1) = a^gamma.
    One row's rounds to reach n tokens, by renewal theory: mean n / E[X] + E[X^2] / (2 E[X]^2)
    (the last round overshoots), variance n Var(X) / E[X]^3; the batch's maximum adds the
    standard deviation times the expected maximum of `rows` standard normals. Per-row rates
    (`tokens_per_pass`) leave this out: with few tokens per row and a few rows it is ~10% of
    the rounds (the CPU bench's 32 tokens x 4 rows, docs/benchmarks.md)."""
    a, g = float(alpha), int(gamma)
    k = np.arange(g + 1)
    p = np.where(k < g, a ** k * (1 - a), a ** g)       # P(X = k + 1)
    mean = float(np.dot(p, k + 1))
    second = float(np.dot(p, (k + 1) ** 2))
    per_row = tokens / mean + second / (2 * mean ** 2)
    sd = math.sqrt(max(tokens * (second - mean ** 2) / mean ** 3, 0.0))
    return per_row + sd * expected_max_std_normal(rows)


def expected_max_std_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by quadrature."""
    if n <= 1:
        return 0.0
    # E[max] = integral of z n phi(z) Phi(z)^(n-1) dz.
    def integrand(z: float) -> float:
        return z * n * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * special.ndtr(z) ** (n - 1)
    return float(integrate.quad(integrand, -np.inf, np.inf)[0])


def modelled_costs(model: ModelShape | str, hardware: Hardware | str, bin_ctx: Sequence[float],
                   budgets: Sequence[int], gammas: Sequence[int], *, block_size: int = 16,
                   batch: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """eFLOPs per sequence at each bin's context bin_ctx [bins]: (draft step at each budget
    [K, bins], verify pass of gamma + 1 tokens for each gamma [G, bins], dense step [bins])."""
    m, hw = get_model_shape(model), get_hardware(hardware)
    ctx = np.asarray(bin_ctx, np.float64)
    dense = decode_token_cost(m, ctx, DENSE_BUDGET, block_size=block_size, batch=batch)
    draft = []
    for b in budgets:
        s = decode_token_cost(m, ctx, b, block_size=block_size, batch=batch)
        draft.append(s["flops"] + hw.intensity * s["bytes"])
    # The verify's weights and KV are read once for its gamma + 1 tokens; FLOPs are per token.
    verify = [(g + 1) * (dense["linear_flops"] + dense["attn_flops"])
              + hw.intensity * (dense["linear_bytes"] + dense["kv_bytes"]) for g in gammas]
    return (np.stack(draft), np.stack(verify),
            dense["flops"] + hw.intensity * dense["bytes"])


def exact_token_eflops(model: ModelShape | str, hardware: Hardware | str, ctx: Any, budget: Any,
                       alpha: Any, gamma: int, *, block_size: int = 16,
                       batch: int = 1) -> dict[str, np.ndarray]:
    """Per generated token of one sequence: ``draft``, ``verify`` and ``total`` eFLOPs and the
    dense decode's ``dense`` eFLOPs at the same ctx ([N] arrays), plus ``tokens_per_pass``."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    ctx = np.atleast_1d(np.asarray(ctx, np.float64))
    draft, verify, dense = modelled_costs(model, hardware, ctx, [budget], [gamma],
                                          block_size=block_size, batch=batch)
    e = tokens_per_pass(alpha, gamma)
    return {"draft": gamma * draft[0] / e, "verify": verify[0] / e,
            "total": (gamma * draft[0] + verify[0]) / e, "dense": dense,
            "tokens_per_pass": np.broadcast_to(e, ctx.shape)}


def mean_alpha_by_bin(alpha: Any, positions: Any, mask: Any, *, bin_size: int,
                      num_bins: int) -> np.ndarray:
    """Mean alpha per bin of total cached length (the last bin open-ended), NaN where a bin has
    no token: alpha/positions/mask [...] as `mismatch.tail_by_bin` takes them -> [num_bins]."""
    a, m = np.asarray(alpha, np.float64), np.asarray(mask, bool)
    bins = np.clip(np.asarray(positions, np.int64) // bin_size, 0, num_bins - 1)
    total = np.bincount(bins[m], weights=a[m], minlength=num_bins)
    count = np.bincount(bins[m], minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


@dataclasses.dataclass(frozen=True)
class ExactPlan:
    """Per length bin: the draft length (0 = dense decoding, no draft), the draft budget
    (DENSE_BUDGET where dense), the predicted tokens per verify pass (1 where dense), the
    predicted speed-up over dense decoding (tokens per unit cost / dense's) and why."""
    gammas: tuple[int, ...]
    budgets: tuple[int, ...]
    tokens_per_pass: tuple[float, ...]
    speedup: tuple[float, ...]
    reasons: tuple[str, ...]

    def overall_speedup(self, weights: Sequence[float] | None = None,
                        dense_cost: Sequence[float] | None = None) -> float:
        """Dense cost / planned cost of generating weights[j] tokens in bin j (default: one
        each, dense_cost[j] per dense token, default 1 each)."""
        n = len(self.gammas)
        w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
        c = np.ones(n) if dense_cost is None else np.asarray(dense_cost, np.float64)
        return float(np.dot(w, c) / np.dot(w, c / np.asarray(self.speedup)))

    def log(self, bin_size: int, logger: logging.Logger = log) -> None:
        """One line per bin: what runs there and the predicted speed-up."""
        for j, (g, b, e, s, why) in enumerate(zip(self.gammas, self.budgets,
                                                  self.tokens_per_pass, self.speedup,
                                                  self.reasons)):
            what = "dense decoding" if g == 0 else f"gamma {g}, draft budget {b}"
            logger.info("exact_sparse plan, bin %d (%d-%d tokens): %s, predicted %.2f tokens "
                        "per verify pass, %.2fx dense (%s)", j, j * bin_size,
                        (j + 1) * bin_size, what, e, s, why)


def choose_per_bin(budgets: Sequence[int], alpha: Any, draft_cost: Any,
                   verify_cost: Mapping[int, Any], dense_cost: Any) -> ExactPlan:
    """Per bin, the (gamma, budget) with the most expected tokens per unit cost, or dense.

    budgets [K] draft budgets (tokens); alpha [K, bins] measured acceptance probability of a
    draft at budget k in bin j (sampled decoding: mean alpha; greedy: the argmax agreement
    rate; NaN: not measured, never chosen); draft_cost [K, bins] (or [K]) cost of
    one draft step; verify_cost: gamma (>= 1) -> [bins] (or scalar) cost of one verify pass of
    gamma + 1 tokens; dense_cost [bins] (or scalar) cost of one dense decode step, in the same
    unit (ms measured, or eFLOPs modelled). A round of (g, k) yields
    E = (1 - a^(g+1)) / (1 - a) tokens for g * draft_cost[k] + verify_cost[g]; dense yields 1
    token for dense_cost. Ties keep dense, then the smaller gamma, then the smaller budget."""
    a = np.atleast_2d(np.asarray(alpha, np.float64))
    budgets = [int(b) for b in budgets]
    k, n = a.shape
    if len(budgets) != k or not verify_cost or min(verify_cost) < 1:
        raise ValueError(f"choose_per_bin: {len(budgets)} budgets for {k} rows of alpha, "
                         f"verify costs for gammas {sorted(verify_cost)} (each >= 1)")
    if np.any((a[np.isfinite(a)] < 0) | (a[np.isfinite(a)] > 1)):
        raise ValueError(f"alpha must lie in [0, 1], got {a}")
    draft = np.broadcast_to(np.asarray(draft_cost, np.float64).reshape(k, -1), (k, n))
    dense = np.broadcast_to(np.asarray(dense_cost, np.float64), (n,))
    gammas, chosen, per_pass, speedup, reasons = [], [], [], [], []
    for j in range(n):
        best = (1.0 / dense[j], 0, DENSE_BUDGET, 1.0)   # tokens per unit cost, gamma, budget, E
        for g in sorted(verify_cost):
            ver = float(np.broadcast_to(np.asarray(verify_cost[g], np.float64), (n,))[j])
            for i in sorted(range(k), key=budgets.__getitem__):
                if not np.isfinite(a[i, j]):
                    continue
                e = float(tokens_per_pass(a[i, j], g))
                rate = e / (g * draft[i, j] + ver)
                if rate > best[0]:
                    best = (rate, g, budgets[i], e)
        rate, g, b, e = best
        gammas.append(g)
        chosen.append(b)
        per_pass.append(e)
        speedup.append(rate * dense[j])
        if g:
            reasons.append(f"alpha {a[budgets.index(b), j]:.3f}")
        elif not np.isfinite(a[:, j]).any():
            reasons.append("no alpha measured in this bin: dense")
        else:
            reasons.append(f"no draft beats dense (best alpha {np.nanmax(a[:, j]):.3f})")
    return ExactPlan(tuple(gammas), tuple(chosen), tuple(per_pass), tuple(speedup),
                     tuple(reasons))


def plan_exact(model: ModelShape | str, hardware: Hardware | str, bin_ctx: Sequence[float],
               alpha_by_budget: Mapping[int, Sequence[float]], *,
               gammas: Sequence[int] = (1, 2, 4), block_size: int = 16,
               batch: int = 256) -> ExactPlan:
    """`choose_per_bin` on modelled costs (`modelled_costs` at a representative context per
    bin, bin_ctx [bins], e.g. each bin's middle); alpha_by_budget: budget -> [bins] measured
    alpha (calibration, or the mode's own records)."""
    ctx = np.asarray(bin_ctx, np.float64)
    if not alpha_by_budget or any(len(a) != len(ctx) for a in alpha_by_budget.values()):
        raise ValueError(f"alpha_by_budget needs one alpha per bin ({len(ctx)}) for each budget")
    budgets = sorted(alpha_by_budget)
    draft, verify, dense = modelled_costs(model, hardware, ctx, budgets, gammas,
                                          block_size=block_size, batch=batch)
    return choose_per_bin(budgets, [alpha_by_budget[b] for b in budgets], draft,
                          dict(zip(gammas, verify)), dense)


class BinMode(str, enum.Enum):
    """How a length bin decodes in an exact_sparse run's plan."""
    DENSE = "dense"                 # gamma 0: a dense step
    EXACT = "exact"                 # gamma drafts, verified densely: the dense policy's samples
    APPROXIMATE = "approximate"     # unverified drafts at a certified budget (TIS corrects)


@dataclasses.dataclass(frozen=True)
class ModePlan:
    """Per length bin: the mode, the draft length (0 where dense; 0 in approximate bins, whose
    rounds draft RolloutConfig.gamma + 1 tokens), the budget (DENSE_BUDGET where dense; the
    certified one where approximate), the predicted speed-up over dense decoding and why; the
    first approximate bin (0 = none: the `RolloutConfig.approximate_from_bin` setting) and the
    lossless plan it started from."""
    modes: tuple[BinMode, ...]
    gammas: tuple[int, ...]
    budgets: tuple[int, ...]
    speedup: tuple[float, ...]
    reasons: tuple[str, ...]
    approximate_from_bin: int
    lossless: ExactPlan
    weights: tuple[float, ...]          # the tokens per bin and a dense token's cost there
    dense_cost: tuple[float, ...]       # that the plan was chosen for (default 1 each)

    def overall_speedup(self) -> float:
        """Dense cost / planned cost of generating weights[j] tokens in bin j at dense_cost[j]
        per dense token."""
        w, c = np.asarray(self.weights), np.asarray(self.dense_cost)
        return float(np.dot(w, c) / np.dot(w, c / np.asarray(self.speedup)))

    def lossless_overall_speedup(self) -> float:
        """The same for the lossless plan (no approximate bins)."""
        return self.lossless.overall_speedup(self.weights, self.dense_cost)

    def log(self, bin_size: int, logger: logging.Logger = log) -> None:
        """One line per bin: what runs there, the predicted speed-up and why."""
        for j, (m, g, b, s, why) in enumerate(zip(self.modes, self.gammas, self.budgets,
                                                  self.speedup, self.reasons)):
            what = {BinMode.DENSE: "dense decoding",
                    BinMode.EXACT: f"exact sparse, gamma {g}, draft budget {b}",
                    BinMode.APPROXIMATE: f"approximate sparse, budget {b}"}[m]
            logger.info("rollout plan, bin %d (%d-%d tokens): %s, predicted %.2fx dense (%s)",
                        j, j * bin_size, (j + 1) * bin_size, what, s, why)


def choose_modes(lossless: ExactPlan, certified_budgets: Sequence[int],
                 approximate_speedup: Any, weights: Sequence[float] | None = None,
                 dense_cost: Sequence[float] | None = None) -> ModePlan:
    """The lossless plan (dense or exact per bin, `choose_per_bin`) with a suffix of bins
    switched to approximate decoding where that is predicted faster over all bins.

    certified_budgets [bins]: the budget the controller's rule certified per bin (DENSE_BUDGET:
    none there - approximate decoding is not safe in that bin); approximate_speedup [bins]: the
    predicted speed-up over dense of a sparse step at that budget (ignored where not certified);
    weights [bins]: the tokens generated per bin (default one each) and dense_cost [bins] a
    dense token's cost there (default 1 each), which weigh the bins in the overall speed-up. Approximate bins form a suffix starting at bin >= 1 (the engines'
    `approximate_from_bin`: every token before it is verified), so only suffixes of certified
    bins are candidates; of those, the one with the best overall predicted speed-up, and on a
    tie the shorter one (fewer unverified tokens)."""
    n = len(lossless.gammas)
    cert = np.asarray(certified_budgets, np.int64)
    fast = np.asarray(approximate_speedup, np.float64)
    if cert.shape != (n,) or fast.shape != (n,):
        raise ValueError(f"choose_modes: {n} bins in the lossless plan, {cert.shape} certified "
                         f"budgets, {fast.shape} approximate speed-ups")
    safe = cert < DENSE_BUDGET
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    c = np.ones(n) if dense_cost is None else np.asarray(dense_cost, np.float64)
    if w.shape != (n,) or c.shape != (n,) or np.any(w < 0) or np.any(c <= 0):
        raise ValueError(f"choose_modes: weights and dense costs must be {n} non-negative "
                         f"(costs positive) numbers, got {w} and {c}")
    exact_speed = np.asarray(lossless.speedup, np.float64)
    wc = w * c                                  # the dense cost of each bin's tokens

    def overall(start: int) -> float:
        speed = np.where(np.arange(n) >= start, fast, exact_speed)
        return float(wc.sum() / np.dot(wc, 1.0 / speed)) if wc.sum() > 0 else 1.0

    # Bin k can start the suffix when every bin from k on is certified.
    starts = [k for k in range(1, n) if safe[k:].all()]
    best, best_speed = n, overall(n)
    for k in sorted(starts, reverse=True):      # shorter suffixes first: they win ties
        if overall(k) > best_speed * (1 + 1e-9):
            best, best_speed = k, overall(k)
    modes, gammas, budgets, speedup, reasons = [], [], [], [], []
    for j in range(n):
        if j >= best:
            modes.append(BinMode.APPROXIMATE)
            gammas.append(0)
            budgets.append(int(cert[j]))
            speedup.append(float(fast[j]))
            reasons.append(f"certified at budget {cert[j]}: {fast[j]:.2f}x dense against "
                           f"{exact_speed[j]:.2f}x lossless ({lossless.reasons[j]})")
            continue
        g = lossless.gammas[j]
        modes.append(BinMode.EXACT if g else BinMode.DENSE)
        gammas.append(g)
        budgets.append(lossless.budgets[j])
        speedup.append(float(exact_speed[j]))
        if j == 0 and safe[j]:
            why = "approximate decoding starts at bin 1 at the earliest"
        elif not safe[j]:
            why = "approximate decoding not certified in this bin"
        elif fast[j] <= exact_speed[j]:
            why = f"approximate at budget {cert[j]} predicted no faster ({fast[j]:.2f}x)"
        elif not safe[j:].all():
            why = (f"approximate at budget {cert[j]} would be {fast[j]:.2f}x, but a later bin "
                   "is not certified (approximate bins are a suffix)")
        else:
            why = (f"approximate at budget {cert[j]} would be {fast[j]:.2f}x, but starting "
                   "the approximate bins here is slower overall")
        reasons.append(f"{lossless.reasons[j]}; {why}")
    return ModePlan(tuple(modes), tuple(gammas), tuple(budgets), tuple(speedup),
                    tuple(reasons), best if best < n else 0, lossless,
                    tuple(float(x) for x in w), tuple(float(x) for x in c))


def plan_modes(model: ModelShape | str, hardware: Hardware | str, bin_ctx: Sequence[float],
               alpha_by_budget: Mapping[int, Sequence[float]],
               certified_budgets: Sequence[int], *, gammas: Sequence[int] = (1, 2, 4),
               block_size: int = 16, batch: int = 256,
               weights: Sequence[float] | None = None) -> ModePlan:
    """`choose_modes` on modelled costs at bin_ctx [bins]: `plan_exact` for the lossless plan,
    per certified bin a sparse step at its certified budget against a dense step, and the bins
    weighed by weights [bins] (tokens generated there) times a dense token's cost there."""
    lossless = plan_exact(model, hardware, bin_ctx, alpha_by_budget, gammas=gammas,
                          block_size=block_size, batch=batch)
    ctx = np.asarray(bin_ctx, np.float64)
    cert = np.asarray(certified_budgets, np.int64)
    fast = np.full(len(ctx), np.nan)
    dense = modelled_costs(model, hardware, ctx, [DENSE_BUDGET], [1], block_size=block_size,
                           batch=batch)[2]
    for j in np.flatnonzero(cert < DENSE_BUDGET):
        draft = modelled_costs(model, hardware, ctx[j:j + 1], [int(cert[j])], [1],
                               block_size=block_size, batch=batch)[0]
        fast[j] = float(dense[j] / draft[0, 0])
    return choose_modes(lossless, cert, fast, weights, dense)


def tokens_by_bin(lengths: Any, *, bin_size: int, num_bins: int) -> np.ndarray:
    """Generated tokens per bin of cached length: lengths [N, 2] (prompt, response) -> [bins]
    (response token t sits at cached position prompt + t; the last bin open-ended)."""
    arr = np.asarray(lengths, np.int64).reshape(-1, 2)
    edges = np.arange(num_bins + 1, dtype=np.int64) * bin_size
    edges[-1] = np.iinfo(np.int64).max // 2
    start, end = arr[:, :1], arr[:, :1] + arr[:, 1:]        # [N, 1]: positions [start, end)
    overlap = np.clip(np.minimum(end, edges[1:]) - np.maximum(start, edges[:-1]), 0, None)
    return overlap.sum(0).astype(np.float64)
