"""The persistent compilation cache (sparrow_jax.runtime.compile_cache): written by a first run,
loaded by a second, each compile logged with its seconds; 'auto' is off on CPU unless jax already
has a cache (JAX_COMPILATION_CACHE_DIR, the test suite's shared one), which it keeps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow_jax.runtime import compile_cache

REPO = Path(__file__).resolve().parents[1]
PROGRAM = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import jax, jax.numpy as jnp
from sparrow_jax.runtime import compile_cache
compile_cache.configure(sys.argv[1], min_compile_seconds=0)
step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
print(float(step(jnp.ones((16, 16)))))
"""


def _run(cache: str) -> str:
    r = subprocess.run([sys.executable, "-c", PROGRAM, cache], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


def test_cache_is_written_then_reused(tmp_path):
    cache = tmp_path / "xla"
    first = _run(str(cache))
    assert "compilation cache: " + str(cache) + " (0 entries" in first
    written = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit__lambda") for name in written), written
    assert "from the compilation cache" not in first
    second = _run(str(cache))
    assert f"({len(written)} entries" in second
    assert "loaded jit(<lambda>) from the compilation cache in" in second, second
    assert sorted(p.name for p in cache.iterdir()) == written      # nothing compiled anew


def test_auto_is_off_on_cpu_and_on_for_accelerators(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARROW_COMPILE_CACHE", str(tmp_path / "c"))
    assert compile_cache.resolve("auto", "cpu") is None
    # jax's own setting (JAX_COMPILATION_CACHE_DIR; the test suite's shared cache) wins.
    assert compile_cache.resolve("auto", "cpu", "/shared") == "/shared"
    assert compile_cache.resolve("", "gpu", "/shared") is None
    assert compile_cache.resolve("auto", "gpu") == compile_cache.resolve("auto", "tpu") == \
        str(tmp_path / "c")
    assert compile_cache.resolve("", "gpu") is None
    assert compile_cache.resolve("gs://b/xla", "cpu") == "gs://b/xla"
    assert compile_cache.resolve("rel/dir", "cpu") == os.path.abspath("rel/dir")
    monkeypatch.delenv("SPARROW_COMPILE_CACHE")
    assert compile_cache.default_dir().endswith(os.path.join(".cache", "sparrow-jax", "xla"))


def test_train_config_turns_it_on_by_default():
    from sparrow_jax.train.config import TrainConfig
    import dataclasses
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["compile_cache_dir"]
    assert field.default == "auto"
    assert "compile_cache.configure(cfg.compile_cache_dir)" in (REPO / "sparrow_jax/train/command.py").read_text()


def test_auto_keeps_a_cache_jax_already_has():
    """`sparrow train` under JAX_COMPILATION_CACHE_DIR (the test suite's shared cache, or a
    user's) keeps that cache and its thresholds instead of switching it off on CPU."""
    import jax
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", "/tmp/sparrow-shared-cache-test")
    try:
        min_time = jax.config.jax_persistent_cache_min_compile_time_secs
        assert compile_cache.configure("auto") == "/tmp/sparrow-shared-cache-test"
        assert jax.config.jax_compilation_cache_dir == "/tmp/sparrow-shared-cache-test"
        assert jax.config.jax_persistent_cache_min_compile_time_secs == min_time
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.slow
def test_sparrow_train_writes_the_cache_and_a_second_run_loads_it(tmp_path):
    """TrainConfig.compile_cache_dir end to end: two 1-step runs of `sparrow train` (separate
    processes, separate run directories) share the cache; the second loads what the first
    compiled. (jax's 1 s threshold is lowered through its own environment variable.)"""
    from hf_fixtures import gin_argv, make_tiny_run, tiny_train_bindings

    root = make_tiny_run(tmp_path, eval_rows=0)
    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    outputs = []
    for run in ("first", "second"):
        binds = tiny_train_bindings(root, run, 1, TrainConfig__compile_cache_dir=repr(str(cache)))
        r = subprocess.run([sys.executable, "-m", "sparrow_jax.cli", "train", *gin_argv(binds)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        outputs.append(r.stderr)
        if run == "first":
            written = {p.name for p in cache.iterdir()}
    assert f"compilation cache: {cache} (0 entries" in outputs[0]
    assert written and "from the compilation cache" not in outputs[0]
    assert f"compilation cache: {cache} ({len(written)} entries" in outputs[1]
    loaded = [ln for ln in outputs[1].splitlines() if "from the compilation cache in" in ln]
    assert len(loaded) >= 3, outputs[1][-3000:]     # rollout and learner programs, at least
    _check_plan_before_compiles(outputs[0])


def _check_plan_before_compiles(log: str) -> None:
    """The compile plan is logged before the first rollout compiles, and names (with room for)
    every program shape the run's CompileLog reported."""
    import re
    lines = log.splitlines()
    plan = [i for i, ln in enumerate(lines) if "compile plan: about" in ln]
    shapes = [i for i, ln in enumerate(lines) if re.search(r"compile \w+/\w+ #\d+:", ln)]
    assert plan and shapes and plan[0] < shapes[0], log[-4000:]
    most = {m.group(1): int(m.group(2)) for ln in lines
            if (m := re.search(r"compile_plan:\s+(\S+): \d+ at the start, at most (\d+)", ln))}
    seen: dict[str, int] = {}
    for i in shapes:
        name = re.search(r"compile (\w+/\w+) #", lines[i]).group(1)
        seen[name] = seen.get(name, 0) + 1
    assert seen and all(name in most and n <= most[name] for name, n in seen.items()), (seen, most)


# -- the start-up line that says what will compile (sparrow_jax.train.compile_plan) -------------------


def test_compile_plan_takes_its_shapes_from_the_engines_bucket_functions():
    """Prompt widths, learner response lengths and the paged engine's decode grid are what the
    engines' own bucket functions give over every length (brute force here), not a list."""
    import dataclasses

    from sparrow_jax.train import compile_plan
    from sparrow_jax.rollout import continuous, continuous_state
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.rollout.page_pool import pages_for
    from sparrow_jax.runtime.shapes import bucket_length, default_buckets

    rc = RolloutConfig(max_new_tokens=300, max_budget=64)
    assert compile_plan.prompt_widths(rc, 700) == tuple(sorted(
        {rc.prompt_width(n) for n in range(1, 701)})) == (64, 96, 128, 192, 256, 384, 512, 768)
    buckets = default_buckets(300, multiple=16)
    assert compile_plan.response_lengths(buckets, 300, 16) == tuple(sorted(
        {min(bucket_length(n, buckets, multiple=16), 300) for n in range(1, 301)}))

    p = compile_plan.plan(rc, group_size=4, prompts_per_call=8, calls_per_step=2,
                          longest_prompt=700, length_buckets=buckets, fused=False,
                          eval_width=64, eval_rows=8, eval_modes=("dense", "sparse"),
                          micro_rows=16)
    by = {x.name: x for x in p.programs}
    assert set(by) == {"rollout/prefill", "rollout/decode", "rollout/join", "learner/analyze",
                       "learner/grads", "learner/apply", "eval/rollout"}
    assert by["rollout/decode"].most == 8 and by["learner/grads"].most == 8 * 6
    assert "64 rows, micro-batches of 16 rows" in by["learner/grads"].per
    assert p.first == 2 + 1 + 1 + 1 + 1 + 4 and p.most == 8 * 3 + 2 * 48 + 1 + 4
    assert p.lines()[0].startswith(f"compile plan: about {p.first} programs before step 1 ends, "
                                   f"at most {p.most} in the run")
    # A fused analysis leaves only the controller's probe to compile the analysis program.
    fused = compile_plan.plan(rc, group_size=4, prompts_per_call=8, calls_per_step=1,
                              longest_prompt=100, length_buckets=buckets, fused=True)
    assert "learner/analyze" not in fused.names() and "rollout/join" not in fused.names()
    probe = compile_plan.plan(rc, group_size=4, prompts_per_call=8, calls_per_step=1,
                              longest_prompt=100, length_buckets=buckets, fused=True, probe=True)
    assert [x.first for x in probe.programs if x.name == "learner/analyze"] == [0]

    # Paged: one decode program per (running-slot bucket, page-table bucket) the scheduler uses,
    # at the default ladders (powers of two) and coarser ones.
    for ladders in ({}, dict(slot_ladder=4, page_ladder=8, min_table_pages=3)):
        paged = dataclasses.replace(rc, engine="paged", max_slots=32, **ladders)
        by = {x.name: x for x in compile_plan.plan(
            paged, group_size=4, prompts_per_call=16, calls_per_step=1, longest_prompt=64,
            length_buckets=buckets, fused=True, data_shards=2).programs}
        cap = pages_for(64 + 300 - 1, 16)
        grid = {(continuous_state.slot_bucket(s, 16, paged), continuous_state.page_bucket(m, cap, paged))
                for s in range(1, 17) for m in range(1, cap + 1)}
        assert by["rollout/paged_decode"].most == len(grid)
    assert cap == 23 and len(grid) == 3 * 2 and {p for _, p in grid} == {3, cap}
    assert {s for s, _ in grid} == {1, 4, 16}
    assert {"rollout/prefill", "rollout/decode"}.isdisjoint(by)


def test_compile_plan_rejects_a_function_that_is_no_bucket():
    from sparrow_jax.train import compile_plan
    with pytest.raises(ValueError, match="not a bucket function"):
        compile_plan.distinct(lambda n: n - 1, 2, 10)


def test_the_gpu_config_compiles_few_programs():
    """configs/qwen3_1p7b_gpu.gin on 8 data shards (Qwen3-1.7B's 40960-token context): the plan
    stays within 12 programs before step 1, the warm-up's and the step-0 evaluation's included,
    and 60 in a run; the default ladders are the ~800 the issue (#43) counted."""
    import dataclasses

    import gin

    from sparrow_jax import cli
    from sparrow_jax.model.config import qwen3_preset
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.train import compile_plan

    gin.clear_config()
    try:
        cli.parse_gin([str(REPO / "configs" / "qwen3_1p7b_gpu.gin")], [])
        p = compile_plan.from_gin(qwen3_preset("qwen3-1.7b"), data_shards=8)
        rc = RolloutConfig()
        assert (rc.slot_ladder, rc.min_table_pages, rc.min_slots) == (2, 4096, 8)
    finally:
        gin.clear_config()
    by = {x.name: x for x in p.programs}
    assert set(by) == {"rollout/paged_prefill", "rollout/paged_decode", "learner/analyze",
                       "learner/grads", "learner/apply", "eval/paged_prefill"}
    # The warm-up's grid (slots 64 / 32 / 16 / 8 x one table width, the page cap) and 2
    # prefills; the evaluation decodes in the training programs. A run's second prompt width
    # (8192) has its own page cap: one more table width.
    assert by["rollout/paged_decode"].first == 4 and by["eval/paged_prefill"].first == 1
    assert by["rollout/paged_decode"].most == 8
    assert p.first <= 12 and p.most <= 60, p.lines()
    # The same run at the default ladders and buckets: hundreds.
    coarse = compile_plan.plan(
        dataclasses.replace(rc, slot_ladder=2, page_ladder=2, min_table_pages=4,
                            prompt_buckets=()),
        group_size=8, prompts_per_call=64, calls_per_step=1, longest_prompt=8192,
        length_buckets=compile_plan.default_buckets(32768), fused=False, probe=True,
        data_shards=8, micro_rows=8)
    assert coarse.most > 500 and coarse.first > 15


# -- the plan equals what compiles (TrainConfig.warmup, sparrow_jax.rollout.warmup) ------------
# Programs too small to plan (elementwise helpers, host-to-device staging, init); a new name here
# is either one of these or a program the plan must list (compile_plan.FUNCTIONS).
SMALL_PROGRAMS = {"stage", "zeros", "_checksums_program", "_reduce_max", "group_advantages",
                  "convert_element_type", "init_fn", "mismatch_summary", "broadcast_in_dim",
                  "concatenate", "_where", "clip", "iota", "copy", "_multi_slice",
                  "_threefry_seed", "_threefry_fold_in", "_threefry_split"}


@pytest.mark.slow
def test_a_tiny_runs_compiles_equal_its_plan(tmp_path):
    """`sparrow train` with `TrainConfig.warmup` (paged engine, step-0 evaluation, 1 step): the
    programs jax compiles (or loads from the persistent cache) are exactly the plan's programs
    before step 1, per jitted function - the warm-up's prefill and decode programs (the
    evaluation decodes in the training rollout's program, dense mode at the dense rung, and
    prefills both modes in one program of its own), then the learner's - and the warm-up logs
    one line per program. ~40 s on the loaded 2-core CPU (half of it the gradient program)."""
    import collections
    import logging
    import re

    import gin
    import jax

    from hf_fixtures import gin_argv, make_tiny_run, tiny_train_bindings
    from sparrow_jax import cli
    from sparrow_jax.runtime.compile_cache import count_compiles
    from sparrow_jax.train import compile_plan

    root = make_tiny_run(tmp_path)
    binds = tiny_train_bindings(
        root, "run", 1, TrainConfig__eval_data=repr(str(root / "eval.jsonl")),
        TrainConfig__eval_temperature="1.0", TrainConfig__warmup="True",
        RolloutConfig__engine="'paged'", RolloutConfig__chunk_steps="16",
        RolloutConfig__min_slots="4", RolloutConfig__min_table_pages="8",
        LearnerConfig__micro_batch_size="2")
    log: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    # On the two loggers themselves: the CLI sets up the root logger's handlers its own way.
    loggers = [logging.getLogger(n) for n in ("sparrow_jax.train.compile_plan",
                                              "sparrow_jax.rollout.warmup")]
    keep = Keep(logging.INFO)
    for lg in loggers:
        lg.addHandler(keep)
    jax.clear_caches()           # this module's earlier programs would not compile again
    gin.clear_config()
    try:
        with count_compiles() as names:
            assert cli.main(["train", *gin_argv(binds)]) == 0
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
    planned: dict[str, int] = {}
    for line in log:
        if m := re.match(r"  (\S+): (\d+) at the start", line):
            fn = compile_plan.FUNCTIONS[m.group(1)]
            planned[fn] = planned.get(fn, 0) + int(m.group(2))
    planned = {k: v for k, v in planned.items() if v}
    compiled = collections.Counter(re.sub(r"^jit\((.*)\)$", r"\1", n) for n in names)
    heavy = {k: v for k, v in compiled.items() if k not in SMALL_PROGRAMS}
    assert heavy == planned == {"prefill_program": 2, "decode_chunk_program": 1,
                                "grads_program": 1, "apply_program": 1}, (heavy, planned)
    warm = [line for line in log if line.startswith("warm-up ")]
    assert [w.split(" (")[0] for w in warm] == [
        "warm-up 1/3: rollout/paged_prefill", "warm-up 2/3: rollout/paged_decode",
        "warm-up 3/3: eval/paged_prefill"], warm
    assert re.match(r"warm-up 2/3: .*\(.*mode=sparse, .*slots=4, steps=16\): [\d.]+ s", warm[1])
    assert any(re.match(r"warm-up: 3 programs compiled in [\d.]+ s", line) for line in log)


def test_the_warm_up_lists_the_decode_grid_the_scheduler_can_reach():
    """`rollout.warmup.programs`: one prefill (every group admitted at once) and every decode
    shape the scheduler's bucket functions give over 1..live samples x 1..full pages."""
    from sparrow_jax.model.config import qwen3_preset
    from sparrow_jax.rollout import continuous, continuous_state, warmup
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.rollout.page_pool import pool_layout

    mcfg = qwen3_preset("qwen3-1.7b")
    for ladders in ({}, dict(slot_ladder=4, page_ladder=8, min_table_pages=3, min_slots=2)):
        rc = RolloutConfig(engine="paged", max_new_tokens=300, max_budget=64, **ladders)
        layout = pool_layout(mcfg, rc, "float32", rows=24, prompt_width=64, group_size=4, data=2)
        progs = warmup.programs(rc, layout, rows=24, prompt_width=64, group_size=4,
                                dtype="float32")
        grid = {(continuous_state.slot_bucket(s, 12, rc) * 2, continuous_state.page_bucket(m, 23, rc))
                for s in range(1, 13) for m in range(1, 24)}
        decode = [dict(p.shapes) for p in progs if p.function == "decode_chunk_program"]
        assert {(d["slots"], d["pages_per_slot"]) for d in decode} == grid
        assert len(decode) == len(grid) and layout.max_pages == 23
        [pre] = [dict(p.shapes) for p in progs if p.function == "prefill_program"]
        assert pre["rows"] == 2 * continuous_state.row_bucket(3, 12, rc) and pre["group_size"] == 4
    assert grid == {(4, 3), (4, 23), (16, 3), (16, 23), (24, 3), (24, 23)}
    # min_slots floors the running slots, not the prefill rows (an empty row prefills its width).
    assert continuous_state.slot_bucket(1, 12, rc) == 2 and continuous_state.row_bucket(1, 12, rc) == 1
    assert warmup.distinct_programs(progs, progs) == progs
