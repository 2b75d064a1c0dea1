"""Whole-model KV accounting (dense layers included, per bin) and the `dense` label of a bin."""

import numpy as np
import pytest

from sparrow_jax.rollout.config import RolloutConfig
from sparrow_jax.sparsity.schedule import DENSE_BUDGET, Schedule
from sparrow_jax.train import schedule_step


def _reference(budgets, cached, mask, cfg: RolloutConfig, num_layers, bin_size, num_bins):
    """Entries read, counted one token and one layer at a time (no vectorisation)."""
    read = total = 0
    per_bin: dict[int, list[int]] = {}
    for b in range(cached.shape[0]):
        for t in range(cached.shape[1]):
            if not mask[b, t]:
                continue
            length = int(cached[b, t]) + 1          # the cache holds the fed token too
            k = min(int(cached[b, t]) // bin_size, num_bins - 1)
            for layer in range(num_layers):
                if cfg.sparse_layer(layer) and budgets[b, t] > 0:
                    r = min(int(budgets[b, t]), length)
                else:
                    r = length
                read += r
                total += length
                acc = per_bin.setdefault(k, [0, 0])
                acc[0] += r
                acc[1] += length
    return read, total, {k: v[0] / v[1] for k, v in per_bin.items()}


@pytest.mark.parametrize("dense_layers,mode", [((0, 1), "sparse"), ((0, 1, 5), "sparse"),
                                               ((0, 1), "dense")])
def test_kv_read_matches_token_by_token_count(dense_layers, mode):
    rng = np.random.default_rng(0)
    b, t, layers, bin_size, nb = 3, 40, 8, 16, 4
    cached = np.sort(rng.integers(0, 90, (b, t)), axis=1)
    budgets = rng.choice([0, 32, 48, DENSE_BUDGET], (b, t))
    mask = rng.random((b, t)) < 0.8
    cfg = RolloutConfig(mode=mode, dense_layers=dense_layers)
    out = schedule_step.kv_read(budgets, cached, mask, num_layers=layers,
                                num_sparse_layers=cfg.num_sparse_layers(layers),
                                bin_size=bin_size, num_bins=nb)
    read, total, per_bin = _reference(budgets, cached, mask, cfg, layers, bin_size, nb)
    assert out["kv/model_read_tokens"] == read and out["kv/model_total_tokens"] == total
    assert out["kv/read_model"] == pytest.approx(read / total)
    assert {k for k in out if k.startswith("kv/read_bin_")} == {
        f"kv/read_bin_{k:02d}" for k in per_bin}
    for k, v in per_bin.items():
        assert out[f"kv/read_bin_{k:02d}"] == pytest.approx(v)
    if mode == "dense":
        assert out["kv/read_model"] == 1.0


def test_dense_layers_bound_the_whole_model_read():
    # Every sparse layer reading nothing but its 16-token budget of a 4K cache: 2 of 4 layers
    # dense keep the whole model at >= 0.5, 2 of 8 at >= 0.25.
    cached = np.full((1, 8), 4095)
    budgets = np.full((1, 8), 16)
    mask = np.ones((1, 8), bool)
    four = schedule_step.kv_read(budgets, cached, mask, num_layers=4, num_sparse_layers=2,
                                 bin_size=1024, num_bins=4)
    eight = schedule_step.kv_read(budgets, cached, mask, num_layers=8, num_sparse_layers=6,
                                  bin_size=1024, num_bins=4)
    assert four["kv/read_sparse_layers"] == pytest.approx(16 / 4096)
    assert four["kv/read_model"] == pytest.approx((2 + 2 * 16 / 4096) / 4)
    assert eight["kv/read_model"] == pytest.approx((2 + 6 * 16 / 4096) / 8)
    with pytest.raises(ValueError, match="num_sparse_layers = 5"):
        schedule_step.kv_read(budgets, cached, mask, num_layers=4, num_sparse_layers=5,
                              bin_size=1024, num_bins=4)


def test_run_kv_read_pools_steps_and_keeps_the_last_line_per_step():
    records = [{"step": 0, "eval_dense/reward": 0.1},
               {"step": 1, "kv/model_read_tokens": 50.0, "kv/model_total_tokens": 100.0},
               {"step": 2, "kv/model_read_tokens": 90.0, "kv/model_total_tokens": 100.0},
               # step 2 redone after a resume: its later line counts
               {"step": 2, "kv/model_read_tokens": 30.0, "kv/model_total_tokens": 300.0}]
    assert schedule_step.run_kv_read(records) == pytest.approx(80 / 400)
    assert np.isnan(schedule_step.run_kv_read(records[:1]))


def test_a_dense_bin_prints_dense_never_the_dense_rung_number():
    sched = Schedule((DENSE_BUDGET, 128, 128, 96, DENSE_BUDGET, 256), 64, 16, "t")
    line = schedule_step.schedule_line(sched)
    # bin 1 (lengths 64-127) at 128 covers its upper edge: dense; bin 2 (128-191) at 128 is
    # sparse; the last bin is open-ended, so a finite budget there stays a number.
    assert line == "[dense, dense, 128, 96, dense, 256]"
    assert str(DENSE_BUDGET) not in line
