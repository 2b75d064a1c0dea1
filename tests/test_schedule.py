"""sparrow_jax.sparsity.schedule (paper tables, validation, JSON, lookups) (the controller: tests/test_controller.py)."""

import json

import gin
import jax
import jax.numpy as jnp
import pytest

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
