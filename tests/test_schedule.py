"""sparrow_jax.sparsity.schedule (paper tables, validation, JSON, lookups) and sparrow_jax.sparsity.controller."""

import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.sparsity.controller import (
    ControllerConfig, ControllerState, ScheduleController, controller_update,
)
from sparrow_jax.sparsity.schedule import (
    DENSE_BUDGET, Schedule, load_schedule, make_schedule,
)

PAPER = {
    "qwen3-1.7b-0.86": [512, 1024, 1536, 1536, 2048, 2560, 3072, 3584, 3584, 4096] + [4096] * 10,
    "qwen3-4b-0.86": [512, 768, 1024, 1280, 1536, 2048, 2560, 3584, 4096, 4096, 5120, 5120, 5120,
                      5120, 6144, 6144, 6144, 6144, 8192, 8192],
    "qwen3-8b-0.86": [512, 768, 1024, 1280, 2048, 2560, 3072, 4096, 4096, 4096, 4096, 5120, 5120,
                      5120, 5120, 5120, 5120, 6144, 7168, 7168],
    "qwen3-14b-0.86": [512, 768, 1280, 2048, 4096] + [6144] * 10 + [8192, 10240, 10240, 14336, 14336],
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_tables_exact(name):
    s = Schedule.named(name)
    assert list(s.budgets) == PAPER[name] and s.num_bins == 20
    assert s.bin_size == 2000 and s.block_size == 16 and s.name == name
    assert load_schedule(name.upper()) == s
    assert list(s.budgets) == sorted(s.budgets)


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="qwen3-4b-0.86"):
        Schedule.named("qwen3-99b")
    with pytest.raises(ValueError, match="known names"):
        load_schedule("/no/such/file.json")


@pytest.mark.parametrize("budgets, match", [
    ((512, 1000), r"budgets\[1\] = 1000 is not a multiple"),
    ((32,), r"budgets\[0\] = 32 is below the 3 reserved blocks"),
    ((), "at least one bin"),
    ((512, True), r"budgets\[1\] must be an integer"),
    ((512.5,), r"budgets\[0\] must be an integer"),
    ((DENSE_BUDGET * 2,), "exceeds DENSE_BUDGET"),
    ("512", "sequence of integers"),
])
def test_validation_errors(budgets, match):
    with pytest.raises(ValueError, match=match):
        Schedule(budgets)


def test_validation_of_sizes():
    with pytest.raises(ValueError, match="block_size must be positive"):
        Schedule((512,), block_size=0)
    with pytest.raises(ValueError, match="bin_size must be positive"):
        Schedule((512,), bin_size=-1)
    assert Schedule([96, 128], block_size=32).budgets == (96, 128)
    with pytest.raises(ValueError, match=r"budgets\[0\] = 80 is not a multiple of block_size 32"):
        Schedule((80,), block_size=32)


def test_json_round_trip(tmp_path):
    s = Schedule.named("qwen3-8b-0.86")
    assert Schedule.from_json(s.to_json()) == s
    path = tmp_path / "s.json"
    s.to_json(path)
    assert Schedule.from_json(path) == s and load_schedule(str(path)) == s
    # A bare list is accepted; an unnamed file schedule is named after its path.
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([512, 1024]))
    loaded = load_schedule(str(bare))
    assert loaded.budgets == (512, 1024) and loaded.name == str(bare)
    with pytest.raises(ValueError, match="unknown schedule fields"):
        Schedule.from_dict({"budgets": [512], "bogus": 1})


