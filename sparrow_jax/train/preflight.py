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
- the data paths (`TrainConfig.train_data`, `eval_data`, `ReferenceEvalConfig.data`): files,
  directories, globs or lists as `sparrow_jax.data.rows.expand_paths` resolves them, on this
  host (every process of a multi-host run checks its own);
- the reward names (`TrainConfig.reward`, `diagnostic_rewards`): registered, or
  `module:name` with an importable module. The current directory is on the import path for
  user reward modules (`TrainConfig.reward = 'my_rewards:score'` with `my_rewards.py` where
  `sparrow train` is started).

`check_devices` runs once the processes have found each other (`jax.distributed.initialize`)
and before the model loads: the mesh (`TrainConfig.mesh_model`, `make_mesh.data`) must divide
this run's devices, keep its model axis within one host, and divide each rollout call's rows.
Every engine and mode runs multi-process (the paged engine through one scheduler per process,
`rollout/paged_multihost.py`), so a process count is no problem of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

# The model directory's checks live with the model (`sparrow rollout` shares them).
from sparrow_jax.model.dir_check import MIN_VOCABULARY, TOKENIZER_FILES, model_problems

log = logging.getLogger(__name__)

__all__ = ["train_problems", "check_train", "device_problems", "check_devices", "model_problems",
           "TOKENIZER_FILES", "MIN_VOCABULARY"]

def _data_problems(name: str, paths: Any) -> list[str]:
    """`name`: the setting ("train_data" for TrainConfig's, or a full "Config.field")."""
    if not paths:
        return []
    from sparrow_jax.data.rows import expand_paths
    try:
        expand_paths(paths)
    except (OSError, ValueError) as e:
        return [f"{name if '.' in name else 'TrainConfig.' + name}: {e}"]
    return []


def _reference_problems() -> list[str]:
    """`ReferenceEvalConfig.data`, loaded by the trainer only after the model."""
    from sparrow_jax.evaluation.reference import ReferenceEvalConfig
    try:
        data = ReferenceEvalConfig().data
    except (ValueError, TypeError) as e:
        return [f"ReferenceEvalConfig: {e}"]
    return _data_problems("ReferenceEvalConfig.data", data)


