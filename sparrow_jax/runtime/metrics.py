"""Run metrics: TensorBoard event files (without TensorFlow), a JSONL mirror, and step timers.

Why not ``flax.metrics.tensorboard`` or ``clu``: both import TensorFlow, which we do not install.
TensorBoard ships its own ``EventFileWriter`` and the ``Summary``/``Event`` protos, which is all an
event file needs. Scalars are written as ``simple_value`` summaries (TensorBoard's data-compat layer
shows them in the Scalars dashboard); text as a string tensor tagged for the text plugin.

Every ``scalars`` call is also appended to ``run_dir/metrics.jsonl`` and flushed immediately, so a
crash loses at most the line being written (the event file is flushed by a background thread).

Layout of a run directory written here::

    run_dir/events.out.tfevents.*   # one file per MetricsWriter (i.e. per (re)start)
    run_dir/metrics.jsonl           # {"step": s, "time": unix_seconds, "<tag>": value|null, ...}

A run directory may be a URI (``gs://bucket/run``). Object stores cannot append to a file, and
TensorBoard's writer (without TensorFlow) reaches a bucket only through an optional fsspec plugin,
so for a URI both files are written to a local mirror directory (named in a log line) and the
whole files are copied to the URI with ``etils.epath`` every ``flush_secs``, on ``flush()`` and
on ``close()``; a resumed run first copies the URI's ``metrics.jsonl`` back into the mirror.

Only process 0 writes (``jax.process_index() == 0``); other processes get a no-op writer so the
train loop can call it unconditionally.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from collections import defaultdict
from types import TracebackType
from typing import Any, Callable, Mapping

import jax
import numpy as np
from etils import epath
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from sparrow_jax.runtime import compile_cache

__all__ = [
    "MetricsWriter",
    "StepTimer",
    "Timer",
    "gin_config_markdown",
    "read_jsonl",
    "read_scalars",
    "read_text",
]

JSONL_NAME = "metrics.jsonl"
EVENTS_PREFIX = "events.out.tfevents."
log = logging.getLogger(__name__)


def _is_uri(path: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path))


def local_mirror_dir(uri: str) -> str:
    """The local directory that mirrors a URI run directory's metrics files (one per URI)."""
    return os.path.join(tempfile.gettempdir(), "sparrow-metrics-mirror",
                        re.sub(r"[^A-Za-z0-9._-]+", "_", uri))


def _to_float(tag: str, value: Any) -> float:
    """Converts a Python/NumPy/JAX scalar (shape ``()`` or ``(1,)``) to a Python float."""
    arr = np.asarray(value)  # device -> host copy for jax arrays; cheap for scalars
    if arr.size != 1:
        raise ValueError(f"metric {tag!r} must be a scalar, got shape {arr.shape}")
    return float(arr.reshape(()))


