"""`sparrow train`: checks, distributed start-up, the run lock, then `Trainer.run`.

Bad input and run-stopping faults end in one line `sparrow train: ...` and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading

import jax

from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime import compile_cache, faults, interrupts, output_dir, run_lock
from sparrow_jax.data.rows import expand_paths
from sparrow_jax.train import preflight, resume_config
from sparrow_jax.train.config import TrainConfig
from sparrow_jax.train.trainer import Trainer

__all__ = ["train", "main"]

log = logging.getLogger(__name__)


def _startup_handlers(cfg: TrainConfig) -> dict[int, object]:
    """Installs the start-up handlers (sparrow_jax.runtime.interrupts: nothing is trained yet, so
    a signal ends the process at once with one line; the trainer's checkpoint manager replaces
    them with the loop's save-and-stop handlers); returns the previous handlers. A multi-process run leaves
    SIGTERM to JAX's preemption notifier."""
    if cfg.distributed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sigs = (signal.SIGINT,) + (() if cfg.distributed else (signal.SIGTERM,))
    return interrupts.install(interrupts.TRAIN_STARTUP_MESSAGE, sigs)


def train(cfg: TrainConfig | None = None) -> dict[str, float]:
    # Every setting and what it names (model, tokenizer, data, rewards), all problems in one
    # error (not TrainConfig's first), before anything heavy loads.
    preflight.check_train(cfg)
    cfg = cfg or TrainConfig()
    previous = _startup_handlers(cfg)
    try:
        return _train(cfg)
    finally:
        interrupts.restore(previous)


def _train(cfg: TrainConfig) -> dict[str, float]:
    if cfg.distributed:
        if cfg.coordinator_address:
            jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                                       process_id=cfg.process_id)
        else:
            jax.distributed.initialize()  # cluster auto-detection (TPU pod, SLURM, Open MPI, k8s)
        log.info("process %d of %d", jax.process_index(), jax.process_count())
    preflight.check_devices(cfg)   # the mesh against the devices, before the model loads
    compile_cache.configure(cfg.compile_cache_dir)   # before the first compile; logs each one
    run_dir = ckpt.resolve_run_dir(cfg.run_dir)
    faults.check_run_dir_writable(run_dir)
    # One trainer per run directory (process 0 holds the lock for the run's processes), and
    # never in another command's output or a model (sparrow_jax.runtime.output_dir). The run's
    # own resume checks compare its settings (resume_config, resume_check).
    lock = run_lock.RunLock(run_dir)
    undo = lambda: None  # noqa: E731
    if jax.process_index() == 0:
        try:
            output_dir.claim(run_dir, "train", dataclasses.asdict(cfg), compare=False,
                             name="TrainConfig.run_dir", option=None)
        except output_dir.OutputDirError as e:
            raise faults.RunError(str(e)) from None
        lock.acquire()
        undo = interrupts.at_exit(lock.release)    # a Ctrl-C in start-up leaves no stale lock
    try:
        # A resume continues the same run: its settings and data are compared with the saved
        # ones before the model loads (sparrow_jax.train.resume_config).
        data_sha = resume_config.data_fingerprint(expand_paths(cfg.train_data))
        plan = resume_config.check_resume(cfg.run_dir, cfg.total_steps, cfg.resume_overrides,
                                          data_sha)
        trainer = Trainer(cfg, data_sha256=data_sha, resume_plan=plan)
    except BaseException:
        lock.release()
        raise
    try:
        return trainer.run()
    except BaseException as e:
        try:
            trainer.close()     # reward workers, pending checkpoint writes, metrics files
        except Exception:       # noqa: BLE001 - e.g. a full disk again: the first error counts
            log.debug("close after an error", exc_info=True)
        if isinstance(e, Exception) and not isinstance(e, faults.RunError) and (
                faults.is_disk_full(e)):
            raise faults.RunError(
                f"the disk of {trainer.run_dir} is full ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}). Finalized checkpoints are intact (steps "
                f"{trainer.ckpt.all_steps()}); free space and re-run the same command to "
                f"resume.") from e
        raise
    finally:
        undo()
        lock.release()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # everything is configured through gin


# Bad input and run-stopping faults (sparrow_jax.runtime.faults): one line `sparrow train: ...`, exit
# status 1, no traceback; `--log_level DEBUG` logs the traceback (a bug raising one of these
# types is shown the same way). Other exception types keep their traceback.
USER_ERRORS = (faults.RunError, ValueError, TypeError, KeyError, OSError, MemoryError)


def main(args: argparse.Namespace) -> int:
    del args
    faults.quiet_library_tracebacks()
    try:
        result = train()
    except USER_ERRORS as e:
        log.debug("sparrow train stopped", exc_info=True)
        message = str(e) if isinstance(e, faults.RunError) else f"{type(e).__name__}: {e}"
        raise SystemExit(f"sparrow train: {message}") from None
    except faults.RunStopped as e:   # saved and stopped on a signal: resumable, not finished
        log.debug("stopped", exc_info=True)
        print(f"sparrow train: {e} (exit status {e.exit_code})", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:   # Ctrl-C before the loop (loading, compiling): nothing to save
        log.debug("interrupted", exc_info=True)
        print("sparrow train: interrupted (Ctrl-C) outside the training loop; the run's "
              "checkpoints are as they were", file=sys.stderr)
        return 130
    log.debug("done: %s", json.dumps({k: round(v, 4) for k, v in result.items()}))
    return 0
