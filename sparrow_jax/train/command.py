"""`sparrow train`: checks, distributed start-up, the run lock, then `Trainer.run`.

Bad input and run-stopping faults end in one line `sparrow train: ...` and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import jax

from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime import compile_cache, config_check, faults, run_lock
from sparrow_jax.train import preflight
from sparrow_jax.train.config import TrainConfig
from sparrow_jax.train.trainer import Trainer

__all__ = ["train", "main"]

log = logging.getLogger(__name__)


def train(cfg: TrainConfig | None = None) -> dict[str, float]:
    # Every setting and what it names (model, tokenizer, data, rewards), all problems in one
    # error (not TrainConfig's first), before anything heavy loads.
    preflight.check_train(cfg)
    cfg = cfg or TrainConfig()
    if cfg.distributed:
        if cfg.coordinator_address:
            jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                                       process_id=cfg.process_id)
        else:
            jax.distributed.initialize()  # cluster auto-detection (TPU pod, SLURM, Open MPI, k8s)
        log.info("process %d of %d", jax.process_index(), jax.process_count())
    preflight.check_devices(cfg)   # the mesh against the devices, before the model loads
    compile_cache.configure(cfg.compile_cache_dir)   # before the first compile; logs each one
    faults.check_run_dir_writable(ckpt.resolve_run_dir(cfg.run_dir))
    # One trainer per run directory (process 0 holds the lock for the run's processes).
    lock = run_lock.RunLock(ckpt.resolve_run_dir(cfg.run_dir))
    if jax.process_index() == 0:
        lock.acquire()
    try:
        trainer = Trainer(cfg)
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
        config_check.check_bindings()   # a gin value of the wrong type, before anything runs
        result = train()
    except USER_ERRORS as e:
        log.debug("sparrow train stopped", exc_info=True)
        message = str(e) if isinstance(e, faults.RunError) else f"{type(e).__name__}: {e}"
        raise SystemExit(f"sparrow train: {message}") from None
    except KeyboardInterrupt:   # Ctrl-C before the loop (loading, compiling): nothing to save
        log.debug("interrupted", exc_info=True)
        print("sparrow train: interrupted (Ctrl-C) outside the training loop; the run's "
              "checkpoints are as they were", file=sys.stderr)
        return 130
    log.debug("done: %s", json.dumps({k: round(v, 4) for k, v in result.items()}))
    return 0
