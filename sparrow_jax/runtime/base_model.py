"""A run's base model: the Hugging Face directory (config.json, tokenizer) its checkpoints' weights
belong to, named by `TrainConfig.model_path` in the run's operative gin config.

`sparrow export` and `sparrow eval RUN_DIR` read a checkpoint with it.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime.gin_files import gin_binding


def operative_config(mngr: ckpt.CheckpointManager, step: int) -> str | None:
    """The gin config saved with the step, else the run directory's operative_config.gin."""
    text = mngr.read_operative_config(step)
    if text is None:
        path = ckpt.epath.Path(mngr.run_dir) / ckpt.OPERATIVE_CONFIG_FILE
        text = path.read_text() if path.exists() else None
    return text


def base_model_dir(mngr: ckpt.CheckpointManager, step: int, override: str | None = None) -> Path:
    """The base model directory of checkpoint `step`: `override` (a --model_path flag) or the
    run's TrainConfig.model_path. ValueError (naming --model_path) when it is not a model
    directory from here."""
    if override:
        path, origin = Path(override), "--model_path"
    else:
        text = operative_config(mngr, step)
        if text is None:
            raise ValueError(f"{mngr.run_dir} has no operative_config.gin to read "
                             "TrainConfig.model_path from; pass --model_path DIR")
        value = gin_binding(text, "TrainConfig", "model_path")
        if not isinstance(value, str) or not value:
            raise ValueError("the run's operative config binds no TrainConfig.model_path; "
                             "pass --model_path DIR")
        path, origin = Path(value), "TrainConfig.model_path of the run"
    if not (path / "config.json").is_file():
        if not path.is_absolute() and not path.exists():
            # Relative to where `sparrow train` ran, which the run does not record.
            raise ValueError(f"base model directory {str(path)!r} ({origin}) is a relative "
                             f"path, not found from the current directory {os.getcwd()}: "
                             f"run the export from the directory the training ran in, or pass "
                             f"--model_path DIR")
        raise ValueError(f"base model directory {str(path)!r} ({origin}) is gone or has no "
                         "config.json; pass --model_path DIR with the same config.json and "
                         "tokenizer")
    return path
