"""`calibration.certify_schedule`: a starting table certified by the controller's own rule."""

import dataclasses

import numpy as np
import pytest

from sparrow_jax.sparsity.calibration import certify_schedule
from sparrow_jax.sparsity.controller import ControllerConfig, ControllerState, controller_update
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

CFG = ControllerConfig(target=0.9, quantile=0.01, min_rows=16, min_tokens=256, lower_margin=1.0,
                       raise_on="lower", ladder=(64, 128, 256), min_budget=64, max_budget=256)
BUDGETS = (256, 64, 128)            # any order


def _sweep(rng, rates):
    """[budgets, 32 rows, 3 bins] counts at true rates [budgets, bins], 64 tokens per cell."""
    rates = np.asarray(rates, np.float64)
    n = np.full((len(BUDGETS), 32, rates.shape[1]), 64)
    return rng.binomial(n, rates[:, None, :]), n


def _controller_takes(hits, tokens, budget) -> np.ndarray:
    """[bins] whether the controller, replaying at `budget` in every bin with these counts, lowers
    each bin onto it (live evidence at the dense rung: clean and plentiful)."""
    # One controller per bin: a probe is judged on its own evidence (no downstream blocking).
    took = []
    for j in range(hits.shape[1]):
        one = Schedule((DENSE_BUDGET,), bin_size=4096, block_size=16)
        st = dataclasses.replace(ControllerState.initial(one), probe_budgets=(budget,))
        _, inf = controller_update(st, np.zeros((64, 1)), np.full((64, 1), 64), CFG,
                                   probe_hits=hits[:, j:j + 1], probe_tokens=tokens[:, j:j + 1])
        took.append(bool(inf["lowered"][0]))
    return np.asarray(took)


def test_certified_by_the_controllers_own_rule():
    rng = np.random.default_rng(0)
    # bin 0 passes everywhere (0.2 q at 64), bin 1 only at 128 and up (2 q at 64), bin 2 nowhere
    # (dense).
    rates = [[0.0, 0.0, 0.05],          # 256
             [0.002, 0.02, 0.08],       # 64
             [0.0, 0.001, 0.06]]        # 128
    hits, tokens = _sweep(rng, rates)
    sched, info = certify_schedule(hits, tokens, BUDGETS, CFG, bin_size=4096)
    assert sched.budgets == (64, 128, DENSE_BUDGET) and info["dense_bins"] == [2]
    # One grid budget lower per bin (bin 0 has none lower: it stays), and where that fails.
    assert info["one_rung_lower"].budgets == (64, 64, 256)
    assert info["one_rung_lower_failing_bins"] == [1, 2]
    assert (info["lower_bound"] <= info["upper_bound"]).all()
    for i, b in enumerate(BUDGETS):       # the same verdict as a probe replay in the controller
        assert info["certified"][i].tolist() == _controller_takes(hits[i], tokens[i], b).tolist()
        assert (info["upper_bound"][i][info["certified"][i]] <= CFG.quantile).all()


def test_too_few_rows_or_tokens_certify_nothing():
    hits = np.zeros((1, 8, 1), np.int64)
    sched, info = certify_schedule(hits, np.full((1, 8, 1), 1000), (64,), CFG, bin_size=4096)
    assert sched.budgets == (DENSE_BUDGET,) and not info["certified"].any()   # 8 < min_rows
    # 32 clean rows x 8 tokens = 256 tokens < z^2 (1 - q) / q ~ 268: not certifiable at q
    sched, _ = certify_schedule(np.zeros((1, 32, 1)), np.full((1, 32, 1), 8), (64,), CFG,
                                bin_size=4096)
    assert sched.budgets == (DENSE_BUDGET,)
    with pytest.raises(ValueError, match="must both be"):
        certify_schedule(np.zeros((2, 4, 1)), np.zeros((2, 4, 1)), (64,), CFG, bin_size=4096)
