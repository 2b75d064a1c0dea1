"""Exact sparse rollout's cost model (sparsity/exact_cost.py): tokens per verify pass against a
simulation of the acceptance process, the per-token cost against hand arithmetic, the per-bin
choice of (gamma, budget) or dense against brute-force enumeration and hand-computed cases."""

import itertools
import logging

import numpy as np
import pytest

from sparrow_jax.sparsity.cost_model import Hardware, ModelShape
from sparrow_jax.sparsity.exact_cost import (choose_per_bin, exact_token_eflops,
                                             mean_alpha_by_bin, modelled_costs, plan_exact,
                                             tokens_per_pass)
from sparrow_jax.sparsity.schedule import DENSE_BUDGET

TOY = ModelShape(num_layers=4, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=100, dense_layers=(0,), dtype_bytes=2)
HW = Hardware("toy", peak_flops=1000.0, hbm_bandwidth=10.0)       # 100 FLOPs per byte


@pytest.mark.parametrize("a,gamma", [(0.3, 1), (0.8, 4), (0.95, 6), (1.0, 3)])
def test_tokens_per_pass_matches_simulated_acceptance(a, gamma):
    r = np.random.default_rng(0)
    accept = r.random((200_000, gamma)) < a
    accepted = np.cumprod(accept, axis=1).sum(1)           # drafts before the first rejection
    sim = (accepted + 1).mean()
    assert abs(sim - float(tokens_per_pass(a, gamma))) < 5 * (accepted.std() + 1e-9) / 447


