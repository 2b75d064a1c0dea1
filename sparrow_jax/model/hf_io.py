"""Hugging Face checkpoint directories <-> Flax NNX Qwen3 (no torch, no remote code).

Safetensors is read directly (header JSON + memory-mapped tensor bytes), so bf16 checkpoints load
without torch and each tensor goes straight to its (optionally sharded) device placement.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.runtime import sharding as shd

log = logging.getLogger(__name__)

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


# -- safetensors ----------------------------------------------------------------------------------
def read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) from one .safetensors file, memory-mapped (no full copy in RAM)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        arr = data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
        yield name, arr


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes one .safetensors file: the JSON header (dtype, shape, byte range per name), then
    the arrays in the mapping's order; atomically (a temporary file, renamed)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns tensor data to 8 bytes
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
    os.replace(tmp, path)  # never leave a half-written checkpoint file behind


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not "
                                "supported; re-save with safe_serialization=True)")
    return files


# -- name mapping --------------------------------------------------------------------------------
def _hf_name(names: tuple[str, ...]) -> tuple[str, bool]:
    """NNX param path -> (HF tensor name, whether the stored array is transposed vs torch)."""
    leaf = names[-1]
    transposed = leaf == "kernel"
    hf_leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    prefix = "" if names[0] == "lm_head" else "model."
    return prefix + ".".join(names[:-1] + (hf_leaf,)), transposed


def read_config(path: str | os.PathLike) -> Qwen3Config:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    return Qwen3Config.from_hf_dict(json.loads(cfg_file.read_text()), source=str(cfg_file))


def load_hf(path: str | os.PathLike, *, dtype: Any = None, mesh: Mesh | None = None,
            param_dtype: Any = None, rules: Mapping[str, str | None] = shd.DEFAULT_RULES,
            remat: bool = False) -> Qwen3ForCausalLM:
    """Loads a local Hugging Face Qwen3 directory into a Flax NNX model.

    Reads config.json and single or sharded *.safetensors (with the index json) without torch;
    tensors go straight to (optionally sharded, per `rules` on `mesh`) device arrays.
    dtype: compute dtype (default: bf16 on accelerators, f32 on CPU); param_dtype defaults to it.
    Raises on a missing directory, unsupported architecture, missing/unexpected tensors and
    shape mismatches (naming the tensor and both shapes).
    """
    from sparrow_jax.model.qwen3 import default_dtype
    path = Path(path)
    cfg = read_config(path)
    dtype = jnp.dtype(dtype or default_dtype())
    param_dtype = jnp.dtype(param_dtype or dtype)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, dtype=dtype, param_dtype=param_dtype,
                                                       remat=remat))
    graphdef, state = nnx.split(abstract)

    # Each parameter's sharding from the axes it declares (an undeclared one is an error here).
    shardings = {} if mesh is None else dict(jax.tree_util.tree_leaves_with_path(
        shd.state_shardings(state, mesh, rules)))
    expected: dict[str, tuple[tuple, bool, jax.ShapeDtypeStruct]] = {}
    for p, leaf in jax.tree_util.tree_leaves_with_path(state):
        hf, transposed = _hf_name(shd.param_path_names(p))
        expected[hf] = (p, transposed, leaf)

    loaded: dict[str, jax.Array] = {}
    unexpected = []
    for file in _checkpoint_files(path):
        for name, arr in read_safetensors(file):
            if name not in expected:
                # Tied checkpoints sometimes still carry lm_head.weight; it must equal the embedding.
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                unexpected.append(name)
                continue
            p, transposed, leaf = expected[name]
            value = arr.T if transposed else arr
            if tuple(value.shape) != tuple(leaf.shape):
                torch_shape = tuple(leaf.shape[::-1]) if transposed else tuple(leaf.shape)
                raise ValueError(f"{file.name}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                 f"expected {torch_shape} for this config.json")
            value = np.asarray(value, dtype=leaf.dtype)
            if mesh is not None:
                loaded[name] = jax.device_put(value, shardings[p])
            else:
                loaded[name] = jnp.asarray(value)
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors not in a Qwen3 model of this config: "
                         f"{sorted(unexpected)[:10]}{' ...' if len(unexpected) > 10 else ''}")
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"{path}: missing tensors: {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}")
    by_path = {expected[n][0]: a for n, a in loaded.items()}
    state = jax.tree_util.tree_map_with_path(lambda p, _: by_path[p], state)
    log.info("loaded %s: %d layers, %.1fM params, dtype %s%s", path, cfg.num_hidden_layers,
             cfg.num_params() / 1e6, dtype.name, f", mesh {dict(mesh.shape)}" if mesh else "")
    return nnx.merge(graphdef, state)


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a model directory (local files only, never remote code)."""
    from transformers import AutoTokenizer
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)


def stop_token_ids(tokenizer: Any, model_dir: str | os.PathLike) -> tuple[int, ...]:
    """Every id that ends a generation: the tokenizer's eos, then each `eos_token_id` in the model
    directory's generation_config.json (chat checkpoints such as Qwen3 stop on <|im_end|> and
    <|endoftext|>, while the tokenizer names only one of them). Deduplicated, in that order.

    The one source of stop ids for `sparrow train` (rollout and evaluation) and `sparrow rollout`.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        try:
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen_cfg}: not valid JSON ({e})") from None
        ids.extend(int(i) for i in ([eos] if isinstance(eos, int) else eos or []))
    return tuple(dict.fromkeys(ids))


def save_hf(model: Qwen3ForCausalLM, path: str | os.PathLike, *, tokenizer=None,
            dtype: Any = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes `model` as a Hugging Face directory that transformers loads as Qwen3ForCausalLM."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    tensors: dict[str, np.ndarray] = {}
    for p, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = shd.param_path_names(p)
        if "lora" in "".join(names):
            continue  # DistillSparse adapters exist only in the sparse actor, never in exports
        hf, transposed = _hf_name(names)
        arr = np.asarray(jax.device_get(leaf))
        if dtype is not None:
            arr = arr.astype(jnp.dtype(dtype))
        tensors[hf] = np.ascontiguousarray(arr.T if transposed else arr)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / fname, shard)
            weight_map.update({n: fname for n in shard})
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}, indent=2))
    stored = jnp.dtype(dtype or next(iter(tensors.values())).dtype).name
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(dtype=stored), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
