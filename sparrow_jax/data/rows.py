"""Prompt-file rows: which files a data path names, reading them, and the fields of one row.

A data path is a file, a directory (every `.jsonl`, `.jsonl.gz` and `.parquet` file below it,
sorted), a glob (`data/*.parquet`, `**` recursive) or a list of these.

JSONL is read as bytes and decoded line by line, so a UTF-8 byte-order mark is dropped and an
undecodable byte costs only its own line (reported with file, line and column), never the file.

Row layouts understood (the common math-RL sets):
  plain      {"prompt": "What is 1+1?", "answer": "2"}
  chat       {"messages": [{"role": "user", "content": "..."}], "answer": "2"}
  verl/DAPO  {"prompt": [{"role": "user", "content": "..."}],
              "reward_model": {"ground_truth": "2", "style": "rule"},
              "data_source": "...", "extra_info": {...}}
  OpenR1     {"problem": "...", "answer": "2", "messages": [user, assistant]}
Answer fields may be dotted paths into nested objects (`reward_model.ground_truth`). A chat list
that ends with assistant turns (OpenR1 stores the reference solution there) is cut before them:
the policy must write that part itself.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from typing import Any, Iterator, Sequence

# Suffixes a directory is searched for; a file named explicitly may have any suffix (JSONL then).
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_BOM = b"\xef\xbb\xbf"


class RowError(ValueError):
    """A malformed row; the message says why."""


def expand_paths(paths: str | Sequence[str]) -> list[str]:
    """Files named by `paths` (file, directory, glob, or a list of them), in a stable order.

    Raises FileNotFoundError naming the first entry that matches no data file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [os.fspath(paths)]
    if not paths:
        raise FileNotFoundError("no prompt files given (an empty list)")
    out: list[str] = []
    for p in paths:
        p = os.path.expanduser(os.fspath(p))
        if any(c in p for c in "*?["):
            matches = sorted(glob.glob(p, recursive=True))
            files = [m for m in matches if os.path.isfile(m)]
            files += [f for m in matches if os.path.isdir(m) for f in _data_files_in(m)]
            if not files:
                raise FileNotFoundError(f"prompt files: the glob {p!r} matches no file")
            out.extend(files)
        elif os.path.isdir(p):
            files = _data_files_in(p)
            if not files:
                raise FileNotFoundError(
                    f"prompt files: the directory {p!r} holds no {'/'.join(DATA_SUFFIXES)} file")
            out.extend(files)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"prompt file not found: {p}")
    return out


def _data_files_in(directory: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .cache/, .git/
        found.extend(os.path.join(root, f) for f in files
                     if f.endswith(DATA_SUFFIXES) and not f.startswith("."))
    return sorted(found)


def iter_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row object or the RowError that made it unreadable).

    Row numbers are line numbers for JSONL (blank lines count but yield nothing) and 1-based row
    indices for Parquet.
    """
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield i, row
        return
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            if i == 1 and (raw.startswith(_UTF16_BOMS) or b"\x00" in raw):
                # UTF-16 (Windows' "Unicode"): every line would be skipped as malformed with
                # no word about why (issue 58); one reason for the whole file instead.
                yield i, RowError("the file is UTF-16 encoded (JSONL is UTF-8): convert it, e.g. "
                                  "iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8.jsonl")
                return
            if i == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]  # written by Windows tools; json.loads rejects it
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield i, RowError(f"not UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}")
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, RowError(f"bad JSON ({e.msg} at column {e.colno})")


def lookup(row: dict, field: str) -> Any:
    """row[field], where a dotted field walks nested objects; None when any step is missing."""
    value: Any = row
    for part in field.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def answer(row: dict, fields: Sequence[str]) -> tuple[str, str]:
    """(field used, ground truth as text) from the first present field of `fields`."""
    for name in fields:
        value = lookup(row, name)
        if value is None:
            continue
        # bool is an int subclass, but True as a ground truth is almost surely a data bug.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name, str(value)
        if isinstance(value, str):
            if not value.strip():
                raise RowError(f"field {name!r} is empty")
            return name, value
        raise RowError(f"field {name!r} must be a string or number, got {type(value).__name__}")
    raise RowError(f"missing answer field (one of {list(fields)})")


def messages(value: Any, field: str) -> list[dict[str, str]]:
    """A validated chat list, trailing assistant turns removed (they are a reference answer)."""
    if not isinstance(value, list) or not value:
        raise RowError(f"{field!r} must be a non-empty string or list of messages")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise RowError(f"every message of {field!r} needs string 'role' and 'content'")
    out = [{"role": m["role"], "content": m["content"]} for m in value]
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out:
        raise RowError(f"{field!r} has only assistant messages: no prompt left")
    return out
