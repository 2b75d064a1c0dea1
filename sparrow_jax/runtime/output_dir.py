"""What an output directory holds: every command that writes one says so there, and none writes
into another's.

`sparrow calibrate` used to replace an earlier calibration without a word, and `sparrow eval
--out RUN_DIR` appended its step-0 line to a training run's `metrics.jsonl` (issue 58). So each
command that writes a directory (train, eval, calibrate, export, sft, experiment, the device
check) leaves a small record in it, `sparrow_output.json`: the command, its settings and their
fingerprint. Before it writes, `check` (or `claim`, which also writes the record) reads what the
directory holds:

- nothing (new, or empty but for hidden files): the command starts it;
- the same command's output: with the same settings it goes on (a resume); with other settings
  it is refused, naming the first settings that differ, unless the user asks to replace it
  (`--overwrite`: only that command's own files go, `Kind.files`); commands whose own checks
  compare the settings in detail (train's resume checks, `compare=False`) go on;
- another command's output, or a model directory: refused, whatever the flags, naming it -
  their files would mix (an evaluation's `metrics.jsonl` in a training run's);
- files no command wrote: refused unless `--overwrite` (the command then writes beside them).

Directories written before records existed are recognised by the files each command writes
(`Kind.marks`) and adopted by their own command. Local paths only: a URI run directory
(`gs://...`) is left to the object store.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from sparrow_jax.runtime.run_files import is_uri, write_text_atomic

__all__ = ["RECORD_FILE", "Kind", "KINDS", "Contents", "OutputDirError", "fingerprint",
           "inspect", "check", "claim", "write_record", "enclosing"]

RECORD_FILE = "sparrow_output.json"
_SHOWN = 4     # names listed in a message; the rest are counted


class OutputDirError(ValueError):
    """A directory a command must not write into; the message is one line saying what is there
    and what to do (each command prefixes its name)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one command's output directory is."""
    name: str                        # the command ("eval"), or "model" for a model directory
    what: str                        # in messages: "a training run (sparrow train)"
    marks: tuple[str, ...]           # globs, any of which shows this kind's output (no record)
    files: tuple[str, ...] = ()      # globs of the files it writes there (what --overwrite removes)
    adopts: tuple[str, ...] = ()     # other kinds it may take over (sft: a model directory)


# Recognition order matters: an export and an SFT model are model directories too.
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("export", "an export (sparrow export)", ("sparrow_export.json",)),
    Kind("sft", "a warm-up model (sparrow sft)", ("sft_summary.txt",), adopts=("model",)),
    Kind("train", "a training run (sparrow train)",
         ("checkpoints", "operative_config.gin", "sparrow.lock", "damaged_checkpoints",
          "config_history.jsonl")),
    Kind("eval", "an evaluation (sparrow eval)", ("eval.json", "chunks"),
         ("settings.json", "chunks", "eval.json", "timing.json", "metrics.jsonl",
          "events.out.tfevents.*")),
    Kind("calibrate", "a calibration (sparrow calibrate)",
         ("report.json", "heatmap.png", "certified_schedule.json"),
         ("schedule.json", "heatmap.png", "report.json", "certified_schedule.json",
          "one_rung_lower_schedule.json", "exact_schedule.json")),
    Kind("experiment", "an experiment (sparrow experiment)",
         ("comparison.md", "*/operative_config.gin", "*/sparrow.lock")),
    Kind("device_check", "a device check's logs (launch/device_check.sh)",
         ("doctor.log", "kernels.log", "selection.log", "rollout.log", "train.log",
          "train_real.log", "limit_*.log"), ("*.log",)),
    Kind("model", "a model directory (config.json)", ("config.json",)),
)}


@dataclasses.dataclass(frozen=True)
class Contents:
    """What `inspect` found: the kind (None: no sparrow output), its record (None: written
    before records existed, recognised by its files) and the visible entries."""
    kind: Kind | None
    record: dict[str, Any] | None
    names: tuple[str, ...]

    def listing(self) -> str:
        shown = ", ".join(self.names[:_SHOWN])
        more = len(self.names) - _SHOWN
        return shown + (f" and {more} more" if more > 0 else "")


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as JSON reads them back (tuples -> lists, modes -> their strings)."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def fingerprint(settings: dict[str, Any]) -> str:
    """sha256 of the settings' canonical JSON."""
    text = json.dumps(_plain(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _matches(directory: Path, globs: tuple[str, ...]) -> list[Path]:
    found: list[Path] = []
    for pattern in globs:
        found += [p for p in directory.glob(pattern) if not p.name.startswith(".")]
    return found


def inspect(directory: str | os.PathLike[str]) -> Contents:
    """What `directory` holds (see `Contents`); a missing directory holds nothing."""
    path = Path(directory)
    if not path.is_dir():
        return Contents(None, None, ())
    names = tuple(sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                         if not p.name.startswith(".") and p.name != RECORD_FILE))
    record_path = path / RECORD_FILE
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            kind = KINDS[record["command"]]
        except (OSError, ValueError, KeyError, TypeError):
            raise OutputDirError(f"{record_path} is unreadable or names no sparrow command: "
                                 f"move it away if the directory is yours to write") from None
        return Contents(kind, record, names)
    for kind in KINDS.values():
        if _matches(path, kind.marks):
            return Contents(kind, None, names)
    return Contents(None, None, names)


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r:.60} there, {new.get(k)!r:.60} now" for k in keys
            if old.get(k) != new.get(k)]


