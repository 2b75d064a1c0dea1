"""`sparrow export`: the policy of a training checkpoint as a Hugging Face directory.

    sparrow export RUN_DIR [--step N] --out DIR [--dtype float32|bfloat16] [--model_path DIR]
                   [--overwrite] [--merge_lora]

Reads only the params item of `RUN_DIR/checkpoints/<step>` (latest step by default; the optimizer
state is never loaded), in the dtype it was saved in (orbax metadata says which: f32 master
weights, or bf16 in older runs): the dense policy. With `--merge_lora` (runs with a DistillSparse
adapter, `DistillConfig.rank > 0`) the step's adapter is merged in (W + a @ b x alpha / rank):
the sparse actor the run sampled with. It writes

    DIR/config.json              the base model's config.json, dtype fields set to --dtype
    DIR/model*.safetensors       the trained weights (+ model.safetensors.index.json if sharded)
    DIR/tokenizer files          the base model's tokenizer, re-saved by transformers
    DIR/generation_config.json   the base model's, or eos/bos/pad synthesized from config.json
    DIR/sparrow_export.json      provenance: run directory, step, stored and exported dtypes,
                                 the files written (what a later --overwrite may replace)
    DIR/sparrow_output.json      the record every command's output directory has
                                 (sparrow_jax.runtime.output_dir)

The base model directory is `TrainConfig.model_path` of the run's operative gin config;
`--model_path` replaces it when the run was trained elsewhere. RUN_DIR may be a URI (gs://...);
the export is written to a local directory, assembled beside it and renamed into place, so an
interrupted export never looks complete. A run that is still training can be exported: the
checkpoint is opened read-only.

DIR must be new, empty or an earlier export; it may not be, contain or lie inside RUN_DIR or the
base model directory. `--overwrite` replaces an earlier export's own files and keeps the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.model import (Qwen3ForCausalLM, load_tokenizer, read_config, save_hf,
                               stop_token_ids)
from sparrow_jax.runtime import checkpoint as ckpt
from sparrow_jax.runtime import faults, interrupts, output_dir
from sparrow_jax.runtime.base_model import base_model_dir, operative_config
from sparrow_jax.runtime.gin_files import gin_binding

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
PROVENANCE_FILE = "sparrow_export.json"


class ExportError(SystemExit):
    """A user-facing input error: printed as one line, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"sparrow export: {message}")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out: Path
    step: int
    stored_dtype: str            # dtype of the checkpoint's params
    dtype: str                   # dtype of the written tensors
    num_params: int
    stop_token_ids: tuple[int, ...]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `sparrow export` (called by sparrow_jax.cli.build_parser)."""
    parser.add_argument("run_dir", help="run directory of `sparrow train` (local path or URI)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--out", required=True, help="output Hugging Face directory (local)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the written weights (default: as stored in the checkpoint)")
    parser.add_argument("--model_path", default=None,
                        help="base model directory (config.json, tokenizer); default: "
                             "TrainConfig.model_path of the run's operative config")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --out (only the files it wrote)")
    parser.add_argument("--merge_lora", action="store_true",
                        help="merge the run's DistillSparse adapter into the weights (the sparse "
                             "actor); default: the dense policy alone")


# -- reading the run -------------------------------------------------------------------------------
def _verify_fingerprint(mngr: ckpt.CheckpointManager, step: int, params: Any) -> None:
    """The restored parameters against the fingerprints `sparrow train` saved with the step
    (as a resume checks them): flipped bytes restore silently as other weights."""
    path = ckpt.epath.Path(mngr.step_dir(step)) / "extra" / "metadata"
    try:
        sums = (json.loads(path.read_text()) or {}).get(faults.CHECKSUM_KEY)
    except (OSError, ValueError) as e:
        raise ExportError(f"checkpoint step {step}: {path} (its fingerprints) is unreadable "
                          f"({e}); the step is damaged: export another --step") from None
    if not sums or "params" not in sums:
        log.warning("checkpoint step %d has no fingerprints (saved before they existed): its "
                    "parameters are not verified", step)
        return
    try:
        faults.verify_checksums(step, {"params": params}, {"params": sums["params"]})
    except faults.DamagedCheckpointError as e:
        raise ExportError(f"{e}. Nothing was exported; export another step (--step, available: "
                          f"{mngr.all_steps()})") from None


def _abstract_params(mngr: ckpt.CheckpointManager, step: int, model_dir: Path):
    """(graphdef, abstract params on the host CPU in the stored dtypes, stored dtype name).

    Shapes come from config.json, dtypes from the checkpoint's metadata; a shape that differs
    (another base model than the run's) or a missing parameter is a clear error here instead of
    an orbax traceback. The target sits on the CPU: exporting is host work, and a 32B model's
    f32 master weights need not fit one accelerator.
    """
    cfg = read_config(model_dir)
    stored = mngr.params_metadata(step)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, dtype=jnp.float32,
                                                    param_dtype=jnp.float32))
    # Every variable of the model is a Param (load_hf fills the whole state from safetensors),
    # which is exactly what the learner checkpoints: nnx.state(model, nnx.Param).
    graphdef, state = nnx.split(model)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    dtypes = set()

    def target(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        key = ckpt.tree_path_names(path)
        name = ".".join(k for k in key if k != "value")
        if key not in stored:
            raise ExportError(f"checkpoint step {step} has no parameter {name!r}: was the run "
                              f"trained from {model_dir}? (override with --model_path)")
        shape, dtype = stored[key]
        if tuple(shape) != tuple(leaf.shape):
            raise ExportError(f"parameter {name!r} is {tuple(shape)} in checkpoint step {step} "
                              f"but {tuple(leaf.shape)} for {model_dir}/config.json; pass "
                              "--model_path DIR of the model the run trained")
        dtypes.add(np.dtype(dtype).name)
        return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=cpu)

    abstract = jax.tree_util.tree_map_with_path(target, state)
    extra = sorted(".".join(k for k in key if k != "value") for key in
                   set(stored) - {ckpt.tree_path_names(p) for p, _ in
                                  jax.tree_util.tree_leaves_with_path(state)})
    if extra:
        # DistillSparse adapters live in their own item, never here: anything extra means the
        # checkpoint belongs to another architecture.
        raise ExportError(f"checkpoint step {step} holds parameters a Qwen3 model of "
                          f"{model_dir}/config.json does not have: {extra[:5]}")
    stored_dtype = dtypes.pop() if len(dtypes) == 1 else "mixed(" + ",".join(sorted(dtypes)) + ")"
    return graphdef, abstract, stored_dtype


# -- writing ---------------------------------------------------------------------------------------
def _check_out(out: Path, overwrite: bool) -> None:
    """`out` must be new, empty, or an earlier export (its PROVENANCE_FILE) with --overwrite:
    export never deletes what it did not write."""
    if ckpt.is_uri(str(out)):
        raise ExportError(f"--out {out} must be a local directory (copy it to a bucket afterwards)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        try:
            found = output_dir.inspect(out)
        except output_dir.OutputDirError as e:
            raise ExportError(str(e)) from None
        if found.kind is None or found.kind.name != "export":
            what = (found.kind.what if found.kind is not None
                    else f"files no sparrow command wrote ({found.listing()})")
            raise ExportError(f"--out {out} is not empty and is not an earlier `sparrow export` "
                              f"(no {PROVENANCE_FILE}; it holds {what}): choose a new directory "
                              f"(--overwrite replaces only an earlier export)")
        if not overwrite:
            raise ExportError(f"--out {out} is not empty (an earlier export); choose a new "
                              f"directory or pass --overwrite to replace it")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".sparrow-export-probe-")
        probe.close()
    except OSError as e:
        raise ExportError(f"--out {out} is not writable ({e.strerror or e})") from None


def _check_apart(out: Path, what: str, path: str | os.PathLike) -> None:
    """Refuses an `out` that is, contains or lies inside `path` (the run directory or the base
    model): replacing it would delete checkpoints, metrics or the model itself."""
    if ckpt.is_uri(os.fspath(path)):
        return
    other = Path(os.path.realpath(os.fspath(path)))
    where = ("is" if out == other else "is inside" if other in out.parents
             else "contains" if out in other.parents else None)
    if where:
        raise ExportError(f"--out {out} {where} the {what} {other}: export writes only into a "
                          f"new directory or an earlier export; choose another --out")


def _earlier_export_files(out: Path, now: set[str]) -> set[str]:
    """Names an earlier export in `out` wrote (its provenance lists them; exports from before
    that list: the names this export writes and the weight files)."""
    try:
        listed = json.loads((out / PROVENANCE_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if isinstance(listed, list):
        return {str(n) for n in listed}
    return now | {p.name for p in out.iterdir()
                  if p.name.startswith("model") and ".safetensors" in p.name}


def _replace_export(staging: Path, out: Path) -> None:
    """Puts `staging` in place of `out`. Files of `out` an earlier export did not write (a
    README added by hand) are kept: hard-linked (or copied) into `staging` first. Then two
    renames, so `out` is never a half-written directory."""
    if not out.exists():
        os.replace(staging, out)
        return
    now = {p.name for p in staging.iterdir()}
    ours = _earlier_export_files(out, now)
    for p in out.iterdir():
        if p.name in ours or p.name in now:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, staging / p.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(p, staging / p.name)
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.replaced-"))
    os.replace(out, old / out.name)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _generation_config(model_dir: Path, hf_config: dict[str, Any],
                       tokenizer: Any) -> dict[str, Any]:
    """The base model's generation_config.json, or the stop/bos/pad ids from config.json (and
    the tokenizer's eos), which is what transformers derives when the file is missing."""
    path = model_dir / "generation_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    eos = [i for i in (hf_config.get("eos_token_id"), tokenizer.eos_token_id) if i is not None]
    eos = list(dict.fromkeys(i for e in eos for i in (e if isinstance(e, list) else [e])))
    gen: dict[str, Any] = {"_from_model_config": True}
    for key, value in (("bos_token_id", hf_config.get("bos_token_id")),
                       ("eos_token_id", eos[0] if len(eos) == 1 else eos or None),
                       ("pad_token_id", hf_config.get("pad_token_id"))):
        if value is not None:
            gen[key] = value
    return gen


def _merge_adapter(mngr: ckpt.CheckpointManager, step: int, params):
    """`params` with the step's DistillSparse adapter merged in; (merged, {"rank", "alpha"})."""
    from sparrow_jax.rl import distill
    text = operative_config(mngr, step) or ""
    rank = gin_binding(text, "DistillConfig", "rank")
    alpha = gin_binding(text, "DistillConfig", "alpha")
    alpha = 16.0 if alpha is None else float(alpha)   # DistillConfig's default
    if not isinstance(rank, int) or rank <= 0:
        raise ExportError(f"--merge_lora: the run's operative config binds no DistillConfig.rank "
                          f"> 0 (got {rank!r}): it trained no adapter")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    state = mngr.restore_distill(step, distill.abstract_state(params, rank, sharding=cpu))
    if state is None:
        raise ExportError(f"--merge_lora: checkpoint step {step} holds no DistillSparse adapter")
    merged = distill.merge_lora(params, state["lora"], alpha=alpha, rank=rank)
    return merged, {"rank": rank, "alpha": alpha}


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
           dtype: str | None = None, model_path: str | os.PathLike | None = None,
           overwrite: bool = False, merge_lora: bool = False) -> ExportResult:
    """Writes the policy of `run_dir`'s checkpoint `step` (default latest) to `out` as a Hugging
    Face directory that `load_hf` and transformers load. See the module docstring."""
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    run = ckpt.resolve_run_dir(run_dir)
    # realpath: a symlink must not smuggle the run or the model in as the target.
    out = Path(os.path.realpath(os.path.abspath(os.fspath(out))))
    _check_apart(out, "run directory", run)
    _check_out(out, overwrite)
    if not ckpt.is_uri(str(run)) and not run.is_dir():
        raise ExportError(f"run directory {run} does not exist")
    try:
        mngr = ckpt.CheckpointManager(run, read_only=True)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    with mngr:
        steps = mngr.all_steps()
        if not steps:
            raise ExportError(f"no checkpoint in {mngr.directory} (has the run saved a step yet?)")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ExportError(f"step {step} is not a checkpoint of {run}; available steps: {steps}")
        try:
            model_dir = base_model_dir(mngr, step, str(model_path) if model_path else None)
        except ValueError as e:
            raise ExportError(str(e)) from None
        _check_apart(out, "base model directory", model_dir)
        graphdef, abstract, stored_dtype = _abstract_params(mngr, step, model_dir)
        log.info("exporting %s step %d (params stored as %s) with base model %s", run, step,
                 stored_dtype, model_dir)
        params = mngr.restore_params(step, abstract)
        _verify_fingerprint(mngr, step, params)
        lora_info = None
        if merge_lora:
            params, lora_info = _merge_adapter(mngr, step, params)
    model = nnx.merge(graphdef, params)
    dtype = dtype or (stored_dtype if stored_dtype in DTYPES else "float32")
    tokenizer = load_tokenizer(model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())

    # Assemble beside `out`, then rename: an interrupted export leaves no half directory at `out`.
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    # A Ctrl-C ends the command at once (runtime.interrupts): the staging goes with it.
    undo = interrupts.at_exit(lambda: shutil.rmtree(staging, ignore_errors=True))
    try:
        save_hf(model, staging, tokenizer=tokenizer, dtype=dtype)
        # The base config.json verbatim (fields our Qwen3Config does not model survive), with
        # the dtype of the weights actually written.
        hf_config.update({k: dtype for k in ("torch_dtype", "dtype")})
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        gen = _generation_config(model_dir, hf_config, tokenizer)
        (staging / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        num_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
        # `files`: what a later --overwrite may replace (and nothing else).
        files = sorted({p.name for p in staging.iterdir()}
                       | {PROVENANCE_FILE, output_dir.RECORD_FILE})
        (staging / PROVENANCE_FILE).write_text(json.dumps(
            {"run_dir": str(run), "step": step, "stored_dtype": stored_dtype, "dtype": dtype,
             "base_model": str(model_dir), "num_params": num_params,
             "merged_lora": lora_info, "files": files}, indent=2) + "\n")
        # What the directory holds, as every command's output records it (runtime.output_dir).
        output_dir.write_record(staging, "export", {
            "run_dir": str(run), "step": step, "dtype": dtype, "base_model": str(model_dir),
            "merged_lora": lora_info is not None})
        with interrupts.critical():     # the renames finish before a Ctrl-C's exit
            _replace_export(staging, out)   # empty, or an earlier export + --overwrite (checked)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        undo()
    stops = stop_token_ids(tokenizer, out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    log.info("wrote %s: step %d, %.2fM params as %s in %s, tokenizer, generation_config.json "
             "(stop ids %s)", out, step, num_params / 1e6, dtype, ", ".join(files), list(stops))
    return ExportResult(out=out, step=step, stored_dtype=stored_dtype, dtype=dtype,
                        num_params=num_params, stop_token_ids=stops)


def main(args: argparse.Namespace) -> int:
    r = export(args.run_dir, args.out, step=args.step, dtype=args.dtype,
               model_path=args.model_path, overwrite=args.overwrite,
               merge_lora=getattr(args, "merge_lora", False))
    print(f"exported step {r.step} of {args.run_dir} -> {r.out} ({r.num_params / 1e6:.2f}M params, "
          f"{r.dtype}; stored as {r.stored_dtype})", file=sys.stderr)
    return 0
