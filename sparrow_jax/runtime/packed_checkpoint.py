"""A Hugging Face model directory as ONE .safetensors file, and back.

A lent accelerator host returns at most a few files (docs/devices/README.md): a model that
later runs and CPU tests reuse travels as one file. Its tensors are the directory's
`model.safetensors` (unchanged bytes); the directory's small text files (config.json, the
tokenizer's files, a warm-up summary) ride in the safetensors header's `__metadata__`, which
every safetensors reader keeps beside the tensors and the model loaders ignore. `unpack` writes
the directory again: the file itself as model.safetensors, each text file by name.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

__all__ = ["PACKED_KEY", "pack", "unpack", "packed_files"]

# The metadata entry naming the packed text files (a JSON list): the other entries are theirs.
PACKED_KEY = "sparrow.packed_files"
WEIGHTS = "model.safetensors"


def _header(raw: bytes) -> tuple[dict, int]:
    """(header JSON, offset of the tensor data) of a safetensors file's bytes."""
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), 8 + size


def pack(model_dir: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Writes `model_dir` (one `model.safetensors` and small text files beside it) as the one
    file `path`; returns it. Sharded weights (an index file) are refused."""
    model_dir, path = Path(model_dir), Path(path)
    weights = model_dir / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{model_dir}: no single {WEIGHTS} to pack (sharded weights "
                                f"do not fit one file)")
    texts = {f.name: f.read_text() for f in sorted(model_dir.iterdir())
             if f.is_file() and f.name != WEIGHTS and not f.name.endswith(".safetensors")}
    raw = weights.read_bytes()
    header, data = _header(raw)
    header["__metadata__"] = {**header.get("__metadata__", {}), **texts,
                              PACKED_KEY: json.dumps(sorted(texts))}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)        # tensor data stays 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    # The data offsets in the header are relative to the data's start: unchanged.
    tmp.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[data:])
    os.replace(tmp, path)
    return path


def packed_files(path: str | os.PathLike) -> dict[str, str]:
    """The text files packed into `path` ({} for a plain safetensors file)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(size)).get("__metadata__", {})
    names = json.loads(meta.get(PACKED_KEY, "[]"))
    return {name: meta[name] for name in names}


def unpack(path: str | os.PathLike, model_dir: str | os.PathLike) -> Path:
    """The model directory of a packed file: the file as model.safetensors and each packed
    text file; returns the directory."""
    path, model_dir = Path(path), Path(model_dir)
    texts = packed_files(path)
    if "config.json" not in texts:
        raise ValueError(f"{path}: not a packed model (no config.json in its metadata)")
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, model_dir / WEIGHTS)
    for name, text in texts.items():
        (model_dir / name).write_text(text)
    return model_dir