class MetricsWriter:
    """Writes scalar and text summaries for one run.

    Args:
      run_dir: directory for the event file and ``metrics.jsonl`` (created if missing).
      flush_secs: how often the event-file background thread flushes to disk.
      enabled: force writing on/off; default ``jax.process_index() == 0``.

    Usage::

        with MetricsWriter(run_dir) as mw:
            mw.text(0, "config/operative_gin", gin_config_markdown(gin.operative_config_str()))
            mw.scalars(step, {"loss": loss, "time/rollout": 1.2})
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], *, flush_secs: float = 30.0, enabled: bool | None = None
    ) -> None:
        self.run_dir = os.fspath(run_dir)
        self.enabled = (jax.process_index() == 0) if enabled is None else bool(enabled)
        self._events: EventFileWriter | None = None
        self._jsonl: Any = None
        self._flush_secs = flush_secs
        # Where the files are written: the run directory itself, or a local mirror of a URI.
        self.local_dir = local_mirror_dir(self.run_dir) if _is_uri(self.run_dir) else self.run_dir
        self._last_upload = time.monotonic()
        if self.enabled:
            os.makedirs(self.local_dir, exist_ok=True)
            if self.local_dir != self.run_dir:
                remote = epath.Path(self.run_dir)
                remote.mkdir(parents=True, exist_ok=True)
                # The URI is the record: drop what an earlier process left in the mirror (its
                # close() uploaded it), then continue the URI's metrics.jsonl on resume.
                for name in os.listdir(self.local_dir):
                    if name == JSONL_NAME or name.startswith(EVENTS_PREFIX):
                        os.remove(os.path.join(self.local_dir, name))
                if (remote / JSONL_NAME).exists():
                    with open(os.path.join(self.local_dir, JSONL_NAME), "wb") as f:
                        f.write((remote / JSONL_NAME).read_bytes())
                log.info("metrics of %s are written to the local mirror %s and copied to the URI "
                         "every %.0f s and at close", self.run_dir, self.local_dir, flush_secs)
            self._events = EventFileWriter(self.local_dir, flush_secs=flush_secs)
            # Append mode: a resumed run continues the same file; readers keep the last line per step.
            self._jsonl = open(os.path.join(self.local_dir, JSONL_NAME), "a", encoding="utf-8")

    # -- writing -------------------------------------------------------------------------------

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Writes one scalar per tag at ``step``.

        ``None`` values are skipped (metric not available this step); NaN/inf are written as-is to
        TensorBoard and as ``null`` to the JSONL file (JSON has no NaN).
        """
        if not self.enabled or self._events is None:
            return
        step = int(step)
        now = time.time()
        floats = {tag: _to_float(tag, v) for tag, v in values.items() if v is not None}
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in floats.items()]
        )
        self._events.add_event(event_pb2.Event(wall_time=now, step=step, summary=summary))
        record: dict[str, Any] = {"step": step, "time": now}
        record.update({tag: (v if math.isfinite(v) else None) for tag, v in floats.items()})
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush per call: the JSONL file is the crash-proof record of the run.
        self._jsonl.flush()
        mirrored = self.local_dir != self.run_dir
        if mirrored and time.monotonic() - self._last_upload >= self._flush_secs:
            self.flush()

    def truncate_after(self, step: int | None) -> int:
        """Drops the ``metrics.jsonl`` lines of steps after ``step`` (every line when ``None``)
        and torn lines; returns how many were dropped. A resumed run calls it with the restored
        step, so steps it redoes after a crash are not recorded twice.

        TensorBoard: the event files of earlier processes cannot be edited; a ``SessionLog.START``
        event at ``step + 1`` is written instead, which TensorBoard's event loader takes as
        "points at this step or later from before this event are superseded" (its
        ``purge_orphaned_data``; :func:`read_scalars` reads with it)."""
        if not self.enabled or self._jsonl is None:
            return 0
        self._jsonl.close()
        path = os.path.join(self.local_dir, JSONL_NAME)
        kept, dropped = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    keep = step is not None and int(record["step"]) <= step
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    keep = False
                if keep:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
        if dropped:
            fd, tmp = tempfile.mkstemp(dir=self.local_dir, prefix=".tmp-" + JSONL_NAME)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        self._jsonl = open(path, "a", encoding="utf-8")
        start = 0 if step is None else step + 1
        self._events.add_event(event_pb2.Event(
            wall_time=time.time(), step=start,
            session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        return dropped

    def text(self, step: int, tag: str, markdown: str) -> None:
        """Writes a text-plugin summary (rendered as markdown by TensorBoard)."""
        if not self.enabled or self._events is None:
            return
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),  # rank 0: a single string
            string_val=[markdown.encode("utf-8")],
        )
        meta = text_metadata.create_summary_metadata(display_name=None, description=None)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])
        self._events.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        """Forces pending events and the JSONL file to disk."""
        if self._events is not None:
            self._events.flush()
        if self._jsonl is not None:
            self._jsonl.flush()
        self._upload()

    def _upload(self) -> None:
        """Copies the mirrored files to a URI run directory (whole files: no appends on object
        stores); a no-op for local run directories."""
        if not self.enabled or self.local_dir == self.run_dir:
            return
        remote = epath.Path(self.run_dir)
        for name in sorted(os.listdir(self.local_dir)):
            if name == JSONL_NAME or name.startswith(EVENTS_PREFIX):
                with open(os.path.join(self.local_dir, name), "rb") as f:
                    (remote / name).write_bytes(f.read())
        self._last_upload = time.monotonic()

    def close(self) -> None:
        """Flushes and closes; further calls become no-ops. Idempotent."""
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        self._upload()
        self.enabled = False

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def gin_config_markdown(config_str: str) -> str:
    """Formats a gin config (e.g. ``gin.operative_config_str()``) as a markdown code block.

    Indenting every line keeps gin comments (``# ...``) from rendering as markdown headings.
    """
    return "\n".join("    " + line for line in config_str.splitlines())


# -- reading back (tests, demo summaries) ---------------------------------------------------------


