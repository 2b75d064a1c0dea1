"""Faults and bad input in `sparrow train`: what the run does, in one place.

- `RunError`: a condition that stops the run with a clear one-line message (no traceback).
- Checkpoint integrity: `tree_checksums` fingerprints params and optimizer state at save time
  (stored in the step's JSON extra); `restore_newest_good` restores the newest step that loads
  *and* matches its fingerprints, reports and sets aside any newer step that does not, and names
  the directory when no step is restorable. Orbax alone cannot tell: a truncated array file
  raises, but flipped bytes inside one restore silently as different weights (measured). A step
  another configuration saved is not damage: the caller's `incompatible` check
  (`sparrow_jax.runtime.resume_check`) turns it into a configuration error and nothing moves.
- `NonFiniteGuard`: counts RL steps whose update was skipped for a non-finite loss or gradient
  (the learner leaves parameters and optimizer state untouched then) and stops the run after
  `max_consecutive` of them in a row.
- Input checks: a run directory that cannot be written, a tokenizer whose ids do not fit the
  model's vocabulary, and the longest prompt the rollout can take.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import shutil
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from sparrow_jax.runtime import checkpoint as ckpt

log = logging.getLogger(__name__)

__all__ = ["RunError", "RunStopped", "DamagedCheckpointError", "NonFiniteGuard", "tree_checksums",
           "verify_checksums", "restore_newest_good", "check_run_dir_writable",
           "check_vocabulary", "prompt_capacity", "save_failure", "CHECKSUM_KEY"]

CHECKSUM_KEY = "checksums"
DAMAGED_SUBDIR = "damaged_checkpoints"


class RunError(RuntimeError):
    """The run cannot go on; the message says why and what to do (shown without a traceback)."""


class RunStopped(Exception):
    """The run saved its step and stopped early on a signal (Ctrl-C, SIGTERM, a preemption notice),
    or (`saved=False`) stopped on one before its first step, with nothing to save.

    Not an error, but not a finished run either: `sparrow train` exits with `exit_code` (130 for
    Ctrl-C, 143 for SIGTERM or a preemption, as a shell reports a process the signal ended), so a
    scheduler requeues the job, `sparrow train && sparrow export` does not export a half-trained
    run, and `sparrow experiment` does not count the arm as finished. Re-running resumes."""

    def __init__(self, step: int, reason: str, exit_code: int, *, saved: bool = True):
        super().__init__(
            f"{reason}: saved step {step} and stopped before the run's last step; the same "
            f"command resumes from it" if saved else
            f"{reason} during start-up, before the first step: nothing was trained or saved; "
            f"the run's checkpoints are as they were")
        self.step, self.reason, self.exit_code = step, reason, exit_code


class DamagedCheckpointError(RuntimeError):
    """A finalized checkpoint step whose arrays do not match the fingerprints saved with them."""


# -- checkpoint fingerprints ----------------------------------------------------------------------


def _leaf_words(x: jax.Array) -> jax.Array:
    """The leaf's bits as a flat uint32 vector (16-bit and 8-bit types widened)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


