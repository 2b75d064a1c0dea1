"""What a resume may and may not do with a run's checkpoints and records.

A checkpoint that does not restore is not necessarily damaged: the usual cause is a changed
setting (`TrainConfig.param_dtype` turns every parameter's dtype, `LearnerConfig.warmup_steps > 0`
adds the schedule's step counter to the optimizer state). Moving such steps to
`damaged_checkpoints/` would throw a healthy run away, so before a failed restore is called damage
the step's *saved structure* (orbax metadata: every array's path, shape and dtype, no array
read) is compared with what the current configuration builds:

- it differs: a configuration error naming the differing settings (the operative gin config is
  saved inside every step: it is diffed with the current one) and nothing is moved;
- it matches, or the metadata itself is unreadable: the files are damaged (the caller sets the
  step aside, see `faults.restore_newest_good`).

A fresh start is refused while the run still holds evidence of earlier progress that a fresh
start would overwrite: steps set aside in `damaged_checkpoints/`, or `metrics.jsonl` lines of steps
after the first (the first save of a run is at step 1, so later lines mean checkpoints existed).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from gin import config_parser

from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime.faults import DAMAGED_SUBDIR

log = logging.getLogger(__name__)

__all__ = ["structure_differences", "config_differences", "config_change_message",
           "check_fresh_start", "gin_bindings"]

_SHOWN = 8   # differing settings / arrays named in a message; the rest are counted


def _layout(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """{path: (shape, dtype name)}; leaves without a dtype (Python scalars) by their type."""
    out = {}
    for p, x in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(x, "dtype", None)
        name = np.dtype(dtype).name if dtype is not None else type(x).__name__
        out[ckpt.tree_path_names(p)] = (tuple(getattr(x, "shape", np.shape(x))), name)
    return out


def _show(path: tuple[str, ...]) -> str:
    return ".".join(k for k in path if k != "value")


def structure_differences(manager: ckpt.CheckpointManager, step: int,
                          items: dict[str, Any]) -> list[str] | None:
    """How the arrays saved at ``step`` differ from ``items`` ({item name: current tree});
    [] when they match, None when the step's metadata cannot be read (damaged files)."""
    out = []
    for name, tree in items.items():
        try:
            meta = ocp.StandardCheckpointHandler().metadata(
                epath.Path(manager.step_dir(step)) / name).tree
            saved = _layout(meta)
        except Exception:  # noqa: BLE001 - unreadable metadata is damage, not a config change
            log.debug("metadata of step %d/%s unreadable", step, name, exc_info=True)
            return None
        now = _layout(tree)
        gone, new = sorted(set(saved) - set(now)), sorted(set(now) - set(saved))
        if gone:
            out.append(f"{name}: {len(gone)} saved arrays this configuration does not have "
                       f"(first: {_show(gone[0])})")
        if new:
            out.append(f"{name}: {len(new)} arrays this configuration has and the checkpoint "
                       f"lacks (first: {_show(new[0])})")
        changed = [k for k in sorted(set(saved) & set(now)) if saved[k] != now[k]]
        if changed:
            k = changed[0]
            out.append(f"{name}: {len(changed)} of {len(now)} arrays differ in shape or dtype "
                       f"(first: {_show(k)} is {saved[k][1]}{list(saved[k][0])} in the "
                       f"checkpoint, {now[k][1]}{list(now[k][0])} now)")
    return out


class _Inert(config_parser.ParserDelegate):
    """Reads any gin text without its configurables registered (references stay text)."""

    def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> str:
        return "@" + scoped_configurable_name + ("()" if evaluate else "")

    def macro(self, macro_name: str) -> str:
        return "%" + macro_name


def gin_bindings(text: str) -> dict[str, Any]:
    """``{"[scope/]Selector.param": value}`` of a gin config text (the last binding wins)."""
    out: dict[str, Any] = {}
    for stmt in config_parser.ConfigParser(text, _Inert()):
        if isinstance(stmt, config_parser.BindingStatement):
            selector = stmt.selector.rsplit(".", 1)[-1]   # module-qualified names are the same
            key = f"{stmt.scope + '/' if stmt.scope else ''}{selector}.{stmt.arg_name}"
            out[key] = stmt.value
    return out