def _ensure_cwd_importable() -> None:
    """User reward modules live where the command is started (`sparrow` as a console script
    has its own bin/ directory first on sys.path, not the current directory). Appended, so it
    never shadows an installed package; spawned reward workers inherit sys.path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _signature_problem(setting: str, name: str, fn: Any) -> str | None:
    """A reward function that cannot take `fn(completion, ground_truth, prompt=..., meta=...)`
    fails on every completion: the run would train on zero reward (issue #45)."""
    import inspect
    try:
        inspect.signature(fn).bind("completion", "answer", prompt="", meta=None)
    except TypeError as e:
        return (f"TrainConfig.{setting} = {name!r}: the reward function cannot be called as "
                f"fn(completion_text, ground_truth, *, prompt='', meta=None) ({e}); its "
                f"signature is {getattr(fn, '__name__', name)}{inspect.signature(fn)}")
    except ValueError:     # a builtin without a signature: left to the first batch
        return None
    return None


def reward_problems(names: dict[str, str]) -> list[str]:
    """One line per reward setting (TrainConfig field -> reward name) that does not resolve to
    a callable with the reward signature; [] when all do."""
    from sparrow_jax.data import synthetic  # noqa: F401 - registers the synthetic task's rewards
    from sparrow_jax.rewards.registry import get_reward
    _ensure_cwd_importable()
    out = []
    for setting, name in names.items():
        try:
            problem = _signature_problem(setting, name, get_reward(name))
            if problem:
                out.append(problem)
        except KeyError as e:
            out.append(f"TrainConfig.{setting}: {e.args[0] if e.args else e}")
        except Exception as e:  # noqa: BLE001 - the user's module failed to import
            module = name.rsplit(":", 1)[0] if ":" in name else name
            out.append(f"TrainConfig.{setting} = {name!r}: module {module!r} does not import "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                       f"; the current directory {os.getcwd()} is on the import path")
    return out


def _layout_problems(cfg: Any, rollout: Any, learner: Any) -> list[str]:
    """What the trainer used to find only after the model loaded (issue #45 list 10): the kernel
    backend's name, learner batch sizes against the group size."""
    from pallas_kernels.dispatch import BACKENDS
    out = []
    if rollout is not None and rollout.backend not in BACKENDS:
        out.append(f"RolloutConfig.backend = {rollout.backend!r} is not a kernel backend (one "
                   f"of {BACKENDS})")
    if learner is not None and cfg.group_size >= 2:
        for name in ("micro_batch_size", "ppo_mini_batch_size"):
            size = getattr(learner, name)
            if size and size % cfg.group_size:
                out.append(f"LearnerConfig.{name} = {size} must be a multiple of "
                           f"TrainConfig.group_size = {cfg.group_size} (groups are never split)")
    return out


def _component_problems(cfg: Any) -> list[str]:
    """The other configurables the trainer builds, built here first with the same gin bindings
    (cheap dataclasses): their own checks fail before the model loads, not after it."""
    from sparrow_jax.rl.distill import DistillConfig
    from sparrow_jax.rl.learner import LearnerConfig
    from sparrow_jax.rollout.config import RolloutConfig
    from sparrow_jax.sparsity.controller import ControllerConfig
    from sparrow_jax.sparsity.schedule import make_schedule
    out = []
    built = {}
    for name, build in (("RolloutConfig", RolloutConfig), ("LearnerConfig", LearnerConfig),
                        ("ControllerConfig", ControllerConfig), ("DistillConfig", DistillConfig),
                        ("make_schedule", make_schedule)):
        try:
            built[name] = build()
        except (ValueError, TypeError, KeyError, OSError) as e:
            text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            out.append(text if text.startswith(name) else f"{name}: {text}")
    rollout = built.get("RolloutConfig")
    built_all = not out
    out += _layout_problems(cfg, rollout, built.get("LearnerConfig"))
    if built_all and not cfg.problems():
        # The settings together (train/plan.py): one mode, budgets within the selection width.
        from sparrow_jax.train.config import ConfigError, TrainConfig
        from sparrow_jax.train.plan import from_gin
        try:
            from_gin(dataclasses.replace(cfg) if isinstance(cfg, TrainConfig) else None)
        except ConfigError as e:
            out += e.problems
        except (ValueError, TypeError, KeyError, OSError) as e:
            out.append(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
    if rollout is not None and not rollout.temperature > 0:
        out.append(f"RolloutConfig.temperature = {rollout.temperature}: GRPO learns from the "
                   f"differences between a prompt's group_size samples, and greedy decoding "
                   f"makes them identical (every advantage and gradient 0); use a temperature "
                   f"> 0 (1.0 samples the policy itself). Greedy evaluation is "
                   f"TrainConfig.eval_temperature")
    return out


def _chat_template_problems(model_path: str) -> list[str]:
    """`PromptFormat.use_chat_template = True` with a tokenizer that has no chat template: found
    before only when the data loaded, after the model (issue #45 list 10)."""
    from sparrow_jax.data.prompts import PromptFormat
    from sparrow_jax.train.config import gin_value
    wanted = gin_value("make_prompt_iterator.use_chat_template")
    try:
        wanted = PromptFormat().use_chat_template if wanted is None else wanted
    except (TypeError, ValueError):
        return []                 # PromptFormat's own error is reported where it is built
    if not model_path or not wanted:
        return []
    from sparrow_jax.model import load_tokenizer
    if getattr(load_tokenizer(model_path), "chat_template", None):
        return []
    return [f"PromptFormat.use_chat_template = True but the tokenizer in {model_path!r} has no "
            f"chat_template (tokenizer_config.json / chat_template.jinja): copy the base "
            f"model's, or set PromptFormat.use_chat_template = False"]


def train_problems(cfg: Any) -> list[str]:
    """Every problem of a `TrainConfig` (its settings and what they name)."""
    out = list(cfg.problems())
    out += _component_problems(cfg)
    found = model_problems(cfg.model_path)
    out += found or _chat_template_problems(cfg.model_path)
    out += _data_problems("train_data", cfg.train_data)
    out += _data_problems("eval_data", cfg.eval_data)
    out += _reference_problems()
    rewards = {"reward": cfg.reward}
    rewards.update({f"diagnostic_rewards[{i}]": n for i, n in enumerate(cfg.diagnostic_rewards)})
    out += reward_problems(rewards)
    return out


def unchecked_train_config() -> Any:
    """The gin-bound `TrainConfig` without its validation (so that `check_train` can list its
    problems together with the others instead of stopping at the first)."""
    from sparrow_jax.train.config import TrainConfig, gin_value
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
    from sparrow_jax.train.config import ConfigError
    problems = train_problems(cfg if cfg is not None else unchecked_train_config())
    if problems:
        raise ConfigError(problems, f"{len(problems)} problem(s) in the configuration")


def device_problems(cfg: Any, *, devices: int, local_devices: int, processes: int,
                    platform: str, mesh_data: int | None = None) -> list[str]:
    """What cannot work on this run's devices (all processes together: `devices`; this
    process's: `local_devices`): the mesh `make_mesh.data` (None or -1: the rest) x
    `TrainConfig.mesh_model` must cover the devices exactly, its model axis stay within one host
    (`runtime.multihost.check_mesh`), and each rollout call's rows divide the data axis
    (`rollout.state.prepare_prompts`)."""
    model = cfg.mesh_model
    where = (f"{devices} {platform} device(s)" if processes == 1 else
             f"{devices} {platform} device(s) over {processes} processes of {local_devices}")
    if model < 1:
        return []                                 # TrainConfig.problems names it
    if mesh_data not in (None, -1):
        if mesh_data * model != devices:
            return [f"the mesh make_mesh.data = {mesh_data} x TrainConfig.mesh_model = {model} "
                    f"needs {mesh_data * model} devices, this run has {where}: set "
                    f"make_mesh.data = -1 (the rest) or a mesh whose product is {devices}"]
    elif devices % model:
        divisors = [d for d in range(1, devices + 1) if devices % d == 0]
        return [f"TrainConfig.mesh_model = {model} does not divide this run's {where} (the "
                f"mesh is data x model = all devices): use one of {divisors}"]
    out = []
    if processes > 1 and (local_devices % model or model > local_devices):
        out.append(f"TrainConfig.mesh_model = {model} spans hosts: each process has "
                   f"{local_devices} device(s), and the model axis must stay within one host "
                   f"(rows of a data slice belong to one process): use a divisor of "
                   f"{local_devices}")
    data = devices // model
    per_call = cfg.rollout_batch_prompts or cfg.prompts_per_step
    rows = per_call * cfg.group_size * processes
    if devices > 1 and per_call > 0 and cfg.group_size > 0 and rows % data:
        out.append(f"a rollout call's {rows} rows ({per_call} prompts x group_size "
                   f"{cfg.group_size}{f' x {processes} processes' if processes > 1 else ''}) do "
                   f"not divide the mesh's data axis of {data} ({devices} devices / mesh_model "
                   f"{model}): change TrainConfig.prompts_per_step / rollout_batch_prompts, "
                   f"group_size or mesh_model")
    return out


def check_devices(cfg: Any) -> None:
    """`device_problems` for this run's devices, as one ConfigError; call it after
    `jax.distributed.initialize` (the device count is global then) and before the model
    loads."""
    import jax

    from sparrow_jax.train.config import ConfigError, gin_value
    from sparrow_jax.runtime.backend import backend_problem
    problem = backend_problem()
    if problem:
        raise ConfigError([problem], "devices")
    problems = device_problems(cfg, devices=jax.device_count(),
                               local_devices=jax.local_device_count(),
                               processes=jax.process_count(), platform=jax.default_backend(),
                               mesh_data=gin_value("make_mesh.data"))
    # The kernel backend against this platform (a Pallas backend on the wrong chip).
    import pallas_kernels
    from sparrow_jax.rollout.config import RolloutConfig
    backend = RolloutConfig().backend
    try:
        pallas_kernels.resolve_backend(backend)
    except (pallas_kernels.BackendUnavailableError, ValueError) as e:
        problems.append(f"RolloutConfig.backend = {backend!r}: {e}")
    if problems:
        raise ConfigError(problems, f"{len(problems)} problem(s) with this run's devices")