@jax.jit
def _checksums_program(leaves: list[jax.Array]) -> jax.Array:
    out = []
    for x in leaves:
        words = _leaf_words(x)
        # A positional weighted sum mod 2^32 with odd weights: every single-bit change of any
        # element changes it; integer sums are exact in any reduction order, so sharded and
        # unsharded arrays (and any mesh) give the same value.
        weights = jnp.arange(words.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761)
        out.append(jnp.sum(words * (weights | jnp.uint32(1)), dtype=jnp.uint32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def tree_checksums(tree: Any) -> list[int]:
    """One 32-bit fingerprint per array leaf of ``tree`` (in ``jax.tree.leaves`` order)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, (jax.Array, np.ndarray))]
    if not leaves:
        return []
    sums = _checksums_program([jnp.asarray(x) for x in leaves])
    # Replicated output: every process holds the whole vector.
    return [int(v) for v in np.asarray(sums.addressable_data(0))]


def verify_checksums(step: int, items: dict[str, Any], saved: dict[str, Any] | None) -> None:
    """Raises DamagedCheckpointError when a restored item differs from its saved fingerprint.
    Steps saved before fingerprints existed (``saved`` None) pass."""
    if not saved:
        return
    for name, tree in items.items():
        if name not in saved or tree is None:
            continue
        now, then = tree_checksums(tree), [int(v) for v in saved[name]]
        if len(now) != len(then):
            raise DamagedCheckpointError(f"step {step}: {name} has {len(now)} arrays, the "
                                         f"checkpoint's fingerprint lists {len(then)}")
        bad = [i for i, (a, b) in enumerate(zip(now, then)) if a != b]
        if bad:
            raise DamagedCheckpointError(
                f"step {step}: {len(bad)} of {len(now)} {name} arrays differ from the "
                f"fingerprint saved with them (first: array #{bad[0]}): the files are corrupted")


def _set_aside(manager: ckpt.CheckpointManager, step: int) -> str | None:
    """Moves a damaged local step out of the checkpoint directory (kept for inspection), so the
    re-done step can be saved under its number again. URIs are left in place."""
    src = manager.step_dir(step)
    if ckpt.is_uri(src) or jax.process_index() != 0:
        return None
    dest_dir = posixpath.join(manager.run_dir, DAMAGED_SUBDIR)
    os.makedirs(dest_dir, exist_ok=True)
    dest = posixpath.join(dest_dir, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        shutil.move(src, dest)
    except OSError as e:
        log.warning("could not move damaged checkpoint %s aside: %s", src, e)
        return None
    return dest


def restore_newest_good(manager: ckpt.CheckpointManager, restore: Callable[[int], Any],
                        incompatible: Callable[[int], str | None] | None = None
                        ) -> tuple[int, Any] | None:
    """``(step, restore(step))`` for the newest step that restores; None when there are none.

    A step whose ``restore`` raises is first asked ``incompatible(step)``: a message there means
    the step was saved by another configuration (its arrays' structure differs), and that
    message is raised as a RunError at once - nothing is moved. Otherwise the restore is tried
    once more (a transient read error is not damage); a step that still fails, or restores but
    does not match its fingerprints, is damaged: reported with the reason, moved to
    ``run_dir/damaged_checkpoints/`` and the next older step is tried. When steps exist but none
    restores: RunError naming the directory and each step's reason.
    """
    steps = manager.all_steps()
    if not steps:
        return None
    reasons = []
    for step in sorted(steps, reverse=True):
        try:
            try:
                result = restore(step)
            except DamagedCheckpointError:
                raise
            except Exception as first:  # noqa: BLE001 - classified below
                try:
                    message = incompatible(step) if incompatible is not None else None
                except Exception as e:  # noqa: BLE001 - unclassified: never move it
                    raise RunError(f"checkpoint {manager.step_dir(step)} does not restore "
                                   f"({type(first).__name__}: {str(first)[:200]}) and its "
                                   f"structure could not be checked ({type(e).__name__}: "
                                   f"{str(e)[:200]}); nothing was moved") from e
                if message:
                    raise RunError(message) from first
                log.debug("restore of step %d failed; trying once more", step, exc_info=True)
                result = restore(step)
        except RunError:
            raise
        except Exception as e:  # noqa: BLE001 - the same failure twice on a matching step
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            reasons.append(f"step {step}: {reason}")
            moved = _set_aside(manager, step)
            log.warning("checkpoint %s does not restore (%s)%s; trying the previous step",
                        manager.step_dir(step), reason,
                        f"; moved to {moved}" if moved else "")
            log.debug("restore error of step %d", step, exc_info=True)
            continue
        if reasons:
            manager.reload()    # the steps set aside are gone from orbax's list too
        return step, result
    manager.reload()
    raise RunError(f"no restorable checkpoint in {manager.directory}: " + "; ".join(reasons)
                   + ". The steps were moved to " + posixpath.join(manager.run_dir,
                                                                   DAMAGED_SUBDIR)
                   + "; move the run directory away to start the run afresh.")


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC as an OSError, or inside a tensorstore error (orbax raises those as ValueError
    with `os_error_code='28'`)."""
    text = str(error)
    return (getattr(error, "errno", None) == errno.ENOSPC or "os_error_code='28'" in text
            or "No space left on device" in text)


def save_failure(manager: ckpt.CheckpointManager, step: int, error: Exception) -> RunError:
    """The RunError for a checkpoint write that failed (disk full, permissions, ...), after
    removing the step's half-written temporary directory (it would hold the space until the
    next start). Finalized steps are untouched: orbax deletes old steps only after a new one
    is finalized."""
    directory = manager.directory
    if not ckpt.is_uri(directory) and jax.process_index() == 0 and os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    manager.reload()
    kept = manager.all_steps()
    cause = ("the disk is full" if is_disk_full(error)
             else (getattr(error, "strerror", None) or str(error).splitlines()[0][:300]))
    return RunError(f"could not write checkpoint step {step} in {directory}: {cause} "
                    f"({type(error).__name__}). Finalized checkpoints are intact (steps {kept}); "
                    f"free space and re-run the same command to resume from step "
                    f"{kept[-1] if kept else 0}.")


class _OneLine(logging.Filter):
    """Library log records without their traceback, cut to one line of <= 300 characters."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text:
            record.exc_info, record.exc_text = None, None
        message = record.getMessage()
        if "\n" in message or len(message) > 300:
            record.msg, record.args = message.splitlines()[0][:300] + " [...]", None
        return True


def quiet_library_tracebacks() -> None:
    """Console hygiene for faults: orbax/tensorstore errors in background threads (a full disk
    during a save) print one line each instead of pages of tracebacks and JSON specs; the run's
    own error message says what happened. Not at DEBUG level, which shows everything."""
    absl = logging.getLogger("absl")
    if (logging.getLogger().getEffectiveLevel() <= logging.DEBUG
            or any(isinstance(f, _OneLine) for f in absl.filters)):
        return
    absl.addFilter(_OneLine())

    def excepthook(args: Any) -> None:
        name = args.thread.name if args.thread is not None else "?"
        log.warning("background thread %s: %s: %s", name, args.exc_type.__name__,
                    str(args.exc_value).splitlines()[0][:300] if str(args.exc_value) else "")
    threading.excepthook = excepthook
    # A failed restore abandons orbax's in-flight async reads: asyncio then reports each
    # ("Task exception was never retrieved", "Exception ignored in: <coroutine ...>") with the
    # whole TensorStore spec. The run reports the failed step itself (restore_newest_good).
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)

    def unraisable(info: Any) -> None:
        log.debug("ignored in %r: %s", info.object, info.exc_value)
    sys.unraisablehook = unraisable

    # The same abandoned reads complete on TensorStore's own threads after asyncio's loop is
    # gone; their callbacks' "Event loop is closed" goes through sys.excepthook. Only that error
    # is quieted: any other uncaught exception keeps its traceback.
    default_hook = sys.excepthook

    def excepthook_main(exc_type: Any, exc: BaseException, tb: Any) -> None:
        if exc_type is RuntimeError and str(exc) == "Event loop is closed":
            log.debug("ignored after a failed restore: RuntimeError: Event loop is closed")
            return
        default_hook(exc_type, exc, tb)
    sys.excepthook = excepthook_main


# -- numerical faults -----------------------------------------------------------------------------


class NonFiniteGuard:
    """Counts RL steps with a skipped (non-finite) update; says when to stop.

    The counters are part of the checkpoint (``state_dict``), so a resumed run continues them.
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.total = 0
        self.consecutive = 0
        self.first_bad_step: int | None = None

    def observe(self, step: int, skipped_updates: float, metrics: dict[str, float]) -> bool:
        """Records step ``step`` (1-based, the step just taken); True = stop the run now."""
        if not skipped_updates:
            self.consecutive, self.first_bad_step = 0, None
            return False
        self.total += 1
        self.consecutive += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s): update "
                    "skipped, parameters and optimizer state unchanged (%d in a row, %d in the "
                    "run)", step, metrics.get("loss/policy"), metrics.get("loss/grad_norm"),
                    self.consecutive, self.total)
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive

    def stop_message(self, step: int, saved_dir: str) -> str:
        first = self.first_bad_step if self.first_bad_step is not None else step
        return (f"stopping: {self.consecutive} consecutive steps ({first}..{step}) had a "
                f"non-finite loss or gradient (TrainConfig.max_consecutive_skips = "
                f"{self.max_consecutive}). The parameters and optimizer state are those of the "
                f"last good update (before step {first}), saved in {saved_dir}. Lower the "
                f"learning rate or inspect these steps' data, then re-run to resume.")

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "consecutive": self.consecutive,
                "first_bad_step": self.first_bad_step}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.total = int(state.get("total", 0))
        self.consecutive = int(state.get("consecutive", 0))
        self.first_bad_step = state.get("first_bad_step")


