"""What `sparrow eval` keeps: fingerprints, per-chunk result files, and eval.json.

Layout of an output directory:

    OUT/settings.json      what decides the samples (model and data fingerprints, sampling,
                           engine, seed, problems per chunk); a resumed run must match it
    OUT/chunks/NNNNN.json  per-problem results of chunk NNNNN (problems NNNNN*B ...), each
                           written to a temporary file and renamed: a kill leaves whole files
    OUT/eval.json          settings, data report, metrics, per-problem results with responses
                           (deterministic: no timings, so a resumed run writes the same bytes)
    OUT/timing.json        tokens/s and seconds of this invocation (not part of eval.json)
    OUT/events.out.tfevents.*, OUT/metrics.jsonl   TensorBoard scalars, verl-style names
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sparrow_jax.evaluation.metrics import aggregate, problem_metrics
from sparrow_jax.runtime import interrupts
from sparrow_jax.runtime.output_dir import RECORD_FILE

_EDGE_BYTES = 1 << 20   # a weight file is fingerprinted by its size and first/last MiB


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over config.json, the tokenizer files and, per weight file, its name, size and
    first and last MiB (hashing all of a 16 GB checkpoint would take minutes)."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for f in sorted(d.iterdir()):
        if not f.is_file():
            continue
        if f.name.endswith(".safetensors"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(_EDGE_BYTES))
                fh.seek(max(0, size - _EDGE_BYTES))
                h.update(fh.read(_EDGE_BYTES))
        elif f.suffix == ".json" and f.name not in ("sparrow_export.json", RECORD_FILE):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def combine(*parts: str) -> str:
    """sha256 of several fingerprints / texts together."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """JSON to `path` via a temporary file + fsync + rename (readers never see half a file)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with interrupts.critical():      # a Ctrl-C waits for the rename (runtime.interrupts)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def chunk_path(out: str | os.PathLike, chunk: int) -> Path:
    return Path(out) / "chunks" / f"{chunk:05d}.json"


def check_settings(out: str | os.PathLike, settings: dict[str, Any]) -> int:
    """Records `settings` in OUT/settings.json, or checks them against an earlier run's.
    Returns how many chunk files an earlier run left (0 for a fresh directory). Raises
    ValueError naming the first setting that differs."""
    out = Path(out)
    settings = json.loads(json.dumps(settings))     # tuples -> lists, as read back
    saved = out / "settings.json"
    (out / "chunks").mkdir(parents=True, exist_ok=True)
    if saved.exists():
        old = json.loads(saved.read_text())
        for key in sorted(set(old) | set(settings)):
            if old.get(key) != settings.get(key):
                raise ValueError(
                    f"{out} holds an evaluation with other settings ({key}: {old.get(key)!r} "
                    f"there, {settings.get(key)!r} now); use another --out or delete it")
    else:
        write_json_atomic(saved, settings)
    return len(list((out / "chunks").glob("*.json")))


def load_chunk(out: str | os.PathLike, chunk: int) -> list[dict[str, Any]] | None:
    path = chunk_path(out, chunk)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def summarize(problems: Sequence[dict[str, Any]], n: int, ks: Sequence[int]
              ) -> dict[str, Any]:
    """Metrics overall and per data source from per-problem results (each with `data_source`
    and `responses`: [{correct, answer, length, finish}])."""
    def block(group: Sequence[dict[str, Any]]) -> dict[str, Any]:
        per = [problem_metrics([r["correct"] for r in p["responses"]],
                               [r["answer"] for r in p["responses"]], ks) for p in group]
        lengths = np.asarray([r["length"] for p in group for r in p["responses"]], np.float64)
        truncated = [r["finish"] == "length" for p in group for r in p["responses"]]
        return {"problems": len(group), **aggregate(per, n),
                "response_length_mean": float(lengths.mean()),
                "response_length_p50": float(np.median(lengths)),
                "response_length_max": int(lengths.max()),
                "truncated_share": float(np.mean(truncated))}
    sources = sorted({p["data_source"] for p in problems})
    return {"overall": block(problems),
            "by_source": {s: block([p for p in problems if p["data_source"] == s])
                          for s in sources}}


def tensorboard_scalars(metrics: dict[str, Any], n: int, ks: Sequence[int]
                        ) -> dict[str, float]:
    """verl's validation names: `val-core/<data_source>/acc/mean@N` for avg@n, and under
    `val-aux/` our pass@k (`acc/pass@k`), maj@k (`acc/maj@k`) and response statistics."""
    out: dict[str, float] = {}
    for source, m in metrics["by_source"].items():
        out[f"val-core/{source}/acc/mean@{n}"] = m[f"avg@{n}"]
        for k in ks:
            out[f"val-aux/{source}/acc/pass@{k}"] = m[f"pass@{k}"]
            out[f"val-aux/{source}/acc/maj@{k}"] = m[f"maj@{k}"]
        out[f"val-aux/{source}/response_length/mean"] = m["response_length_mean"]
        out[f"val-aux/{source}/truncated_share"] = m["truncated_share"]
    return out