def check(directory: str | os.PathLike[str], command: str, settings: dict[str, Any], *,
          overwrite: bool = False, compare: bool = True, name: str = "--out",
          option: str | None = "--overwrite") -> str:
    """Whether `command` may write into `directory` with `settings` (module docstring). Returns
    "new" (nothing there yet), "same" (its own output: go on) or "replace" (its own output with
    other settings and `overwrite`: `claim` removes its files first); raises OutputDirError.

    `name`: how the directory is set ("--out", "TrainConfig.run_dir"); `option`: the flag that
    allows replacing (None: the command has none); `compare=False`: the command checks its
    own settings (train's resume checks), so its own output always goes on."""
    kind = KINDS[command]
    path = Path(directory)
    if is_uri(os.fspath(directory)):
        return "same"
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{name} {directory} is a file, not a directory: name a new "
                             f"directory")
    found = inspect(path)
    if found.kind is None:
        if not found.names or overwrite:
            return "new"
        hint = (f", or pass {option} to write beside them" if option else "")
        raise OutputDirError(f"{name} {directory} is not empty and holds no sparrow output "
                             f"({found.listing()}): choose a new or empty directory{hint}")
    if found.kind.name != command and found.kind.name not in kind.adopts:
        where = "" if found.record else f" ({found.listing()})"
        raise OutputDirError(
            f"{name} {directory} holds {found.kind.what}{where}: sparrow {command} would mix "
            f"its files into it. Choose a new directory for {kind.what.split(' (')[0]}")
    if found.record is None or not compare:
        return "same"
    new = _plain(settings)
    if found.record.get("fingerprint") == fingerprint(new):
        return "same"
    if not _matches(path, kind.files):
        return "replace"             # only the record: nothing of the earlier run to lose
    differ = _differences(found.record.get("settings") or {}, new)
    if not overwrite:
        hint = f", or pass {option} to replace its files" if option else ""
        raise OutputDirError(
            f"{name} {directory} holds {kind.what} with other settings "
            f"({'; '.join(differ[:3])}{f'; {len(differ) - 3} more' if len(differ) > 3 else ''})"
            f": choose a new directory{hint}")
    return "replace"


def write_record(directory: str | os.PathLike[str], command: str,
                 settings: dict[str, Any]) -> None:
    """`directory`/sparrow_output.json: the command, its settings and their fingerprint
    (written atomically; a Ctrl-C waits for it: `run_files.write_text_atomic`)."""
    plain = _plain(settings)
    record = {"command": command, "fingerprint": fingerprint(plain), "settings": plain,
              "host": socket.gethostname(),
              "written": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    write_text_atomic(os.path.join(os.fspath(directory), RECORD_FILE),
                      json.dumps(record, indent=1, sort_keys=True) + "\n")


def claim(directory: str | os.PathLike[str], command: str, settings: dict[str, Any], *,
          overwrite: bool = False, compare: bool = True, name: str = "--out",
          option: str | None = "--overwrite") -> str:
    """`check`, then the directory made and the record written; "replace" removes the
    command's own files first (nothing else). Returns `check`'s verdict."""
    verdict = check(directory, command, settings, overwrite=overwrite, compare=compare,
                    name=name, option=option)
    if is_uri(os.fspath(directory)):
        return verdict
    path = Path(directory)
    if verdict == "replace":
        for p in _matches(path, KINDS[command].files):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    path.mkdir(parents=True, exist_ok=True)
    if verdict != "same" or not (path / RECORD_FILE).is_file():   # kept when going on
        write_record(path, command, settings)
    return verdict


def enclosing(path: str | os.PathLike[str], levels: int = 4) -> tuple[str, Kind] | None:
    """The nearest directory holding `path` (its parent, or up to `levels` above) that holds a
    command's output or a model, and its kind; None when there is none."""
    d = os.path.dirname(os.path.abspath(os.fspath(path)))
    for _ in range(levels):
        try:
            found = inspect(d)
        except OutputDirError:
            found = Contents(None, None, ())
        if found.kind is not None:
            return d, found.kind
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return None
