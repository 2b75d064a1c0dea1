"""Tests for sparrow_jax.runtime.metrics: event files readable by TensorBoard, JSONL mirror, timers."""

from __future__ import annotations

import json
import math
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.runtime.metrics import (
    MetricsWriter,
    StepTimer,
    gin_config_markdown,
    read_jsonl,
    read_scalars,
    read_text,
)


def test_scalars_roundtrip_through_event_files(tmp_path):
    with MetricsWriter(tmp_path) as mw:
        mw.scalars(0, {"loss": 1.5, "acc": jnp.float32(0.25), "skipped": None})
        mw.scalars(1, {"loss": np.float64(1.0), "acc": float("nan")})
        mw.scalars(2, {"loss": jnp.array([0.5])})  # shape (1,) is accepted as a scalar
    got = read_scalars(tmp_path)
    assert set(got) == {"loss", "acc"}  # None was skipped, not written
    assert got["loss"] == [(0, 1.5), (1, 1.0), (2, 0.5)]
    assert [s for s, _ in got["acc"]] == [0, 1]
    assert got["acc"][0][1] == 0.25 and math.isnan(got["acc"][1][1])


def test_jsonl_lines_flushed_per_call(tmp_path):
    mw = MetricsWriter(tmp_path)
    t0 = time.time()
    mw.scalars(3, {"loss": 2.0, "bad": float("nan"), "inf": float("inf"), "none": None})
    # Readable before flush/close: the JSONL is flushed on every call.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])  # strict JSON (no NaN tokens)
    assert rec["step"] == 3 and rec["loss"] == 2.0
    assert rec["bad"] is None and rec["inf"] is None and "none" not in rec
    assert t0 - 1 <= rec["time"] <= time.time() + 1
    mw.scalars(4, {"loss": 1.0})
    mw.close()
    mw.scalars(5, {"loss": 0.0})  # after close: no-op, no error
    assert [r["step"] for r in read_jsonl(tmp_path)] == [3, 4]


def test_jsonl_appends_across_restarts_and_skips_torn_line(tmp_path):
    with MetricsWriter(tmp_path) as mw:
        mw.scalars(0, {"x": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "x"')  # a crash mid-write
        f.write("\n")
    with MetricsWriter(tmp_path) as mw:
        mw.scalars(1, {"x": 2.0})
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path)] == [(0, 1.0), (1, 2.0)]
    assert len([f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents")]) == 2
    assert read_scalars(tmp_path)["x"] == [(0, 1.0), (1, 2.0)]


def test_text_summary_present(tmp_path):
    cfg = "# Parameters for train:\ntrain.lr = 0.001\n"
    with MetricsWriter(tmp_path) as mw:
        mw.text(0, "config/operative_gin", gin_config_markdown(cfg))
        mw.scalars(0, {"loss": 1.0})
    texts = read_text(tmp_path)
    assert list(texts) == ["config/operative_gin"]
    (step, md), = texts["config/operative_gin"]
    assert step == 0 and "    train.lr = 0.001" in md and "    # Parameters" in md
    assert "config/operative_gin" not in read_scalars(tmp_path)


def test_disabled_writer_is_noop(tmp_path):
    run = tmp_path / "run"
    with MetricsWriter(run, enabled=False) as mw:  # what processes != 0 get
        mw.scalars(0, {"x": 1.0})
        mw.text(0, "t", "hi")
    assert not run.exists()


def test_non_scalar_rejected(tmp_path):
    with MetricsWriter(tmp_path) as mw:
        with pytest.raises(ValueError, match="scalar"):
            mw.scalars(0, {"v": np.ones(3)})


def test_step_timer_sections_and_block_hook():
    blocked = []
    # (no compile clock: the eager ops below may compile, which test_step_timer_compiles covers)
    timer = StepTimer(block_until_ready=lambda tree: blocked.append(tree),
                      compile_seconds=lambda: 0.0)
    with timer("rollout") as sec:
        out = sec.ready(jnp.ones(2) * 2)
        time.sleep(0.01)
    with timer("learner"):
        time.sleep(0.005)
    with timer("rollout"):
        pass
    assert float(out[0]) == 2.0 and len(blocked) == 1  # only the section with ready() blocks
    s = timer.summary()
    assert set(s) == {"time/rollout", "time/learner"}
    assert s["time/rollout"] >= 0.01 and s["time/learner"] >= 0.005
    assert timer.summary() == {}  # summary() resets by default


def test_step_timer_compiles():
    """Compile seconds inside a section (the compile log's running total) are reported beside
    its time as time/compile/<name>, only where it compiled; nested sections both count them."""
    clock = [0.0]
    timer = StepTimer(block_until_ready=None, compile_seconds=lambda: clock[0])
    with timer("learner"):
        clock[0] += 2.5
        with timer("distill"):
            clock[0] += 1.0
    with timer("reward"):
        pass
    with timer("learner"):
        clock[0] += 0.5
    s = timer.summary()
    assert s["time/compile/learner"] == 4.0 and s["time/compile/distill"] == 1.0
    assert "time/compile/reward" not in s and {"time/learner", "time/reward"} <= set(s)
    assert timer.summary() == {}


def test_compile_seconds_add_up_what_the_log_says():
    import jax

    from sparrow_jax.runtime import compile_cache
    compile_cache.log_compiles()
    before = compile_cache.compile_seconds()
    with compile_cache.count_compiles() as names:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert names and compile_cache.compile_seconds() > before


def test_step_timer_default_blocks_on_jax_arrays():
    timer = StepTimer(prefix="t/")
    with timer("mm") as sec:
        sec.ready(jnp.ones((64, 64)) @ jnp.ones((64, 64)))
    assert list(timer.totals) == ["mm"] and timer.summary(reset=False)["t/mm"] > 0
