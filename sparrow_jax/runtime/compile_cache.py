"""Persistent XLA compilation cache, and compile seconds per program in the log.

A real run compiles tens of programs (rollout chunks per length bucket, learner programs, the
evaluation), minutes each at full depth, before step 1 logs anything - and again after every
restart or preemption. With the cache, a re-run or resume loads them from disk.

`TrainConfig.compile_cache_dir`:
  "auto"  jax's own setting when there is one (JAX_COMPILATION_CACHE_DIR, e.g. the test
          suite's shared cache), else on for GPU/TPU in $SPARROW_COMPILE_CACHE or
          ~/.cache/sparrow-jax/xla and off on CPU (CPU programs compile in seconds)
  a path  on, there (any platform; local directory or a URI jax can write, e.g. gs://)
  ""      off

Every backend compile is logged with its program name and seconds ("compiled jit(step) in 41.2
s" / "loaded jit(step) from the compilation cache in 0.3 s"): at INFO from 1 s, else DEBUG.
`compile_seconds()` adds them up for the process (what `StepTimer` charges to each section).
The cache is trusted code: never point it at a directory others can write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

import jax

log = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_INFO_SECONDS = 1.0          # shorter compiles go to DEBUG (hundreds of tiny ones on CPU)
_state = threading.local()
_listening = False
_counters: list[list[str]] = []      # open `count_compiles` blocks
_seconds = [0.0]                     # backend compile (and cache load) seconds, this process


def default_dir() -> str:
    return os.environ.get("SPARROW_COMPILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "sparrow-jax", "xla")


def resolve(setting: str, platform: str, preset: str | None = None) -> str | None:
    """The cache directory for `setting` on `platform` ("cpu", "gpu", "tpu"), or None (off).
    `preset`: the directory jax is already configured with (JAX_COMPILATION_CACHE_DIR)."""
    if setting == "":
        return None
    if setting == "auto":
        if preset:
            return preset
        return None if platform == "cpu" else default_dir()
    return setting if "://" in setting else os.path.abspath(os.path.expanduser(setting))


def _on_event(event: str, **kwargs: object) -> None:
    if event == _HIT_EVENT:
        _state.hit = True


def _on_duration(event: str, duration: float, **kwargs: object) -> None:
    if event != _COMPILE_EVENT:
        return
    name = kwargs.get("fun_name", "a program")
    _seconds[0] += duration
    for names in _counters:
        names.append(str(name))
    hit, _state.hit = getattr(_state, "hit", False), False
    level = logging.INFO if (duration >= _INFO_SECONDS or hit) else logging.DEBUG
    if hit:
        log.log(level, "loaded %s from the compilation cache in %.1f s", name, duration)
    else:
        log.log(level, "compiled %s in %.1f s", name, duration)


def _listen() -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True


def compile_seconds() -> float:
    """Seconds this process has spent in backend compiles and persistent-cache loads since it
    started listening (`log_compiles`, `configure` or `count_compiles`; tracing and lowering
    not included); 0.0 before."""
    return _seconds[0]


def log_compiles() -> None:
    """Logs every compile from now on with its seconds (as `configure` does), cache untouched."""
    _listen()


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """The names of the programs jax compiles (or loads from the persistent cache) while the
    block runs, in order: a program jax already holds in memory adds nothing. Tests use it to
    check that a repeated call compiles nothing and that a run compiles what its plan says."""
    _listen()
    names: list[str] = []
    _counters.append(names)
    try:
        yield names
    finally:
        # by identity: another open block's list may be equal
        del _counters[next(i for i, c in enumerate(_counters) if c is names)]


def _reset_if_switched(path: str | None) -> None:
    """jax opens its cache once per process at the first compile after the directory is set;
    a second run in the same process (tests, `sparrow experiment`) with another directory
    needs it reopened."""
    current = jax.config.jax_compilation_cache_dir
    if current == path:
        return
    from jax._src import compilation_cache  # no public API reopens the cache

    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()


def configure(setting: str, *, min_compile_seconds: float | None = None) -> str | None:
    """Turns the persistent cache on (or off) for this process per `setting` (see the module
    docstring) and logs every compile from now on. Returns the directory, or None when off.

    Programs that compile faster than `min_compile_seconds` are not written (not worth the
    disk); None keeps jax's threshold (1 s, or JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS).
    """
    if not isinstance(setting, str):
        raise TypeError(f"TrainConfig.compile_cache_dir must be a string, got {setting!r}")
    _listen()
    platform = jax.default_backend()
    preset = jax.config.jax_compilation_cache_dir
    path = resolve(setting, platform, preset)
    if setting == "auto" and preset:
        # The user's (or the test suite's) own jax setting, thresholds included: left alone.
        log.info("compilation cache: %s (JAX_COMPILATION_CACHE_DIR)", path)
        return path
    if path is not None and "://" not in path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise OSError(f"TrainConfig.compile_cache_dir: cannot create {path!r}: {e}. Point "
                          "it at a writable directory, or set it to '' (off)") from None
    _reset_if_switched(path)
    if path is None:
        why = "TrainConfig.compile_cache_dir = ''" if setting == "" else f"'auto' on {platform}"
        log.info("compilation cache: off (%s); compile times are logged", why)
        return None
    if min_compile_seconds is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    min_compile_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    entries = len(os.listdir(path)) if "://" not in path else "?"
    log.info("compilation cache: %s (%s entries; programs compiling >= %g s are saved and "
             "loaded by a re-run or resume)", path, entries, min_compile_seconds)
    return path
