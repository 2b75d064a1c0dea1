"""A resume continues the same run: the settings are compared before the model loads.

Re-running `sparrow train` on a run directory with checkpoints resumes it. Before this check, a
new model path, learning rate or data file continued the old weights without a word, and a
changed `TrainConfig.param_dtype` made every good step look corrupted (orbax converts dtypes on
restore, so the fingerprints then differ). `check_resume` compares the current configuration
with the run's saved one - the operative gin config of its newest step, and the content
fingerprint of its training data - and refuses a change with one line per setting (old -> new),
before anything heavy loads and without touching the run.

Settings fall in four classes (`classify`):

- run-operational (`FREE`): where and how fast the run executes (run directory, reward worker
  count, compile cache, processes and mesh, memory knobs of rollout and learner): may change;
- `total_steps`: may change (no schedule depends on it) down to the run's step; below it nothing
  would train, which is refused;
- `OVERRIDABLE`: evaluation and checkpoint cadence and the like, which do not change what is
  trained: changing them needs `TrainConfig.resume_overrides = ['TrainConfig.eval_every', ...]`;
- everything else (model, dtypes, data, reward, optimizer, loss, rollout sampling, schedule,
  controller, batch layout, seed): never; start a new run directory.

Accepted changes are appended to `run_dir/config_history.jsonl` (step, time, old -> new) by the
trainer once the checkpoint restored; each checkpoint step keeps its own operative config.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import inspect
import json
import logging
import os
from typing import Any

from etils import epath
from gin import config as gin_config

from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime.faults import RunError
from sparrow_jax.runtime.resume_check import gin_bindings

log = logging.getLogger(__name__)

__all__ = ["check_resume", "classify", "data_fingerprint", "ResumePlan", "HISTORY_FILE",
           "DATA_KEY", "FREE", "OVERRIDABLE"]

HISTORY_FILE = "config_history.jsonl"
DATA_KEY = "train_data_sha256"     # in each checkpoint's JSON extra

FREE = frozenset({
    "TrainConfig.run_dir", "TrainConfig.compile_cache_dir", "TrainConfig.reward_processes",
    "TrainConfig.warmup", "RolloutConfig.min_slots",
    "TrainConfig.distributed", "TrainConfig.coordinator_address", "TrainConfig.num_processes",
    "TrainConfig.process_id", "TrainConfig.mesh_model", "TrainConfig.resume_overrides",
    "RewardPool.start_method", "RewardPool.startup_timeout_s",
    "RolloutConfig.chunk_steps", "RolloutConfig.prefill_chunk", "RolloutConfig.overlap_chunks",
    "RolloutConfig.pool_bytes", "RolloutConfig.pool_fraction", "RolloutConfig.max_slots",
    "RolloutConfig.engine", "RolloutConfig.backend", "RolloutConfig.prompt_buckets",
    "LearnerConfig.micro_batch_size", "LearnerConfig.logit_chunk",
    "LearnerConfig.attention_chunk", "LearnerConfig.remat",
    "ReferenceEvalConfig.query_chunk", "ReferenceEvalConfig.rows_per_call",
    "make_mesh.data",
})
OVERRIDABLE = frozenset({
    "TrainConfig.total_steps", "TrainConfig.eval_every", "TrainConfig.eval_prompts",
    "TrainConfig.eval_samples",
    "TrainConfig.eval_data", "TrainConfig.eval_temperature", "TrainConfig.eval_at_start",
    "TrainConfig.checkpoint_every", "TrainConfig.max_to_keep",
    "TrainConfig.max_consecutive_skips", "TrainConfig.diagnostic_rewards",
    "TrainConfig.reward_timeout_s", "RewardPool.timeout_s", "TrainConfig.max_reward_error_share",
    "ReferenceEvalConfig.data", "ReferenceEvalConfig.prompts",
})
# Configurables of other commands (an in-process `sparrow experiment` records its own config in
# each arm's): never what an arm trains.
FREE_SELECTORS = frozenset({"ExperimentConfig", "PreregConfig", "CalibrateConfig",
                            "DryrunConfig", "SFTConfig"})
_PATHS = ("TrainConfig.model_path", "TrainConfig.train_data", "TrainConfig.eval_data",
          "ReferenceEvalConfig.data")
_MISSING = object()


def classify(key: str) -> str:
    """'free' | 'overridable' | 'fixed' for a binding key (`[scope/]Selector.param`)."""
    base = key.rsplit("/", 1)[-1]
    if base in FREE or base.rpartition(".")[0] in FREE_SELECTORS:
        return "free"
    return "overridable" if base in OVERRIDABLE else "fixed"


def data_fingerprint(files: list[str]) -> str:
    """sha256 over the training files' names (base name) and bytes: a file swapped for
    another with the same row count differs. Reads every byte once (~1 GB/s)."""
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _norm(key: str, value: Any) -> Any:
    """A value comparable between the saved text and the live binding."""
    if isinstance(value, gin_config.ConfigurableReference):
        return "@" + str(getattr(value, "_scoped_selector", value)) + (
            "()" if getattr(value, "_evaluate", False) else "")
    if isinstance(value, (list, tuple)):
        return [_norm(key, v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(key, v) for k, v in value.items()}
    if key.rsplit("/", 1)[-1] in _PATHS and isinstance(value, str) and value:
        return os.path.abspath(os.path.expanduser(value))
    return value


def _current(key: str) -> Any:
    """The value `key` has now: its gin binding, else the configurable's default (_MISSING when
    the configurable or parameter no longer exists)."""
    scope, _, rest = key.rpartition("/")
    selector, _, param = rest.rpartition(".")
    configurable = gin_config._REGISTRY.get_match(selector)
    if configurable is None:
        return _MISSING
    for s in ([scope, ""] if scope else [""]):
        bound = gin_config._CONFIG.get((s, configurable.selector), {})
        if param in bound:
            return bound[param]
    try:
        parameter = inspect.signature(configurable.wrapped).parameters[param]
    except (KeyError, ValueError, TypeError):
        return _MISSING
    if parameter.default is inspect.Parameter.empty:
        return _MISSING
    if dataclasses.is_dataclass(configurable.wrapped):
        field = {f.name: f for f in dataclasses.fields(configurable.wrapped)}.get(param)
        if field is not None and field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
    return parameter.default


def _explicit_keys(selectors: set[str]) -> set[str]:
    """Keys bound now for configurables the saved run used (a parameter added since then)."""
    out = set()
    for (scope, selector), params in gin_config._CONFIG.items():
        configurable = gin_config._REGISTRY.get_match(selector)
        if configurable is None or configurable.name not in selectors:
            continue
        out.update(f"{scope + '/' if scope else ''}{configurable.name}.{p}" for p in params)
    return out


def _steps(run_dir: epath.Path) -> list[int]:
    directory = run_dir / ckpt.CHECKPOINT_SUBDIR
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _read(path: epath.Path) -> str | None:
    try:
        return path.read_text() if path.exists() else None
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resume accepted: the step it continues and the changes it records."""
    step: int
    changes: dict[str, tuple[Any, Any]]     # key -> (old, new), free ones excluded

    def record(self, run_dir: Any, step: int) -> None:
        """Appends the accepted changes, from ``step`` (the restored one) on, to
        run_dir/config_history.jsonl (nothing if none)."""
        if not self.changes:
            return
        path = epath.Path(os.fspath(run_dir)) / HISTORY_FILE
        line = json.dumps({"step": step, "time": datetime.datetime.now().astimezone()
                           .isoformat(timespec="seconds"),
                           "changes": {k: [repr(a), repr(b)] for k, (a, b) in
                                       self.changes.items()}})
        old = _read(path) or ""
        ckpt.write_text_atomic(path, old + line + "\n")
        log.info("recorded %d changed setting(s) from step %d on in %s", len(self.changes),
                 step, path)


