"""Checkpointing of a run with orbax: params + optimizer state + JSON extras + operative gin config.

Layout (one orbax step directory per saved step, under ``run_dir/checkpoints``)::

    run_dir/checkpoints/<step>/params/            # StandardSave of the params pytree (OCDBT)
    run_dir/checkpoints/<step>/opt_state/         # StandardSave of the optax state pytree
    run_dir/checkpoints/<step>/extra/metadata     # JSON: data-iterator state, controller, rng, ...
    run_dir/checkpoints/<step>/operative_config/operative_config.gin   # gin text, if given

Why the gin file is an orbax *item* (a tiny custom handler) and not a file written next to the
step afterwards: orbax writes every item into ``<step>.orbax-checkpoint-tmp`` and renames the
directory only when all items are committed, so the config is finalized atomically with the
weights, is deleted together with its step by ``max_to_keep``, works unchanged with async saves
and multiple processes (process 0 writes it), and a file dropped into a step directory by hand
could race orbax's finalize/delete threads.

Atomicity: a crash mid-save leaves only a ``<step>.orbax-checkpoint-tmp`` directory, which step
discovery ignores (``latest_step`` is the last finalized step) and which is removed when the next
manager opens the directory (``cleanup_tmp_directories``). Old steps are deleted only after the
new one is finalized, so even ``max_to_keep=1`` never leaves the run without a good checkpoint.

Preemption: once ``jax.distributed`` is initialized, JAX's preemption notifier swallows SIGTERM
and only reports it through ``reached_preemption(step)``. The train loop must therefore call
:meth:`CheckpointManager.should_stop_for_preemption` every step (on all processes, same step) and,
when it returns True, save with ``force=True``, ``close()`` and exit. Single-process runs get the
same behaviour with ``catch_sigterm=True``.

Restoring needs an abstract target (``jax.ShapeDtypeStruct`` with ``sharding``) so arrays land on
the *current* mesh, which may differ from the one that saved them; see :func:`abstract_like` and
:func:`abstract_with_shardings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import posixpath
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # orbax's own path library: local paths and gs:// (s3://, ...) URIs

from sparrow_jax.runtime.run_files import (PyTree, abstract_like, abstract_with_shardings,  # noqa: F401
                                   decode_extra, encode_extra, is_uri, resolve_run_dir,
                                   save_json_atomic, tree_path_names, write_text_atomic)

__all__ = ["CheckpointManager", "abstract_like", "abstract_with_shardings", "decode_extra",
           "encode_extra", "is_uri", "resolve_run_dir", "save_json_atomic", "tree_path_names",
           "write_text_atomic"]

CHECKPOINT_SUBDIR = "checkpoints"
OPERATIVE_CONFIG_FILE = "operative_config.gin"
# "distill": the DistillSparse adapter and its optimizer state (sparrow_jax.rl.distill), only in
# runs with an adapter; steps without it (older runs, rank 0) restore as before.
_ITEMS = ("params", "opt_state", "extra", "operative_config", "distill")


# -- the gin-config item: a minimal text CheckpointHandler ----------------------------------------


class TextHandler(ocp.handlers.CheckpointHandler):
    """Saves one string as ``operative_config.gin`` inside the item directory (process 0 only)."""

    def save(self, directory: epath.Path, args: "_TextSave") -> None:
        if jax.process_index() == 0:
            (directory / OPERATIVE_CONFIG_FILE).write_text(args.text)

    def restore(self, directory: epath.Path, args: "_TextRestore | None" = None) -> str:
        return (directory / OPERATIVE_CONFIG_FILE).read_text()


@ocp.args.register_with_handler(TextHandler, for_save=True)
@dataclasses.dataclass
class _TextSave(ocp.args.CheckpointArgs):
    text: str


@ocp.args.register_with_handler(TextHandler, for_restore=True)
@dataclasses.dataclass
class _TextRestore(ocp.args.CheckpointArgs):
    pass


# -- the manager ----------------------------------------------------------------------------------


class _DropReadOnlyNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "directory is read only" not in record.getMessage()


@contextlib.contextmanager
def _quiet_read_only_warning(active: bool):
    """Orbax logs a WARNING that the directory is read only when it is opened read_only - which
    is what was asked for, so it would only alarm `sparrow export` users."""
    if not active:
        yield
        return
    flt = _DropReadOnlyNotice()
    logger = logging.getLogger("absl")
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def last_checkpoint_phrase(step: Any) -> str:
    """What a stopped run tells its user about resuming, for the newest saved `step` (None:
    nothing saved yet)."""
    if step is None:
        return ("no checkpoint was saved yet, so re-running the same command starts the run "
                "from the beginning")
    return f"the last checkpoint is step {step} (re-run the same command to resume)"


class CheckpointManager:
    """Saves/restores ``(params, opt_state, extra, operative_config)`` per step of a run.

    Every process must call ``save``/``restore``/``should_stop_for_preemption`` (orbax syncs them
    and writes from the right processes); arrays may be sharded across processes.

    Args:
      run_dir: run directory; checkpoints go to ``run_dir/checkpoints``.
      max_to_keep: keep only the newest N finalized steps (``None``: keep all).
      save_interval_steps: ``save`` is a no-op unless ``step % save_interval_steps == 0``, or
        ``force=True``, or a preemption was signalled, or the run has no checkpoint yet (orbax's
        InitialSavePolicy: the first ``save`` of a fresh run always writes).
      enable_async: write in a background thread after the device->host copy. Off by default: on
        CPU there is no device transfer to overlap, and sync saves make "returned == on disk".
        When on, ``close()`` (or ``wait_until_finished()``) must be called before exiting.
      catch_sigterm: in single-process runs, turn SIGTERM into ``should_stop_for_preemption() ==
        True`` (multi-process runs get this from JAX's preemption notifier). The previous handler
        is restored by ``close()``. Only possible from the main thread.
      catch_sigint: in single-process runs, the first Ctrl-C (SIGINT) acts like SIGTERM; a
        second one exits the process at once (status 130). Restored by ``close()``.
      read_only: open an existing run only to read it (``sparrow export``, possibly while the
        run is still training): nothing is created, saved or deleted - in particular the
        ``<step>.orbax-checkpoint-tmp`` directory of the live run's in-progress save is left alone.

    ``run_dir`` may be a URI (``gs://bucket/run``): it is handed to orbax unchanged.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        enable_async: bool = False,
        catch_sigterm: bool = False,
        catch_sigint: bool = False,
        read_only: bool = False,
    ) -> None:
        self.run_dir = os.fspath(run_dir)
        # posixpath, not os.path: also right for URIs ("gs://b/run" + "checkpoints").
        self.directory = posixpath.join(self.run_dir, CHECKPOINT_SUBDIR)
        self.read_only = read_only
        if read_only:
            if not epath.Path(self.directory).is_dir():
                raise FileNotFoundError(f"no checkpoint directory {self.directory} (is "
                                        f"{self.run_dir} a `sparrow train` run directory?)")
            options = ocp.CheckpointManagerOptions(read_only=True, max_to_keep=None,
                                                   save_interval_steps=0, create=False,
                                                   cleanup_tmp_directories=False)
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=enable_async,
                # Remove <step>.orbax-checkpoint-tmp leftovers of a crashed save (runs in the
                # background; the next save waits for it).
                cleanup_tmp_directories=True,
                create=True,
            )
        with _quiet_read_only_warning(read_only):
            self._mngr = ocp.CheckpointManager(self.directory, item_names=_ITEMS, options=options)
        self._sigterm = threading.Event()
        self._prev_sigterm: Callable[[int, FrameType | None], Any] | int | None = None
        self._sigterm_installed = False
        if catch_sigterm and jax.process_count() == 1:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("catch_sigterm=True needs the main thread (signal handlers)")
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        self._prev_sigint: Any = None
        # Called by a second Ctrl-C just before the exit at once (the trainer stops its reward
        # workers there: they ignore the signal and would otherwise outlive it).
        self.before_exit_at_once: Callable[[], None] | None = None
        self.stop_reason = "preemption requested"
        self.stop_exit_code = 143      # how a shell reports a process SIGTERM ended (128 + 15)
        if (catch_sigint and jax.process_count() == 1
                and threading.current_thread() is threading.main_thread()):
            self._prev_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        self._closed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: saving from inside a signal handler could interleave with a step.
        self._sigterm.set()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-C: the first one stops like SIGTERM (save at the step boundary, exit cleanly);
        a second one exits at once. Exiting skips the in-progress step, and any half-written
        step directory is only a `<step>.orbax-checkpoint-tmp` that step discovery ignores and
        the next start removes: the last finalized checkpoint is intact."""
        if not self._sigterm.is_set():
            self._sigterm.set()
            self.stop_reason = "interrupted (Ctrl-C)"
            self.stop_exit_code = 130
            logging.getLogger(__name__).warning(
                "Ctrl-C: saving at the end of this step and stopping (press Ctrl-C again to "
                "stop at once, losing the steps since the last checkpoint)")
            return
        # Not orbax's latest_step(): the handler may run while orbax holds its own locks.
        try:
            latest: Any = max((int(n) for n in os.listdir(self.directory) if n.isdigit()),
                              default=None)
        except OSError:           # a URI, or unreadable: the message names no step
            latest = "unknown"
        if self.before_exit_at_once is not None:
            try:
                self.before_exit_at_once()
            except Exception:  # noqa: BLE001 - exiting regardless; the message below counts
                pass
        sys.stderr.write(f"\nstopped at once by a second Ctrl-C; the step in flight was not "
                         f"saved; {last_checkpoint_phrase(latest)}; run directory "
                         f"{self.directory}\n")
        sys.stderr.flush()
        os._exit(130)        # no cleanup that could block or half-finish a write

    # -- queries ---------------------------------------------------------------------------------

    @property
    def orbax_directory(self) -> str:
        """The directory the orbax manager (tensorstore) opens, as it names it."""
        return str(self._mngr.directory)

    def latest_step(self) -> int | None:
        """Newest finalized step, or ``None`` if the run has no checkpoint yet."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """All finalized steps, ascending."""
        return sorted(self._mngr.all_steps())

    def reload(self) -> None:
        """Re-reads the step list from disk (after steps were moved away by hand or by
        `faults.restore_newest_good`)."""
        self._mngr.reload()

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would write (interval reached, or preemption)."""
        return self._sigterm.is_set() or self._mngr.should_save(step)

    def should_stop_for_preemption(self, step: int) -> bool:
        """True once a preemption (SIGTERM) was signalled: save with ``force=True`` and exit.

        Call every step on every process with the same ``step``: with ``jax.distributed`` this is
        a sync point where all processes agree on the step to stop at.
        """
        return self._sigterm.is_set() or self._mngr.reached_preemption(step)

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM or Ctrl-C arrived: the run saves at the step boundary and stops."""
        return self._sigterm.is_set()

    def step_dir(self, step: int) -> str:
        """Directory of a finalized step (``run_dir/checkpoints/<step>``)."""
        return posixpath.join(self.directory, str(step))

    # -- save / restore --------------------------------------------------------------------------

    def save(
        self,
        step: int,
        params: PyTree,
        opt_state: PyTree,
        extra: dict[str, Any] | None = None,
        *,
        operative_config: str | None = None,
        force: bool = False,
        distill: PyTree | None = None,
    ) -> bool:
        """Saves one step if due; returns whether a checkpoint was written (or started, if async).

        Args:
          step: training step to file the checkpoint under.
          params: pytree of arrays (NNX ``State``, dict, ...), possibly sharded.
          opt_state: optax state pytree.
          extra: JSON-able dict, after :func:`encode_extra` (bytes, arrays, PRNG keys allowed).
          operative_config: gin config text (``gin.operative_config_str()``), stored in the step.
          force: save even if ``step`` is not on the save interval. An existing step is never
            overwritten (returns False).
          distill: pytree of the DistillSparse adapter + its optimizer state (``None``: no item).
        """
        step = int(step)
        if self.read_only:
            raise RuntimeError(f"CheckpointManager({self.run_dir!r}) was opened read_only")
        if step in self._mngr.all_steps():
            return False
        force = force or self._sigterm.is_set()
        items: dict[str, Any] = {
            "params": ocp.args.StandardSave(params),
            "opt_state": ocp.args.StandardSave(opt_state),
            "extra": ocp.args.JsonSave(encode_extra(dict(extra or {}))),
        }
        if operative_config is not None:
            items["operative_config"] = _TextSave(operative_config)
        if distill is not None:
            items["distill"] = ocp.args.StandardSave(distill)
        saved = bool(self._mngr.save(step, args=ocp.args.Composite(**items), force=force))
        return saved

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finalized checkpoint in {self.directory}")
        elif int(step) not in self._mngr.all_steps():
            raise FileNotFoundError(f"step {step} not in {self.directory}; available steps: "
                                    f"{self.all_steps()}")
        return int(step)

    def restore(
        self,
        step: int | None = None,
        abstract_params: PyTree | None = None,
        abstract_opt_state: PyTree | None = None,
    ) -> tuple[PyTree | None, PyTree | None, dict[str, Any]]:
        """Restores ``(params, opt_state, extra)`` of ``step`` (default: latest finalized).

        Args:
          step: step to restore; ``None`` = :meth:`latest_step`.
          abstract_params: target pytree with ``ShapeDtypeStruct(..., sharding=...)`` leaves (see
            :func:`abstract_like`, :func:`abstract_with_shardings`); arrays are restored directly
            into these shardings, so the mesh may differ from the saving run. The result has this
            tree's structure (e.g. an NNX ``State``). ``None`` skips params (returns ``None``).
          abstract_opt_state: same for the optimizer state; ``None`` skips it.

        Returns:
          ``(params, opt_state, extra)`` with ``extra`` decoded by :func:`decode_extra`.

        Raises:
          FileNotFoundError: no checkpoint, or ``step`` is not a finalized step.
        """
        step = self._resolve_step(step)
        items: dict[str, Any] = {"extra": ocp.args.JsonRestore()}
        if abstract_params is not None:
            items["params"] = ocp.args.StandardRestore(abstract_params)
        if abstract_opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
        out = self._mngr.restore(step, args=ocp.args.Composite(**items))
        params = out["params"] if abstract_params is not None else None
        opt_state = out["opt_state"] if abstract_opt_state is not None else None
        return params, opt_state, decode_extra(out["extra"])

    def restore_params(self, step: int | None, abstract_params: PyTree) -> PyTree:
        """Restores only the params item of ``step`` (default latest): the optimizer state (2x
        the params in AdamW) is never read. ``abstract_params`` as in :meth:`restore`."""
        step = self._resolve_step(step)
        out = self._mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params)))
        return out["params"]

    def restore_distill(self, step: int | None, abstract: PyTree) -> PyTree | None:
        """The ``distill`` item of ``step`` (default latest) restored onto ``abstract`` (as in
        :meth:`restore`), or ``None`` when the step has none (saved without an adapter)."""
        step = self._resolve_step(step)
        if not (epath.Path(self.step_dir(step)) / "distill").exists():
            return None
        out = self._mngr.restore(step, args=ocp.args.Composite(
            distill=ocp.args.StandardRestore(abstract)))
        return out["distill"]

    def params_metadata(self, step: int | None = None
                        ) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
        """``{path: (shape, dtype)}`` of the params saved at ``step`` (default latest), read from
        orbax's metadata without loading any array; a path is the tuple of the tree's keys as
        strings (an NNX ``State`` gives e.g. ``("layers", "0", "mlp", "up_proj", "kernel",
        "value")``, see :func:`tree_path_names`)."""
        directory = epath.Path(self.step_dir(self._resolve_step(step))) / "params"
        tree = ocp.StandardCheckpointHandler().metadata(directory).tree
        return {tree_path_names(p): (tuple(m.shape), np.dtype(m.dtype))
                for p, m in jax.tree_util.tree_leaves_with_path(tree)}

    def read_operative_config(self, step: int | None = None) -> str | None:
        """Gin config text saved with ``step`` (default latest), or ``None`` if none was given."""
        path = (epath.Path(self.step_dir(self._resolve_step(step))) / "operative_config"
                / OPERATIVE_CONFIG_FILE)
        if not path.exists():
            return None
        return path.read_text(encoding="utf-8")

    # -- lifecycle -------------------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until an async save has been finalized (no-op for sync saves)."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, releases orbax resources, restores the SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self._mngr.close()
        finally:
            if self._sigterm_installed:
                # None means "installed from C"; SIG_DFL is the closest Python can restore.
                prev = self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL
                signal.signal(signal.SIGTERM, prev)
                self._sigterm_installed = False
            if self._prev_sigint is not None:
                signal.signal(signal.SIGINT, self._prev_sigint)
                self._prev_sigint = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