# -- bad input ------------------------------------------------------------------------------------


def check_run_dir_writable(run_dir: Any) -> None:
    """RunError unless ``run_dir`` (a local path) can be created and written; URIs are left to
    the object store (its errors name the bucket)."""
    text = os.fspath(run_dir)
    if ckpt.is_uri(text):
        return
    try:
        epath.Path(text).mkdir(parents=True, exist_ok=True)
        probe = os.path.join(text, f".sparrow-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        hint = " (disk full)" if e.errno == errno.ENOSPC else ""
        raise RunError(f"run directory {text} is not writable{hint}: {e.strerror or e}. Point "
                       f"TrainConfig.run_dir at a writable directory.") from None


def check_vocabulary(tokenizer: Any, vocab_size: int, model_path: str,
                     special_ids: dict[str, int | None]) -> None:
    """RunError when the tokenizer can produce ids the model has no embedding row for."""
    size = len(tokenizer)
    if size > vocab_size:
        raise RunError(f"the tokenizer in {model_path} has {size} tokens but the model's "
                       f"vocab_size is {vocab_size}: ids >= {vocab_size} have no embedding. The "
                       f"tokenizer and the weights do not belong together: copy the tokenizer "
                       f"files of the model these weights came from into {model_path}")
    bad = {k: v for k, v in special_ids.items() if v is not None and not 0 <= int(v) < vocab_size}
    if bad:
        raise RunError(f"special token ids {bad} of {model_path} are outside the model's "
                       f"vocabulary (vocab_size {vocab_size})")


def prompt_capacity(max_position_embeddings: int, max_new_tokens: int,
                    max_prompt_len: int | None) -> int:
    """Longest prompt the rollout takes: the model's context minus the response budget, or the
    user's `make_prompt_iterator.max_prompt_len` when that is smaller."""
    capacity = max_position_embeddings - max_new_tokens
    if capacity <= 0:
        raise RunError(f"RolloutConfig.max_new_tokens = {max_new_tokens} leaves no room for a "
                       f"prompt in the model's {max_position_embeddings}-token context")
    return capacity if max_prompt_len is None else min(capacity, int(max_prompt_len))