def test_budget_lookup_jittable():
    s = Schedule.named("qwen3-4b-0.86")
    lengths = jnp.array([0, 1999, 2000, 5999, 38000, 39999, 40000, 10**6], jnp.int32)
    expect = [512, 512, 768, 1024, 8192, 8192, 8192, 8192]
    got = jax.jit(s.budget_for_length)(lengths)
    assert got.dtype == jnp.int32 and got.tolist() == expect
    assert s.budget_blocks(lengths).tolist() == [b // 16 for b in expect]
    assert jax.jit(lambda x: s.bin_index(x))(lengths).tolist() == [0, 0, 1, 2, 19, 19, 19, 19]
    assert s.max_budget == 8192 and s.max_blocks(4000) == 250 and s.max_blocks(10**6) == 512


def test_dense_and_constant():
    d = Schedule.dense()
    assert d.is_dense and d.num_bins == 20 and d.max_blocks(32768) == 2048
    assert int(d.budget_for_length(jnp.array([39000]))[0]) == DENSE_BUDGET
    c = Schedule.constant(2048, num_bins=5)
    assert c.budgets == (2048,) * 5 and not c.is_dense
    assert load_schedule("dense").is_dense


def test_make_schedule_gin():
    assert make_schedule().is_dense
    assert make_schedule(name="qwen3-1.7b-0.86") == Schedule.named("qwen3-1.7b-0.86")
    assert make_schedule(budgets=[96, 128], block_size=32).block_size == 32
    with pytest.raises(ValueError, match="one of name/path/budgets"):
        make_schedule(name="dense", budgets=[512])
    with gin.unlock_config():
        gin.parse_config("make_schedule.name = 'qwen3-14b-0.86'")
    try:
        assert make_schedule().budgets[-1] == 14336
    finally:
        gin.clear_config()


# ----------------------------------------------------------------------------------------------
# Controller on a synthetic tail-vs-budget curve: tail(b, bin) = 1 - c_bin / b.
# ----------------------------------------------------------------------------------------------

C = np.linspace(60.0, 900.0, 20)  # harder bins need larger budgets; cheapest passing is monotone


def synthetic_tail(budgets):
    return 1.0 - C / np.asarray(budgets, np.float64)


def cheapest_passing(cfg, block=16):
    rungs = np.asarray(cfg.rungs(block))
    best = [int(rungs[np.flatnonzero(1.0 - c / rungs >= cfg.target)[0]]) for c in C]
    return list(np.maximum.accumulate(best))


def run(state, cfg, steps, counts=None):
    counts = np.full(20, 1000) if counts is None else counts
    history = []
    for _ in range(steps):
        state, info = controller_update(state, synthetic_tail(state.schedule.budgets), counts, cfg)
        history.append(list(state.schedule.budgets))
    return state, np.asarray(history)


@pytest.mark.parametrize("start", [256, 16384])
def test_controller_converges_to_cheapest_passing(start):
    cfg = ControllerConfig(patience=2, margin=0.01, fail_memory=1000)
    want = cheapest_passing(cfg)
    state, hist = run(ControllerState.initial(Schedule.constant(start)), cfg, 80)
    assert list(state.schedule.budgets) == want
    assert (hist[-20:] == want).all()  # settled: fail memory stops re-probing
    rungs = cfg.rungs(16)
    assert hist.min() >= rungs[0] and hist.max() <= rungs[-1]
    assert (np.diff(hist, axis=1) >= 0).all()  # monotone over bins at every step


def test_controller_bounds_and_saturation():
    cfg = ControllerConfig(min_budget=512, max_budget=1024, patience=1, fail_memory=0)
    state = ControllerState.initial(Schedule.constant(4096))
    state, info = controller_update(state, np.full(20, 0.5), np.full(20, 999), cfg)
    assert set(state.schedule.budgets) == {1024} and info["saturated"].all()
    for _ in range(10):
        state, info = controller_update(state, np.full(20, 0.999), np.full(20, 999), cfg)
    assert set(state.schedule.budgets) == {512}
    assert min(cfg.rungs(16)) == 512 and max(cfg.rungs(16)) == 1024


def test_controller_hysteresis():
    cfg = ControllerConfig(target=0.86, margin=0.05, patience=3, fail_memory=0)
    sched = Schedule.constant(2048, num_bins=2)
    state = ControllerState.initial(sched)
    counts = np.array([1000, 1000])
    high = np.array([0.95, 0.88])  # bin 0 above target + margin, bin 1 inside the band
    for step in range(2):
        state, info = controller_update(state, high, counts, cfg)
        assert state.schedule.budgets == (2048, 2048), step
    state, info = controller_update(state, high, counts, cfg)
    assert state.schedule.budgets[0] < 2048 and info["lowered"][0]
    assert state.schedule.budgets[1] == 2048  # monotone clamps nothing here: bin 1 held
    # A failure raises at once, without patience.
    lowered = state.schedule.budgets[0]
    state, info = controller_update(state, np.array([0.5, 0.88]), counts, cfg)
    assert state.schedule.budgets[0] > lowered and info["raised"][0]
    # An interrupted streak restarts patience.
    cfg2 = ControllerConfig(patience=2, fail_memory=0, monotone=False)
    st = ControllerState.initial(sched)
    for tail in ([0.95, 0.95], [0.87, 0.95], [0.95, 0.95]):
        st, info = controller_update(st, np.array(tail), counts, cfg2)
    assert st.schedule.budgets[0] == 2048 and st.schedule.budgets[1] < 2048


def test_controller_fail_memory_blocks_reprobe():
    cfg = ControllerConfig(patience=1, margin=0.0, fail_memory=5, monotone=False,
                           ladder=(512, 1024, 2048), min_budget=512, max_budget=2048)
    state = ControllerState.initial(Schedule.constant(1024, num_bins=1))
    state, _ = controller_update(state, [0.5], [1000], cfg)  # fail at 1024 -> raise
    up = state.schedule.budgets[0]
    blocked = 0
    for _ in range(4):
        state, info = controller_update(state, [0.99], [1000], cfg)
        blocked += int(info["blocked"][0])
        assert state.schedule.budgets[0] == up
    assert blocked == 4
    state, info = controller_update(state, [0.99], [1000], cfg)  # memory expired: probe again
    assert state.schedule.budgets[0] == 1024 and info["lowered"][0]


def test_controller_skips_low_count_and_nan_bins():
    cfg = ControllerConfig(min_tokens=100, patience=1, monotone=False)
    state = ControllerState.initial(Schedule.constant(2048, num_bins=3))
    state, info = controller_update(state, [0.1, 0.1, np.nan], [99, 100, 5000], cfg)
    assert state.schedule.budgets[0] == 2048 and state.schedule.budgets[2] == 2048
    assert state.schedule.budgets[1] > 2048
    assert info["skipped"].tolist() == [True, False, True]
    with pytest.raises(ValueError, match="must both be"):
        controller_update(state, [0.9] * 4, [1] * 4, cfg)


def test_controller_state_round_trip():
    cfg = ControllerConfig(patience=2)
    ctrl = ScheduleController(Schedule.named("qwen3-1.7b-0.86"), cfg)
    for _ in range(3):
        ctrl.update(synthetic_tail(ctrl.schedule.budgets), np.full(20, 1000))
    data = json.loads(json.dumps(ctrl.state_dict()))
    again = ScheduleController.from_state_dict(data, cfg)
    assert again.state == ctrl.state and again.state.step == 3
    tail = synthetic_tail(ctrl.schedule.budgets)
    assert again.update(tail, np.full(20, 1000))["budgets"].tolist() == \
        ctrl.update(tail, np.full(20, 1000))["budgets"].tolist()


def test_controller_config_validation_and_ladder():
    with pytest.raises(ValueError, match="patience"):
        ControllerConfig(patience=0)
    with pytest.raises(ValueError, match="min_budget"):
        ControllerConfig(min_budget=4096, max_budget=1024)
    cfg = ControllerConfig(ladder=(512, 1024, 2048, 4096), min_budget=512, max_budget=4096)
    assert cfg.rungs(16) == (512, 1024, 2048, 4096)
    with pytest.raises(ValueError, match="not multiples"):
        ControllerConfig(ladder=(520,)).rungs(16)
    rungs = ControllerConfig().rungs(16)
    assert all(r % 16 == 0 for r in rungs) and list(rungs) == sorted(set(rungs))
    assert rungs[0] == 256 and rungs[-1] == 16384


def test_controller_reprobes_rarely_with_fail_memory():
    cfg = ControllerConfig(patience=2, margin=0.0, fail_memory=10)
    state, hist = run(ControllerState.initial(Schedule.constant(16384)), cfg, 120)
    failing = (1.0 - C / hist[-60:]) < cfg.target  # [steps, bins]
    assert 0 < failing.mean() <= 0.15
    # Every step's budgets stay within one rung of the cheapest passing ones.
    want = np.asarray(cheapest_passing(cfg))
    assert (hist[-60:] >= want * 0.75).all() and (hist[-60:] <= want * 1.3).all()
