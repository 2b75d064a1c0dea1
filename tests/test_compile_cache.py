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
    from sparrow_jax.train_config import TrainConfig
    import dataclasses
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["compile_cache_dir"]
    assert field.default == "auto"
    assert "compile_cache.configure(cfg.compile_cache_dir)" in (REPO / "sparrow_jax/train.py").read_text()


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
