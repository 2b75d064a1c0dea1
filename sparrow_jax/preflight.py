"""`sparrow train`'s checks before anything heavy loads: every problem in one error.

Loading an 8B model takes minutes; a misspelled data path, a reward module that does not import
or a model directory without tokenizer files used to surface only after it (or, for a missing
tokenizer, as `prompt_lengths must be in [1, 0]` deep inside the rollout). `train_problems`
checks the settings (`TrainConfig.problems`) and the things they name, cheaply, and
`check_train` raises one `ConfigError` listing all of them:

- the other configurables the trainer builds (`RolloutConfig`, `LearnerConfig`,
  `ControllerConfig`, `DistillConfig`, the schedule), each built once with its gin bindings;
- the model directory: exists, has `config.json` and tokenizer files, and the tokenizer (loaded:
  seconds, no weights) has a real vocabulary;
- the data paths (`TrainConfig.train_data`, `eval_data`): files, directories, globs or lists as
  `sparrow_jax.data.rows.expand_paths` resolves them;
- the reward names (`TrainConfig.reward`, `diagnostic_rewards`): registered, or
  `module:name` with an importable module. The current directory is on the import path for
  user reward modules (`TrainConfig.reward = 'my_rewards:score'` with `my_rewards.py` where
  `sparrow train` is started).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["train_problems", "check_train", "TOKENIZER_FILES", "MIN_VOCABULARY"]

# Any one of these makes a Hugging Face tokenizer (fast JSON, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
MIN_VOCABULARY = 4   # fewer tokens than this is no vocabulary (a fallback, not a tokenizer)


def _model_problems(model_path: str) -> list[str]:
    if not model_path:
        return []          # TrainConfig.problems names it
    if not os.path.exists(model_path):
        return [f"TrainConfig.model_path {model_path!r} does not exist"]
    if not os.path.isdir(model_path):
        return [f"TrainConfig.model_path {model_path!r} is not a directory"]
    out = []
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        out.append(f"model directory {model_path!r} has no config.json")
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, f))]
    if not present:
        return out + [f"model directory {model_path!r} has no tokenizer files (one of "
                      f"{', '.join(TOKENIZER_FILES)}): copy the tokenizer of the base model "
                      f"into it"]
    try:
        from sparrow_jax.model import load_tokenizer
        size = len(load_tokenizer(model_path))
    except Exception as e:  # noqa: BLE001 - reported with the others
        return out + [f"the tokenizer in {model_path!r} does not load: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}"]
    if size < MIN_VOCABULARY:
        out.append(f"the tokenizer in {model_path!r} has {size} token(s): not a usable "
                   f"vocabulary (are its files complete? found {present})")
    return out


def _data_problems(name: str, paths: Any) -> list[str]:
    if not paths:
        return []
    from sparrow_jax.data.rows import expand_paths
    try:
        expand_paths(paths)
    except (OSError, ValueError) as e:
        return [f"TrainConfig.{name}: {e}"]
    return []


def _ensure_cwd_importable() -> None:
    """User reward modules live where the command is started (`sparrow` as a console script
    has its own bin/ directory first on sys.path, not the current directory). Appended, so it
    never shadows an installed package; spawned reward workers inherit sys.path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _reward_problems(names: dict[str, str]) -> list[str]:
    from sparrow_jax.rl.rewards import get_reward
    _ensure_cwd_importable()
    out = []
    for setting, name in names.items():
        try:
            get_reward(name)
        except KeyError as e:
            out.append(f"TrainConfig.{setting}: {e.args[0] if e.args else e}")
        except Exception as e:  # noqa: BLE001 - the user's module failed to import
            module = name.rsplit(":", 1)[0] if ":" in name else name
            out.append(f"TrainConfig.{setting} = {name!r}: module {module!r} does not import "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                       f"; the current directory {os.getcwd()} is on the import path")
    return out


def _component_problems() -> list[str]:
    """The other configurables the trainer builds, built here first with the same gin bindings
    (cheap dataclasses): their own checks fail before the model loads, not after it."""
    from sparrow_jax.rl.distill import DistillConfig
    from sparrow_jax.rl.learner import LearnerConfig
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.sparsity.controller import ControllerConfig
    from sparrow_jax.sparsity.schedule import make_schedule
    out = []
    for name, build in (("RolloutConfig", RolloutConfig), ("LearnerConfig", LearnerConfig),
                        ("ControllerConfig", ControllerConfig), ("DistillConfig", DistillConfig),
                        ("make_schedule", make_schedule)):
        try:
            build()
        except (ValueError, TypeError, KeyError, OSError) as e:
            text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            out.append(text if text.startswith(name) else f"{name}: {text}")
    return out


def train_problems(cfg: Any) -> list[str]:
    """Every problem of a `TrainConfig` (its settings and what they name)."""
    out = list(cfg.problems())
    out += _component_problems()
    out += _model_problems(cfg.model_path)
    out += _data_problems("train_data", cfg.train_data)
    out += _data_problems("eval_data", cfg.eval_data)
    rewards = {"reward": cfg.reward}
    rewards.update({f"diagnostic_rewards[{i}]": n for i, n in enumerate(cfg.diagnostic_rewards)})
    out += _reward_problems(rewards)
    return out


def unchecked_train_config() -> Any:
    """The gin-bound `TrainConfig` without its validation (so that `check_train` can list its
    problems together with the others instead of stopping at the first)."""
    from sparrow_jax.train_config import TrainConfig, gin_value
    values = {}
    for f in dataclasses.fields(TrainConfig):
        bound = gin_value(f"TrainConfig.{f.name}")
        values[f.name] = f.default if bound is None else bound
    cfg = object.__new__(TrainConfig)
    for k, v in values.items():
        object.__setattr__(cfg, k, v)
    return cfg


def check_train(cfg: Any | None = None) -> None:
    """Raises one ConfigError listing every problem (see the module docstring)."""
    from sparrow_jax.train_config import ConfigError
    problems = train_problems(cfg if cfg is not None else unchecked_train_config())
    if problems:
        raise ConfigError(problems, f"{len(problems)} problem(s) in the configuration")
