"""Exact sparse rollout's cost model (sparsity/exact_cost.py): tokens per verify pass against a
simulation of the acceptance process, the per-token cost against hand arithmetic, the plan's
choices against enumeration."""

import numpy as np
import pytest

from sparrow_jax.sparsity.cost_model import Hardware, ModelShape
from sparrow_jax.sparsity.exact_cost import exact_token_eflops, plan_exact, tokens_per_pass

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


def test_plan_picks_cheapest_budget_per_bin_and_best_gamma():
    ctx = [2048, 8192, 32768]
    alphas = {128: [0.5, 0.6, 0.7], 512: [0.9, 0.92, 0.95], 2048: [1.0, 0.99, 0.98]}
    plan = plan_exact(TOY, HW, ctx, alphas, gammas=(1, 2, 4, 8), batch=8)
    for row in plan["per_gamma"]:
        for k, c in enumerate(ctx):       # enumeration: the chosen budget is the cheapest
            costs = {b: exact_token_eflops(TOY, HW, [c], b, alphas[b][k], row["gamma"],
                                           batch=8)["total"][0] for b in alphas}
            assert row["budgets"][k] == min(costs, key=costs.get)
    assert plan["speedup"] == max(r["speedup"] for r in plan["per_gamma"])
    # Near-certain acceptance favours long drafts; poor acceptance makes drafting a loss.
    sure = plan_exact(TOY, HW, [32768], {512: [0.999]}, gammas=(1, 2, 4, 8), batch=8)
    assert sure["gamma"] == 8 and sure["speedup"] > 1
    poor = plan_exact(TOY, HW, [32768], {512: [0.05]}, gammas=(1, 4), batch=8)
    assert poor["gamma"] == 1 and poor["speedup"] < 1
    with pytest.raises(ValueError, match="one alpha per bin"):
        plan_exact(TOY, HW, ctx, {128: [0.5]})