def check_resume(run_dir: Any, total_steps: int, overrides: tuple[str, ...] | list[str],
                 data_sha256: str | None) -> ResumePlan | None:
    """None for a fresh run; else the plan of a resume whose settings may continue the run.
    Raises RunError (one line per refused setting, old -> new) otherwise. Reads only text files
    of the newest checkpoint step (no array), so it runs before the model loads."""
    run_dir = ckpt.resolve_run_dir(run_dir)
    steps = _steps(run_dir)
    if not steps:
        return None
    step_dir = run_dir / ckpt.CHECKPOINT_SUBDIR / str(steps[-1])
    config_path = step_dir / "operative_config" / ckpt.OPERATIVE_CONFIG_FILE
    saved_text = _read(config_path)
    if saved_text is None:
        log.warning("checkpoint %s has no operative config: its settings cannot be compared",
                    step_dir)
        return ResumePlan(steps[-1], {})
    saved = {k: _norm(k, v) for k, v in gin_bindings(saved_text).items()}
    selectors = {k.rsplit("/", 1)[-1].rpartition(".")[0] for k in saved}
    allowed = {o if "." in o else f"TrainConfig.{o}" for o in overrides}
    bad = sorted(o for o in allowed if classify(o) == "fixed")
    if bad:
        raise RunError(f"TrainConfig.resume_overrides names {bad}: these change what is trained "
                       f"and cannot change within a run (overridable: {sorted(OVERRIDABLE)}); "
                       f"start a new run with another TrainConfig.run_dir instead")
    if total_steps < steps[-1]:
        raise RunError(f"TrainConfig.total_steps = {total_steps} but the run in {run_dir} is at "
                       f"step {steps[-1]} already: nothing would train. Raise total_steps to "
                       f"continue it, or use another TrainConfig.run_dir.")
    refused, changes = [], {}
    for key in sorted(set(saved) | _explicit_keys(selectors)):
        now = _current(key)
        if now is _MISSING:
            log.info("resume: setting %s of the saved config no longer exists; ignored", key)
            continue
        now = _norm(key, now)
        old = saved.get(key, _MISSING)
        if old is _MISSING:          # a parameter added since the run started: its default
            old = _norm(key, _default(key))
        if old == now:
            continue
        kind = classify(key)
        line = f"{key}: {old!r:.80} -> {now!r:.80}"
        if kind == "free":
            log.info("resume with a changed run setting (allowed): %s", line)
            continue
        base = key.rsplit("/", 1)[-1]
        if base == "TrainConfig.total_steps" and now >= steps[-1]:
            changes[key] = (old, now)      # no schedule depends on it: the run's length only
            continue
        if kind == "overridable" and base in allowed:
            changes[key] = (old, now)
            continue
        refused.append(line + ("  (may change with TrainConfig.resume_overrides = "
                               f"['{base}'])" if kind == "overridable" else ""))
    extra = _read(step_dir / "extra" / "metadata")
    try:
        saved_sha = json.loads(extra).get(DATA_KEY) if extra else None
    except ValueError:
        saved_sha = None
    if saved_sha and data_sha256 and saved_sha != data_sha256:
        refused.append(f"training data content (sha256 of TrainConfig.train_data's files): "
                       f"{saved_sha[:16]}... -> {data_sha256[:16]}...")
    if refused:
        raise RunError(
            f"run directory {run_dir} holds a run trained to step {steps[-1]} with other "
            f"settings, and a resume continues that run; refused before the model loads, "
            f"nothing was moved or changed:\n  " + "\n  ".join(refused) +
            f"\nEither start a new run (another TrainConfig.run_dir), or re-run with the run's "
            f"settings (its config: {config_path}).")
    for key, (old, now) in changes.items():
        log.warning("resume from step %d with %s: %r -> %r", steps[-1], key, old, now)
    return ResumePlan(steps[-1], changes)


def _default(key: str) -> Any:
    scope, _, rest = key.rpartition("/")
    selector, _, param = rest.rpartition(".")
    configurable = gin_config._REGISTRY.get_match(selector)
    try:
        return inspect.signature(configurable.wrapped).parameters[param].default
    except (AttributeError, KeyError, ValueError, TypeError):
        return _MISSING
