"""sparrow_jax.sparsity.calibration: schedule picking from a tail table, heatmap output."""

import numpy as np
import pytest

from sparrow_jax.sparsity.calibration import pick_schedule, write_heatmap
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule

BUDGETS = np.array([256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192])
C = np.linspace(50.0, 700.0, 20)


def synthetic_table():
    # tail(b, bin) = 1 - c_bin / b: cheapest passing budget is the first b >= c / 0.14.
    return 1.0 - C[None, :] / BUDGETS[:, None].astype(np.float64)


def expected(tails, target=0.86):
    out = []
    for j in range(tails.shape[1]):
        ok = np.flatnonzero(tails[:, j] >= target)
        out.append(int(BUDGETS[ok[0]]) if ok.size else int(BUDGETS[-1]))
    return list(np.maximum.accumulate(out))


def test_pick_cheapest_passing():
    tails = synthetic_table()
    sched, info = pick_schedule(tails, BUDGETS, target=0.86)
    assert isinstance(sched, Schedule) and sched.num_bins == 20
    assert list(sched.budgets) == expected(tails)
    assert info["ok"] and info["unmet_bins"] == [] and info["no_data_bins"] == []
    # Budget order of the table rows does not matter.
    perm = np.random.default_rng(0).permutation(len(BUDGETS))
    again, _ = pick_schedule(tails[perm], BUDGETS[perm], target=0.86)
    assert again.budgets == sched.budgets


def test_pick_non_monotone_tails_takes_cheapest():
    tails = np.full((3, 2), 0.5)
    tails[:, 0] = [0.90, 0.80, 0.95]  # noisy: the cheapest budget already passes
    tails[:, 1] = [0.70, 0.87, 0.85]
    sched, info = pick_schedule(tails, [512, 1024, 2048], monotone=False)
    assert sched.budgets == (512, 1024) and info["ok"]


def test_pick_missing_data_and_unmet():
    tails = synthetic_table()
    tails[:, [0, 1, 7, 8]] = np.nan  # leading and interior bins without data
    tails[3:, 12] = np.nan  # partial column: only small budgets measured
    tails[:, 19] = 0.5  # nothing meets the target
    sched, info = pick_schedule(tails, BUDGETS, target=0.86)
    b = sched.budgets
    assert b[0] == b[1] == b[2]  # leading gap takes the first measured bin's choice
    assert b[7] == b[8] == b[6]  # interior gap inherits the previous bin
    assert b[19] == 8192 and info["unmet_bins"] == [12, 19] and not info["ok"]
    assert info["no_data_bins"] == [0, 1, 7, 8]
    assert list(b) == sorted(b)
    dense, info = pick_schedule(tails, BUDGETS, fallback="dense")
    assert dense.budgets[19] == DENSE_BUDGET and 19 in info["unmet_bins"]


def test_pick_errors():
    with pytest.raises(ValueError, match="num_budgets"):
        pick_schedule(np.zeros((3, 20)), [512, 1024])
    with pytest.raises(ValueError, match="all NaN"):
        pick_schedule(np.full((2, 20), np.nan), [512, 1024])
    with pytest.raises(ValueError, match="fallback"):
        pick_schedule(np.zeros((2, 20)), [512, 1024], fallback="min")


def test_write_heatmap(tmp_path):
    tails = synthetic_table()
    tails[:, 5] = np.nan
    sched, _ = pick_schedule(tails, BUDGETS)
    path = write_heatmap(tmp_path / "heat.png", tails, BUDGETS, sched, 2000)
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # No schedule, all passing (no contour level inside the data range): still writes.
    path2 = write_heatmap(tmp_path / "plain.png", np.full((2, 3), 0.99), [512, 1024], None, 2000)
    assert open(path2, "rb").read()[:4] == b"\x89PNG"