def test_exact_token_cost_by_hand():
    ctx, budget, gamma, a, batch = 4096.0, 256.0, 3, 0.9, 8
    h, qd, kvd, inter, v = 64, 64, 32, 128, 100
    params = 4 * (h * qd + 2 * h * kvd + qd * h + 3 * h * inter) + h * v
    kv_tok = 2 * 2 * 16 * 2                                             # K+V bytes per layer
    lin_f, lin_b = 2.0 * params, params * 2 / batch
    attn_dense = 4 * 4 * 16 * ctx
    dense = lin_f + 4 * attn_dense + 100 * (lin_b + 4 * kv_tok * ctx)
    sparse = (lin_f + attn_dense + 3 * 4 * 4 * 16 * budget + 3 * 2 * 2 * 16 * (ctx // 16)
              + 100 * (lin_b + kv_tok * ctx + 3 * kv_tok * budget + 3 * 2 * 16 * 2 * (ctx // 16)))
    verify = (gamma + 1) * (lin_f + 4 * attn_dense) + 100 * (lin_b + 4 * kv_tok * ctx)
    e = (1 - a ** (gamma + 1)) / (1 - a)
    got = exact_token_eflops(TOY, HW, [ctx], budget, a, gamma, batch=batch)
    assert got["dense"][0] == pytest.approx(dense)
    assert got["draft"][0] == pytest.approx(gamma * sparse / e)
    assert got["verify"][0] == pytest.approx(verify / e)
    assert got["total"][0] == pytest.approx((gamma * sparse + verify) / e)


def _enumerate(budgets, alpha, draft, verify, dense):
    """Brute force: every (gamma, budget) and dense per bin, by the rate's definition."""
    out = []
    for j in range(alpha.shape[1]):
        cands = [(1.0 / dense[j], 0, DENSE_BUDGET)]
        for (g, ver), (i, b) in itertools.product(verify.items(), enumerate(budgets)):
            a = alpha[i, j]
            if np.isnan(a):
                continue
            e = sum(a ** n for n in range(g + 1))        # 1 + a + ... + a^g
            cands.append((e / (g * draft[i, j] + ver[j]), g, b))
        out.append(max(cands, key=lambda c: c[0]))
    return out


def test_choice_per_bin_matches_brute_force_enumeration():
    r = np.random.default_rng(3)
    budgets, seen = [64, 256, 1024], set()
    for _ in range(40):
        n = 5
        alpha = np.sort(r.uniform(0.0, 1.0, (3, n)), axis=0)   # more budget, more alpha
        alpha[r.random((3, n)) < 0.1] = np.nan
        dense = r.uniform(0.5, 2.0, n)
        draft = dense * r.uniform(0.1, 0.9, (3, 1)) * np.array([[1.0], [1.1], [1.3]])
        verify = {g: dense * r.uniform(0.8, 1.0 + 0.3 * g) for g in (1, 2, 4)}
        plan = choose_per_bin(budgets, alpha, draft, verify, dense)
        for j, (rate, g, b) in enumerate(_enumerate(budgets, alpha, draft, verify, dense)):
            assert plan.speedup[j] == pytest.approx(rate * dense[j])
            assert (plan.gammas[j], plan.budgets[j]) == (g, b)
            seen.add(g)
    assert seen == {0, 1, 2, 4}                # dense and every gamma won somewhere


def test_choice_by_hand_including_dense():
    """Costs in dense steps. Bin 0: alpha 0.9 at budget 512, draft 0.25, verify 1 + 0.2 g:
    g=1: 1.9 / 1.45 = 1.310; g=2: 2.71 / 1.9 = 1.426; g=4: 4.0951 / 2.8 = 1.4625 -> gamma 4.
    Bin 1: alpha 0.5: g=1: 1.5 / 1.45 = 1.034; g=2: 1.75 / 1.9 = 0.921 -> gamma 1, 1.03x.
    Bin 2: alpha 0.3: g=1: 1.3 / 1.45 = 0.897 < 1 -> dense. Bin 3: no alpha -> dense."""
    verify = {g: 1.0 + 0.2 * g for g in (1, 2, 4)}
    plan = choose_per_bin([512], [[0.9, 0.5, 0.3, np.nan]], [0.25], verify, 1.0)
    assert plan.gammas == (4, 1, 0, 0)
    assert plan.budgets == (512, 512, DENSE_BUDGET, DENSE_BUDGET)
    assert plan.speedup == pytest.approx((4.0951 / 2.8, 1.5 / 1.45, 1.0, 1.0))
    assert plan.tokens_per_pass == pytest.approx((4.0951, 1.5, 1.0, 1.0))
    assert "no draft beats dense" in plan.reasons[2] and "no alpha" in plan.reasons[3]
    # Budget choice: a larger budget's higher alpha pays for its dearer draft, or does not.
    two = choose_per_bin([128, 1024], [[0.6, 0.6], [0.95, 0.65]], [[0.2, 0.2], [0.4, 0.4]],
                         {2: 1.3}, 1.0)
    # bin 0: 128: 1.96 / 1.7 = 1.153; 1024: 2.8525 / 2.1 = 1.358. bin 1: 1024: 2.0725 / 2.1.
    assert two.budgets == (1024, 128) and two.gammas == (2, 2)
    assert two.speedup == pytest.approx((2.8525 / 2.1, 1.96 / 1.7))
    # Overall: bins weighted by tokens, each token at its bin's planned cost.
    assert two.overall_speedup([1, 3]) == pytest.approx(4 / (2.1 / 2.8525 + 3 * 1.7 / 1.96))
    with pytest.raises(ValueError, match="gammas"):
        choose_per_bin([512], [[0.9]], [0.3], {0: 1.0}, 1.0)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        choose_per_bin([512], [[1.2]], [0.3], {1: 1.0}, 1.0)


def test_plan_on_modelled_costs_and_log(caplog):
    ctx = [2048, 8192, 32768]
    alphas = {128: [0.5, 0.6, 0.7], 512: [0.9, 0.92, 0.95], 2048: [1.0, 0.99, 0.98]}
    plan = plan_exact(TOY, HW, ctx, alphas, gammas=(1, 2, 4, 8), batch=8)
    draft, verify, dense = modelled_costs(TOY, HW, ctx, sorted(alphas), (1, 2, 4, 8), batch=8)
    want = _enumerate(sorted(alphas), np.array([alphas[b] for b in sorted(alphas)]), draft,
                      dict(zip((1, 2, 4, 8), verify)), dense)
    assert [(g, b) for _, g, b in want] == list(zip(plan.gammas, plan.budgets))
    # Near-certain acceptance favours long drafts; poor acceptance makes drafting a loss.
    sure = plan_exact(TOY, HW, [32768], {512: [0.999]}, gammas=(1, 2, 4, 8), batch=8)
    assert sure.gammas == (8,) and sure.speedup[0] > 1
    poor = plan_exact(TOY, HW, [32768], {512: [0.05]}, gammas=(1, 4), batch=8)
    assert poor.gammas == (0,) and poor.speedup[0] == 1.0
    with caplog.at_level(logging.INFO):
        poor.log(bin_size=2000)
    assert "bin 0 (0-2000 tokens): dense decoding" in caplog.text
    with pytest.raises(ValueError, match="one alpha per bin"):
        plan_exact(TOY, HW, ctx, {128: [0.5]})


def test_mean_alpha_by_bin_against_a_loop():
    r = np.random.default_rng(1)
    alpha, pos = r.random((6, 40)), r.integers(0, 300, (6, 40))
    mask = r.random((6, 40)) < 0.7
    got = mean_alpha_by_bin(alpha, pos, mask, bin_size=64, num_bins=6)
    for j in range(6):              # the last bin is open-ended: 320+ lands in bin 5 (none here)
        sel = [a for a, p, m in zip(alpha.ravel(), pos.ravel(), mask.ravel())
               if m and min(p // 64, 5) == j]
        assert (np.isnan(got[j]) and not sel) or got[j] == pytest.approx(np.mean(sel))


def _lossless(speedup, gammas=None):
    """An ExactPlan with the given per-bin speed-ups (gamma 1 where > 1, else dense)."""
    from sparrow_jax.sparsity.exact_cost import ExactPlan
    gammas = gammas or tuple(1 if s > 1 else 0 for s in speedup)
    return ExactPlan(gammas, tuple(512 if g else DENSE_BUDGET for g in gammas),
                     tuple(2.0 if g else 1.0 for g in gammas), tuple(speedup),
                     tuple(f"lossless {j}" for j in range(len(speedup))))


def test_choose_modes_picks_the_best_certified_suffix_by_hand():
    """Approximate bins are a suffix (bin >= 1) of certified bins; the suffix with the best
    overall predicted speed-up wins, by hand:
    lossless 1.0 / 1.2 / 1.3 / 1.4, approximate 3.0 / 1.25 / 1.0 / 2.5 where certified.
    All four certified, one token each: from bin 1: 4 / (1 + 0.8 + 1 + 0.4) = 1.25; from bin 2:
    4 / (1 + 1/1.2 + 1 + 0.4) = 1.2371; from bin 3: 4 / (1 + 1/1.2 + 1/1.3 + 0.4) = 1.3322
    (best); none: 4 / (1 + 1/1.2 + 1/1.3 + 1/1.4) = 1.2060."""
    from sparrow_jax.sparsity.exact_cost import BinMode, choose_modes
    lossless = _lossless((1.0, 1.2, 1.3, 1.4))
    fast = (3.0, 1.25, 1.0, 2.5)
    plan = choose_modes(lossless, (256,) * 4, fast)
    assert plan.approximate_from_bin == 3
    assert plan.modes == (BinMode.DENSE, BinMode.EXACT, BinMode.EXACT, BinMode.APPROXIMATE)
    assert plan.gammas == (0, 1, 1, 0) and plan.budgets == (DENSE_BUDGET, 512, 512, 256)
    assert plan.speedup == pytest.approx((1.0, 1.2, 1.3, 2.5))
    assert plan.overall_speedup() == pytest.approx(4 / (1 + 1 / 1.2 + 1 / 1.3 + 0.4))
    assert plan.lossless_overall_speedup() == pytest.approx(4 / (1 + 1 / 1.2 + 1 / 1.3 + 1 / 1.4))
    assert "starts at bin 1 at the earliest" in plan.reasons[0]
    assert "slower overall" in plan.reasons[1] and "predicted no faster" in plan.reasons[2]
    assert "certified at budget 256" in plan.reasons[3]
    # Weights move the choice: most tokens in bin 1 -> the suffix from bin 1 pays.
    heavy = choose_modes(lossless, (256,) * 4, fast, weights=(1, 10, 1, 1))
    assert heavy.approximate_from_bin == 1
    # So do dense costs (a bin's tokens cost more at longer contexts).
    assert choose_modes(lossless, (256,) * 4, fast, dense_cost=(1, 10, 1, 1)
                        ).approximate_from_bin == 1
    # An uncertified bin breaks the suffix: bins before it stay lossless.
    gap = choose_modes(lossless, (256, 256, DENSE_BUDGET, 256), fast)
    assert gap.approximate_from_bin == 3
    assert "not certified" in gap.reasons[2] and "later bin is not certified" in gap.reasons[1]
    # Nothing certified at the end (as calibration's dense last bin): no approximate bins.
    none = choose_modes(lossless, (256, 256, 256, DENSE_BUDGET), fast)
    assert none.approximate_from_bin == 0 and BinMode.APPROXIMATE not in none.modes
    assert none.speedup == lossless.speedup and none.gammas == lossless.gammas
    # A tie keeps the bins lossless.
    tie = choose_modes(_lossless((1.0, 2.0)), (256, 256), (5.0, 2.0))
    assert tie.approximate_from_bin == 0
    with pytest.raises(ValueError, match="certified"):
        choose_modes(lossless, (256,) * 3, fast)
    with pytest.raises(ValueError, match="non-negative"):
        choose_modes(lossless, (256,) * 4, fast, weights=(1, -1, 1, 1))


def test_plan_modes_against_enumerated_suffixes(caplog):
    """plan_modes on modelled costs: the lossless plan is plan_exact's, each certified bin's
    approximate speed-up a sparse step's at its budget over a dense step's, and the chosen
    suffix the best of all valid ones by enumeration (bins weighed by tokens x dense cost)."""
    from sparrow_jax.sparsity.exact_cost import plan_modes
    ctx = [2048, 8192, 16384, 32768]
    alphas = {128: [0.5, 0.6, 0.6, 0.7], 512: [0.9, 0.9, 0.92, 0.95]}
    cert = (DENSE_BUDGET, 512, 512, 128)
    weights = (100, 50, 20, 5)
    plan = plan_modes(TOY, HW, ctx, alphas, cert, gammas=(1, 2, 4), batch=8, weights=weights)
    assert plan.lossless == plan_exact(TOY, HW, ctx, alphas, gammas=(1, 2, 4), batch=8)
    _, _, dense = modelled_costs(TOY, HW, ctx, [128], [1], batch=8)
    fast = {}
    for j, b in enumerate(cert):
        if b < DENSE_BUDGET:
            draft = modelled_costs(TOY, HW, ctx[j:j + 1], [b], [1], batch=8)[0]
            fast[j] = dense[j] / draft[0, 0]
    wc = np.asarray(weights) * dense

    def overall(k):
        speed = [fast[j] if j >= k else plan.lossless.speedup[j] for j in range(4)]
        return wc.sum() / np.dot(wc, 1 / np.asarray(speed))
    best = max([4, 3, 2, 1], key=lambda k: (overall(k), -k) if k < 4 else (overall(4), 0))
    assert plan.approximate_from_bin == (0 if best == 4 else best)
    assert plan.overall_speedup() == pytest.approx(overall(best))
    assert plan.approximate_from_bin >= 1          # the long bins' sparse steps pay here
    with caplog.at_level(logging.INFO):
        plan.log(bin_size=4096)
    assert "rollout plan, bin 3 (12288-16384 tokens): approximate sparse, budget 128" in caplog.text


def test_tokens_by_bin_against_a_loop():
    from sparrow_jax.sparsity.exact_cost import tokens_by_bin
    r = np.random.default_rng(2)
    lengths = np.stack([r.integers(0, 100, 30), r.integers(0, 200, 30)], 1)
    want = np.zeros(4)
    for p, n in lengths:
        for pos in range(p, p + n):
            want[min(pos // 64, 3)] += 1
    assert tokens_by_bin(lengths, bin_size=64, num_bins=4) == pytest.approx(want)


@pytest.mark.parametrize("a,gamma,tokens,rows", [(0.968, 2, 31, 4), (0.8, 4, 100, 8),
                                                 (0.5, 1, 200, 32), (0.95, 4, 31, 1)])
def test_lockstep_rounds_against_a_simulation(a, gamma, tokens, rows):
    """The expected rounds a batch runs in lock step until its slowest row has `tokens` tokens
    (renewal-theory mean and spread, the expected maximum of `rows` normals) against a
    simulation of the acceptance process: within 3%."""
    from sparrow_jax.sparsity.exact_cost import expected_max_std_normal, lockstep_rounds
    r = np.random.default_rng(3)
    draws = 3000
    # Tokens per round: 1 + accepted drafts (leading successes, at most gamma).
    accept = r.random((draws, rows, tokens, gamma)) < a
    per_round = 1 + np.cumprod(accept, axis=-1).sum(-1)              # [draws, rows, rounds]
    rounds = (np.cumsum(per_round, axis=-1) < tokens).sum(-1) + 1    # rounds to reach tokens
    sim = rounds.max(-1).mean()
    assert lockstep_rounds(a, gamma, tokens, rows) == pytest.approx(sim, rel=0.03)
    assert expected_max_std_normal(1) == 0.0
    assert expected_max_std_normal(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-4)
