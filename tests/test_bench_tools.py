"""The accelerator timing tools: chained calls (bench/kernels.py) and the Triton launch sweep."""

import jax
import jax.numpy as jnp
import pytest

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
    # timed, deduplicated ("2x" caps to "auto" at one step) and the default is found. Reps 1:
    # one call's wall time; the chained difference of reps 2 can sit inside a loaded CI
    # machine's noise (test_chained_timing_inside_the_noise_is_an_error_not_zero).
    assert kernel_sweep.main(["--contexts", "128", "--budget", "64", "--batch", "1",
                              "--warps", "4", "--stages", "2", "--tokens", "128",
                              "--splits", "auto,2x", "--iters", "1", "--reps", "1",
                              "--interpret", "--json"]) == 0
    out = capsys.readouterr().out
    rows = [__import__("json").loads(x) for x in out.splitlines() if x.startswith("{")]
    assert {r["mode"] for r in rows} == {"dense", "sparse"}
    assert all(r["ms"] is not None and r["ms"] > 0 for r in rows)
    assert sum(r["default"] for r in rows) == 2
    assert out.count("x the best") == 2


def test_chained_timing_inside_the_noise_is_an_error_not_zero(monkeypatch):
    """(t(reps chained) - t(one)) / (reps - 1) at or below zero is noise, not a zero-time
    kernel: it was printed as 0.0 ms, dropped from the best-vs-default table, and on a GPU
    would divide the speed-up by zero. Now it is an error the sweep reports in its row."""
    import pytest
    from sparrow_jax.bench import kernels

    walls = iter([2e-3, 1.9e-3])                    # one call, then 2 chained: "faster"
    monkeypatch.setattr(kernels, "median_wall_seconds", lambda fn, *a, iters: next(walls))
    with pytest.raises(kernels.TimingUnresolved, match="below the timer's noise"):
        kernels.seconds_per_call(lambda x: x, jnp.ones(2), iters=1, reps=2)
    walls = iter([2e-3, 5e-3])
    assert kernels.seconds_per_call(lambda x: x, jnp.ones(2), iters=1, reps=4) == \
        pytest.approx(1e-3)


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


def test_bench_exact_does_not_count_a_rows_cut_off_last_round_as_a_full_round():
    """`sparrow bench rollout --workload exact` stops every row at new_tokens, mid-round as a
    rule: the cut round's tokens are fewer than a full round gives and must not lower the mean
    tokens per verify pass (issue 56)."""
    from types import SimpleNamespace

    import numpy as np

    from sparrow_jax.bench.exact import pass_stats

    # Token 0 came from the prefill; gamma 2, so a full round gives 1 to 3 tokens (accepted
    # drafts, then the token the verify sampled). Row 0 (8 tokens): rounds of 2 and 3 tokens,
    # then one cut after two accepted drafts. Row 1 (9 tokens): rounds of 3, 1 and 3 tokens,
    # then one cut after one accepted draft.
    acc = np.array([[0, 1, 0, 1, 1, 0, 1, 1, 0],
                    [0, 1, 1, 0, 0, 1, 1, 0, 1]], bool)
    mask = np.ones_like(acc)
    mask[0, 8] = False
    traj = SimpleNamespace(accepted=acc & mask, alpha=np.where(mask, 0.9, np.nan), mask=mask,
                           cached_lengths=np.broadcast_to(np.arange(100, 109), acc.shape),
                           budgets=np.zeros(acc.shape, np.int32))
    stats = pass_stats(traj, gamma=2)
    # Full rounds only: row 0 (2, 3), row 1 (3, 1, 3) -> 12 tokens in 5 rounds.
    assert stats["rounds"] == 5 and stats["tokens_per_pass"] == 12 / 5
    # Counting the cut rounds (2 and 1 tokens) as full rounds would give 15 / 7.
    from sparrow_jax.rollout import exact
    counted = exact.acceptance_by_bin(traj, gamma=2, bin_size=1 << 30)[0]
    assert counted["rounds"] == 7 and counted["tokens_per_pass"] == 15 / 7


_TOY = ["--layers", "3", "--hidden", "32", "--heads", "4", "--kv_heads", "2", "--head_dim", "16",
        "--vocab", "64", "--dtype", "float32", "--repeats", "1"]
_TINY_SCHEDULE = ["--gin_param", "RolloutConfig.chunk_steps = 8",
                  "--gin_param", f"make_schedule.budgets = {[48] * 20}",
                  "--gin_param", "make_schedule.bin_size = 16"]


def _records(out: str) -> list[dict]:
    return [__import__("json").loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.mark.slow   # ~20 s; CI runs the same command in the quick device check (limit_rollout)
def test_bench_rollout_paged_engine_beside_its_bytes_limit(capsys):
    """`--engine paged` (issue 55): the paged engine's decode chunks timed one at a time at each
    context with its own batch, the gin files' schedule (`--schedule config`), and every row's
    bytes limit: weights + KV + centroids + metadata (the page tables' entries included) over
    the copy bandwidth measured in the run, as a % of the measured step."""
    from sparrow_jax import cli
    argv = ["bench", "rollout", "--", "--json", *_TOY, *_TINY_SCHEDULE, "--engine", "paged",
            "--schedule", "config", "--context", "96", "192", "--batch", "2", "3",
            "--new_tokens", "17"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    records = _records(out)
    assert [(r["context"], r["batch"], r["engine"]) for r in records] == [
        (96, 2, "paged"), (192, 3, "paged")]
    for r in records:
        assert r["schedule"] == "custom" and r["steps"] == 16 and r["chunk_steps"] == 8
        for mode in ("dense", "sparse"):
            assert r[f"{mode}_pct_of_limit"] == pytest.approx(
                100 * r[f"{mode}_limit_ms"] / r[f"{mode}_ms_per_step"])
            assert r[f"{mode}_bytes_metadata"] > 0          # page tables, every layer
        assert r["sparse_bytes_kv"] < r["dense_bytes_kv"] and r["sparse_bytes_centroids"] > 0
    assert "% limit" in out and "bytes/step dense: weights" in out


@pytest.mark.slow   # ~20 s; CI runs the same command in the quick device check (limit_rl)
def test_bench_rollout_rl_workload(capsys):
    """`--workload rl` (issue 55): distinct prompts x group samples with long-tailed lengths on
    the gin files' paged engine and schedule, dense and sparse interleaved, tokens/s and the
    rollout's share of the bytes limit of its decode work."""
    import statistics

    from sparrow_jax import cli
    argv = ["bench", "rollout", "--", "--json", *_TOY, *_TINY_SCHEDULE, "--workload", "rl",
            "--samples", "8", "--group", "4", "--prompt_len", "48", "--new_tokens", "64",
            "--mean_len", "16", "--gin_param", "RolloutConfig.engine = 'paged'"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    dense, sparse = _records(out)
    assert (dense["mode"], sparse["mode"]) == ("dense", "sparse")
    for r in (dense, sparse):
        assert r["workload"] == "rl" and r["tok_s"] > 0 and r["generated_tokens"] > 0
        assert r["decode_steps"] == 8 * r["chunks"] and r["bytes_weights"] > 0
        assert r["pct_of_limit"] == pytest.approx(100 * r["limit_s"] / statistics.median(
            r["wall_s"]))
    assert dense["bytes_centroids"] == 0 < sparse["bytes_centroids"]
    # the static engine is refused: the workload is a run's paged rollout
    with pytest.raises(SystemExit, match="paged engine"):
        cli.main(argv[:-2])
