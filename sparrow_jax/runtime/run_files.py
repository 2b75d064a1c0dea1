"""Run-directory files beside orbax's manager: local paths or URIs, atomic text/JSON writes,
JSON-safe checkpoint extras, abstract restore targets, pytree path names.

`sparrow_jax.runtime.checkpoint` builds its orbax `CheckpointManager` on these (and re-exports them);
the train loop, export, experiment and faults use them for the files next to the checkpoints.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
from typing import Any

import jax
import numpy as np
from etils import epath  # orbax's own path library: local paths and gs:// (s3://, ...) URIs

from sparrow_jax.runtime import interrupts

PyTree = Any


# -- run directories: local paths or URIs ---------------------------------------------------------

_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URI (``gs://bucket/run``, ``s3://...``) rather than a local path."""
    return bool(_URI_RE.match(os.fspath(path)))


def resolve_run_dir(run_dir: str | os.PathLike[str]) -> epath.Path:
    """The run directory as an ``epath.Path``: a URI unchanged, a local path made absolute.

    Orbax needs absolute local paths; a URI must not go through ``pathlib.Path.resolve()``,
    which would turn ``gs://b/run`` into ``<cwd>/gs:/b/run`` and train into the local disk.
    """
    text = os.fspath(run_dir)
    if is_uri(text):
        return epath.Path(text)
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


# -- atomic small-file writes ---------------------------------------------------------------------


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Writes ``text`` to ``path`` via a temp file in the same directory + ``os.replace``.

    Readers see either the old or the new content, never a torn file. A URI (``gs://...``) is
    written with one ``epath`` write instead: object stores publish an object only once its
    upload completes, which gives the same guarantee (and they have no rename to build it from).
    """
    if is_uri(path):
        target = epath.Path(os.fspath(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        return
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    # A Ctrl-C that ends the command at once waits for the rename (runtime.interrupts): no
    # temporary file is left behind.
    with interrupts.critical():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # data on disk before the rename makes it visible
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def save_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically writes ``encode_extra(obj)`` as indented JSON (bytes/arrays/keys allowed)."""
    write_text_atomic(path, json.dumps(encode_extra(obj), indent=2, sort_keys=True) + "\n")


# -- JSON encoding of the "extra" dict ------------------------------------------------------------

_BYTES, _ARRAY, _KEY = "__bytes_b64__", "__ndarray__", "__prng_key__"


def encode_extra(obj: Any) -> Any:
    """Makes ``obj`` JSON-serializable, reversibly for the types a train loop keeps in ``extra``.

    * ``bytes`` (e.g. a grain iterator state) -> ``{"__bytes_b64__": "<base64>"}``
    * typed PRNG key arrays (``jax.random.key``) -> ``{"__prng_key__": [uint32...], "impl": ...}``
    * other NumPy/JAX arrays -> ``{"__ndarray__": nested lists, "dtype": ..., "shape": [...]}``
    * NumPy scalars -> Python scalars; tuples -> lists (JSON has no tuple).

    Dict keys must be ``str``: ``json`` would silently turn ``1`` into ``"1"``.
    """
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"extra dict keys must be str, got {k!r}")
            out[k] = encode_extra(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [encode_extra(v) for v in obj]
    if isinstance(obj, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, jax.Array) and jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(obj))
        return {_KEY: data.tolist(), "impl": str(jax.random.key_impl(obj)), "shape": list(data.shape)}
    if isinstance(obj, (np.ndarray, jax.Array)):
        arr = np.asarray(obj)
        return {_ARRAY: arr.tolist(), "dtype": arr.dtype.str, "shape": list(arr.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def decode_extra(obj: Any) -> Any:
    """Inverse of :func:`encode_extra` (tuples come back as lists; keys as ``jax.random.key``)."""
    if isinstance(obj, list):
        return [decode_extra(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _BYTES in obj:
        return base64.b64decode(obj[_BYTES])
    if _KEY in obj:
        data = np.asarray(obj[_KEY], dtype=np.uint32).reshape(obj["shape"])
        return jax.random.wrap_key_data(data, impl=obj["impl"])
    if _ARRAY in obj:
        return np.asarray(obj[_ARRAY], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    return {k: decode_extra(v) for k, v in obj.items()}


# -- abstract restore targets ---------------------------------------------------------------------


def abstract_like(tree: PyTree) -> PyTree:
    """Replaces each ``jax.Array`` leaf by ``ShapeDtypeStruct(shape, dtype, sharding=leaf.sharding)``.

    NumPy arrays and Python scalars are kept (orbax restores them as such); existing
    ``ShapeDtypeStruct`` leaves pass through. Works on NNX ``State`` (Variables are pytree nodes).
    """

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(one, tree)


def abstract_with_shardings(tree: PyTree, shardings: jax.sharding.Sharding | PyTree) -> PyTree:
    """Abstract target for restoring ``tree``'s shapes/dtypes onto new ``shardings``.

    Args:
      tree: arrays or ``ShapeDtypeStruct`` leaves (e.g. ``nnx.state(nnx.eval_shape(make_model))``).
      shardings: one ``Sharding`` for every leaf, or a pytree with ``tree``'s structure whose leaves
        are ``Sharding`` (or ``None`` to keep the leaf's own sharding).

    Returns:
      ``tree`` with ``ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, jax.sharding.Sharding):
        sh_leaves: list[Any] = [shardings] * len(leaves)
    else:
        # flatten_up_to accepts None (or anything) where ``tree`` has a leaf.
        sh_leaves = treedef.flatten_up_to(shardings)
    out = []
    for x, sh in zip(leaves, sh_leaves):
        sh = sh if sh is not None else getattr(x, "sharding", None)
        out.append(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh))
    return jax.tree.unflatten(treedef, out)


def tree_path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A jax key path as plain strings, so that an NNX ``State``'s paths (``DictKey(0)``,
    ``GetAttrKey('value')``) and the nested dicts of orbax metadata (``DictKey('0')``) compare."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)
