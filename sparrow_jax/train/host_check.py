"""`python -m sparrow_jax.train.host_check CONFIG.gin [--gin_param ...]`: on this host, does
everything the run names exist?

`launch/tpu_setup.sh` runs it on every TPU worker before training starts: on a pod each host
reads the model and its share of the data from its own disk, and a path missing on one worker
would otherwise surface only after the others loaded the model and wait for it. Checks
`sparrow_jax.train.preflight` (settings, model directory and tokenizer, data paths, rewards) and that
the run directory is writable. Exit status 0 and one OK line, or 1 and every problem.
"""

from __future__ import annotations

import argparse
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparrow_jax.train.host_check")
    parser.add_argument("gin_files", nargs="*")
    parser.add_argument("--gin_param", action="append", default=[])
    args = parser.parse_args(argv)
    from sparrow_jax.runtime import checkpoint, faults
    from sparrow_jax.runtime.gin_files import parse_gin
    from sparrow_jax.train import preflight
    from sparrow_jax.train import trainer  # noqa: F401 - the configurables a run's files bind

    host = socket.gethostname()
    parse_gin(args.gin_files, args.gin_param)
    cfg = preflight.unchecked_train_config()
    try:
        preflight.check_train(cfg)
        faults.check_run_dir_writable(checkpoint.resolve_run_dir(cfg.run_dir))
    except (ValueError, OSError, faults.RunError) as e:
        print(f"host {host}: {e}", file=sys.stderr)
        return 1
    print(f"host {host}: model {cfg.model_path}, data {cfg.train_data}"
          f"{f' + {cfg.eval_data}' if cfg.eval_data else ''}, run directory {cfg.run_dir}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