def config_differences(saved_text: str | None, current_text: str) -> list[str]:
    """``Name.param: X in the checkpoint, Y now`` for each binding that differs."""
    if saved_text is None:
        return []
    try:
        saved, now = gin_bindings(saved_text), gin_bindings(current_text)
    except Exception:  # noqa: BLE001 - an unparsable config only loses the names in the message
        log.debug("operative config diff failed", exc_info=True)
        return []
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "(unset)"), now.get(key, "(unset)")
        if a != b:
            out.append(f"{key}: {a!r:.60} in the checkpoint, {b!r:.60} now")
    return out


def config_change_message(manager: ckpt.CheckpointManager, step: int, differences: list[str],
                          current_config: str) -> str:
    """The configuration error for a step whose arrays do not fit the current configuration."""
    try:
        saved = manager.read_operative_config(step)
    except Exception:  # noqa: BLE001 - the diff is a courtesy; the structure decides
        saved = None
    settings = config_differences(saved, current_config)
    # Settings that do not shape the arrays (the run's length, paths) are listed last.
    benign = ("TrainConfig.total_steps", "TrainConfig.run_dir", "TrainConfig.eval_every",
              "TrainConfig.checkpoint_every")
    settings.sort(key=lambda s: s.startswith(benign))
    if settings:
        named = "; ".join(settings[:_SHOWN]) + (
            f"; and {len(settings) - _SHOWN} more" if len(settings) > _SHOWN else "")
        which = f"settings that differ from the checkpoint's: {named}"
    else:
        which = ("its saved operative config shows no differing setting (a code change since "
                 "then?)")
    return (f"checkpoint step {step} in {manager.directory} was saved with a different "
            f"configuration and cannot be restored into this one ({'; '.join(differences[:3])}); "
            f"{which}. Nothing was moved or deleted. Re-run with the checkpoint's settings "
            f"(its config: {manager.step_dir(step)}/operative_config/"
            f"{ckpt.OPERATIVE_CONFIG_FILE}), or start a new run with another "
            f"TrainConfig.run_dir.")


def _max_metrics_step(path: str) -> int | None:
    if not os.path.isfile(path):
        return None
    top = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                step = int(json.loads(line)["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            top = step if top is None else max(top, step)
    return top


def check_fresh_start(run_dir: str, metrics_dir: str) -> str | None:
    """The reason a run without a restorable checkpoint must not start over (it would overwrite
    `metrics.jsonl` and, later, reuse the step numbers), or None. ``metrics_dir`` is where
    `metrics.jsonl` is written (the run directory, or the local mirror of a URI run)."""
    problems = []
    damaged = posixpath.join(run_dir, DAMAGED_SUBDIR)
    if not ckpt.is_uri(damaged) and os.path.isdir(damaged) and os.listdir(damaged):
        names = sorted(os.listdir(damaged))
        problems.append(f"{len(names)} checkpoint step(s) were set aside as damaged in "
                        f"{damaged} ({', '.join(names[:5])})")
    top = _max_metrics_step(os.path.join(metrics_dir, "metrics.jsonl"))
    if top is not None and top > 1:
        problems.append(f"{os.path.join(metrics_dir, 'metrics.jsonl')} records steps up to "
                        f"{top} but {posixpath.join(run_dir, ckpt.CHECKPOINT_SUBDIR)} holds no "
                        f"checkpoint")
    if not problems:
        return None
    return (f"run directory {run_dir} has no restorable checkpoint, and starting it over would "
            f"overwrite its records: {'; '.join(problems)}. To start afresh, move those away "
            f"(or use a new TrainConfig.run_dir); to resume, move a step back into "
            f"{posixpath.join(run_dir, ckpt.CHECKPOINT_SUBDIR)}.")


def read_summary(run_dir: Any) -> dict[str, Any]:
    """The run's summary.json ({} when missing or unreadable), so that a resumed or re-run
    finished run keeps the evaluations it does not redo instead of writing empty ones."""
    path = epath.Path(os.fspath(run_dir)) / "summary.json"
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        log.warning("could not read %s; it will be rewritten", path)
        return {}
    return data if isinstance(data, dict) else {}
