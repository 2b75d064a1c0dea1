import os
import sys

# Tests run on CPU; keep XLA quiet and deterministic.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


def _shared_compilation_cache() -> None:
    """One persistent XLA compilation cache for the whole test session: every test module (jax's
    in-memory caches are cleared between modules, below), every pytest-xdist worker and every
    `sparrow train` subprocess the tests start compile the same tiny-model programs again and
    again. Set before jax is imported; subprocesses and xdist workers inherit it through the
    environment. SPARROW_TEST_XLA_CACHE=0 turns it off (e.g. to time cold compiles)."""
    if os.environ.get("SPARROW_TEST_XLA_CACHE", "1") == "0" or os.environ.get(
            "JAX_COMPILATION_CACHE_DIR"):
        return
    import atexit
    import shutil
    import tempfile
    cache = tempfile.mkdtemp(prefix="sparrow-test-xla-cache-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    # Tiny programs compile in well under jax's default 1 s threshold; cache them all.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


_shared_compilation_cache()


def _quick_cpu_codegen() -> None:
    """XLA's CPU backend compiles the tests' programs with LLVM at -O0
    (`--xla_backend_optimization_level=0`): the tests' tiny programs spend far longer in LLVM's
    optimiser than they run, and most of the suite's time is such compiles (measured 2026-11-25:
    tests/test_paged.py 80 -> 59 s, 34% less CPU). XLA's own HLO passes are unchanged and no
    fast-math is enabled, so values are the same computation; only the machine code is slower.
    Subprocesses inherit it (`cpu_devices_flags` keeps it beside a device count); the TPU / GPU
    compile-only tests strip XLA_FLAGS from their subprocesses. SPARROW_TEST_QUICK_CODEGEN=0
    turns it off."""
    if os.environ.get("SPARROW_TEST_QUICK_CODEGEN", "1") == "0":
        return
    flag = "--xla_backend_optimization_level=0"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_quick_cpu_codegen()

import logging  # noqa: E402

import gin  # noqa: E402
import pytest  # noqa: E402


# The files that take minutes, longest first (from timed runs: re-order them when a file's cost
# changes).
# pytest-xdist (`--dist loadfile`) hands out whole files in collection order; by default it first
# sorts them by their number of tests, which starts the many quick parametrized files first and
# leaves the few-test, minutes-long ones (dryruns, multi-process runs) for the end, where one of
# them alone sets the run's tail. Longest first, the quick files fill in beside them. The
# in-process files come right after the dryruns (one compile subprocess at a time): the
# multi-process files' own timeouts (a launch, a dead peer noticed) should not start beside them.
#
# The two files of `sparrow train` subprocesses go first: `launch/local.sh test` installs the
# compile-only toolchains in the background meanwhile (minutes of downloads), which the guard
# (tests/test_shipped_configs.py, CI's longest item) waits for; it starts as soon as one of them ends.
LONGEST_FIRST = (
    "test_faults.py", "test_run_safety.py", "test_shipped_configs.py", "test_dryrun.py",
    "test_train.py", "test_reference_eval.py", "test_multihost_paged.py",
    "test_decode_hlo.py", "test_compile.py", "test_doctor.py",
    "test_multihost.py", "test_experiment.py", "test_user_mistakes.py", "test_docs.py",
    "test_kernels.py", "test_distill.py", "test_compression.py", "test_rollout_sharded.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):       # pytest-xdist: keep our file order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: files stay whole


@pytest.fixture(autouse=True)
def _fresh_gin_config():
    """Gin-configurable classes (LearnerConfig, RolloutConfig, ...) pick up whatever an earlier
    test's `sparrow ...` command bound: every test starts and ends with no bindings."""
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """One pytest process runs ~450 tests: drop each module's compiled programs when it ends
    (jax's caches otherwise keep every executable of the session alive)."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def restore_logging():
    """The logging setup a command changed (root level and handlers, the libraries' levels,
    warnings capture) put back after the test: `sparrow` commands configure logging."""
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])
    levels = {n: logging.getLogger(n).level for n in ("absl", "orbax", "jax", "etils", "grain")}
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for n, lv in levels.items():
        logging.getLogger(n).setLevel(lv)
    logging.captureWarnings(False)