def _accumulator(run_dir: str | os.PathLike[str]) -> Any:
    # Imported lazily: the backend pulls in more of TensorBoard than writing needs.
    from tensorboard.backend.event_processing import event_accumulator as ea

    # size_guidance 0 = keep every event (the default reservoir-samples scalars down to 10k).
    acc = ea.EventAccumulator(os.fspath(run_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def read_scalars(run_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Reads all scalar summaries of ``run_dir``'s event files: ``{tag: [(step, value), ...]}``."""
    acc = _accumulator(run_dir)
    return {tag: [(e.step, float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_text(run_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, str]]]:
    """Reads text-plugin summaries back: ``{tag: [(step, markdown), ...]}``."""
    acc = _accumulator(run_dir)
    out: dict[str, list[tuple[int, str]]] = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != text_metadata.PLUGIN_NAME:
            continue
        out[tag] = [(e.step, e.tensor_proto.string_val[0].decode("utf-8")) for e in acc.Tensors(tag)]
    return out


def read_jsonl(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads ``run_dir/metrics.jsonl``; a torn last line (crash mid-write) is dropped."""
    path = epath.Path(os.fspath(run_dir)) / JSONL_NAME  # epath: a gs:// run directory reads too
    records = []
    with path.open("r") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


# -- step timing ----------------------------------------------------------------------------------


class _Section:
    """One timed ``with`` block; see :class:`StepTimer`."""

    def __init__(self, timer: "StepTimer", name: str) -> None:
        self._timer = timer
        self._name = name
        self._pending: list[Any] = []
        self._start = 0.0
        self._compiled = 0.0

    def ready(self, tree: Any) -> Any:
        """Marks ``tree`` (outputs of async JAX dispatch) to be waited on before the clock stops.

        Returns ``tree`` unchanged so it can wrap an expression: ``out = sec.ready(f(x))``.
        """
        self._pending.append(tree)
        return tree

    def __enter__(self) -> "_Section":
        self._compiled = self._timer.compile_seconds()
        self._start = time.perf_counter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Without blocking, JAX's async dispatch would bill device time to whichever section
        # happens to touch the result next.
        if self._timer.block_until_ready is not None and self._pending and exc_type is None:
            self._timer.block_until_ready(self._pending)
        self._pending = []
        self._timer._add(self._name, time.perf_counter() - self._start,
                         self._timer.compile_seconds() - self._compiled)


class StepTimer:
    """Accumulates wall-clock seconds per named section, for the "time split of a step" metrics.

    Args:
      prefix: prepended to section names in :meth:`summary` (``"time/"`` -> ``time/rollout``).
      block_until_ready: called on the trees passed to ``section.ready(...)`` before a section's
        clock stops; ``None`` disables waiting (then times are dispatch times only).
      compile_seconds: the process's compile seconds so far (`compile_cache.compile_seconds`,
        which counts once the compile log listens): what a section's compiles took is reported
        beside its time, as ``<prefix>compile/<name>`` where nonzero (inside, not beside, the
        section's wall time).

    Usage::

        timer = StepTimer()
        with timer("rollout") as sec:
            batch = sec.ready(rollout(params, prompts))
        with timer("learner") as sec:
            params, opt_state, m = sec.ready(train_step(params, opt_state, batch))
        writer.scalars(step, {**m, **timer.summary()})  # {"time/rollout": s, "time/learner": s}

    Sections may repeat within a step (times add up) or nest (each counts its own wall time, so
    nested sections overlap in the sum).
    """

    def __init__(
        self,
        prefix: str = "time/",
        block_until_ready: Callable[[Any], Any] | None = jax.block_until_ready,
        compile_seconds: Callable[[], float] = compile_cache.compile_seconds,
    ) -> None:
        self.prefix = prefix
        self.block_until_ready = block_until_ready
        self.compile_seconds = compile_seconds
        self._totals: dict[str, float] = defaultdict(float)
        self._compiles: dict[str, float] = defaultdict(float)

    def __call__(self, name: str) -> _Section:
        return _Section(self, name)

    def _add(self, name: str, seconds: float, compile_seconds: float = 0.0) -> None:
        self._totals[name] += seconds
        if compile_seconds > 0:
            self._compiles[name] += compile_seconds

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per section name (without prefix) since the last reset."""
        return dict(self._totals)

    def reset(self) -> None:
        self._totals.clear()
        self._compiles.clear()

    def summary(self, reset: bool = True) -> dict[str, float]:
        """Returns ``{prefix + name: seconds}`` and ``{prefix + "compile/" + name: seconds}``
        where a section compiled; by default starts a new accumulation period."""
        out = {self.prefix + name: secs for name, secs in self._totals.items()}
        out.update({f"{self.prefix}compile/{name}": secs
                    for name, secs in self._compiles.items()})
        if reset:
            self.reset()
        return out


# The brief names both; one class serves either use.
Timer = StepTimer
