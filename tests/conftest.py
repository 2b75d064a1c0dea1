import os
import sys

# Tests run on CPU; keep XLA quiet and deterministic.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import gin  # noqa: E402
import pytest  # noqa: E402


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
