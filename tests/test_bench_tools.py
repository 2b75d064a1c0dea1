"""The accelerator timing tools: chained calls (bench/kernels.py) and the Triton launch sweep."""

import jax
import jax.numpy as jnp

from sparrow_jax.bench import kernel_sweep
from sparrow_jax.bench.kernels import chained


def test_chained_calls_are_neither_merged_nor_folded_and_keep_the_result():
    f = jax.jit(lambda x, y: (jnp.sin(x) * y, jnp.argmax(x)))
    x, y = jnp.arange(4.0), jnp.float32(2.0)
    many = chained(f, 3)

    def sines(fn):
        cost = fn.lower(x, y).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["transcendentals"]
    # the optimised program's work grows with each chained call: the 0 x nudge keeps the calls
    # distinct (identical calls would be merged into one, and the timing would be of one call)
    assert sines(chained(f, 1)) < sines(chained(f, 2)) < sines(many)
    got, want = many(x, y), f(x, y)
    assert bool(jnp.array_equal(got[0], want[0])) and int(got[1]) == int(want[1])


def test_kernel_sweep_times_each_setting_and_marks_the_default(capsys):
    # Pallas interpret mode on CPU: the launch settings do nothing here, but every row is
    # timed, deduplicated ("2x" caps to "auto" at one step) and the default is found
    assert kernel_sweep.main(["--contexts", "128", "--budget", "64", "--batch", "1",
                              "--warps", "4", "--stages", "2", "--tokens", "128",
                              "--splits", "auto,2x", "--iters", "1", "--reps", "2",
                              "--interpret", "--json"]) == 0
    out = capsys.readouterr().out
    rows = [__import__("json").loads(x) for x in out.splitlines() if x.startswith("{")]
    assert {r["mode"] for r in rows} == {"dense", "sparse"}
    assert all(r["ms"] is not None and r["ms"] >= 0 for r in rows)
    assert sum(r["default"] for r in rows) == 2
    assert "1.00x the best" in out or "the best" in out


def test_bench_rollout_refuses_caches_that_cannot_fit_before_prefill(monkeypatch):
    """The bench holds two KV caches (the prefilled one and a timed run's copy): where one fits
    the device and two do not, it stops with a clear message before any prefill (on the H200,
    batch 16 at 32K ran out of memory mid-run instead)."""
    import pytest
    from sparrow_jax.bench import rollout as bench
    from sparrow_jax.rollout import kv_cache
    from sparrow_jax.rollout.config import RolloutConfig, padded_length

    argv = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv_heads", "1", "--head_dim",
            "16", "--vocab", "64", "--context", "256", "--new_tokens", "8", "--batch", "2",
            "--budget", "64", "--dtype", "float32", "--repeats", "1"]
    mcfg = bench.model_config(bench.build_parser().parse_args(argv))
    slots = RolloutConfig(max_new_tokens=8).cache_slots(padded_length(248, 16))
    one = kv_cache.cache_bytes(mcfg, 2, slots, jnp.float32)
    monkeypatch.setattr(kv_cache, "device_memory_limit", lambda: int(1.5 * one / 0.9))
    with pytest.raises(SystemExit, match="two KV caches"):
        bench.main(argv)
