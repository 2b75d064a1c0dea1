"""A Hugging Face model directory's problems, found without loading its weights.

`sparrow train` (train/preflight.py) and `sparrow rollout` (tools/generate.py) share these
checks: config.json there and of an architecture and RoPE we implement exactly, tokenizer files
there and loading into a real vocabulary. A missing tokenizer once surfaced only deep inside the
rollout, as `prompt_lengths must be in [1, 0]`.
"""

from __future__ import annotations

import os

__all__ = ["model_problems", "TOKENIZER_FILES", "MIN_VOCABULARY"]

# Any one of these makes a Hugging Face tokenizer (fast JSON, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
MIN_VOCABULARY = 4   # fewer tokens than this is no vocabulary (a fallback, not a tokenizer)


def model_problems(model_path: str) -> list[str]:
    """The model directory's problems (`sparrow train` and `sparrow rollout` share them)."""
    if not model_path:
        return []          # TrainConfig.problems names it
    if not os.path.exists(model_path):
        return [f"TrainConfig.model_path {model_path!r} does not exist"]
    if not os.path.isdir(model_path):
        return [f"TrainConfig.model_path {model_path!r} is not a directory"]
    out = []
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        out.append(f"model directory {model_path!r} has no config.json")
    else:
        # The architecture and RoPE settings we implement exactly, read without the weights.
        from sparrow_jax.model.hf_io import read_config
        try:
            read_config(model_path)
        except (ValueError, KeyError, TypeError) as e:
            out.append(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, f))]
    if not present:
        return out + [f"model directory {model_path!r} has no tokenizer files (one of "
                      f"{', '.join(TOKENIZER_FILES)}): copy the tokenizer of the base model "
                      f"into it"]
    try:
        from sparrow_jax.model.hf_io import load_tokenizer
        size = len(load_tokenizer(model_path))
    except Exception as e:  # noqa: BLE001 - reported with the others
        return out + [f"the tokenizer in {model_path!r} does not load: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}"]
    if size < MIN_VOCABULARY:
        out.append(f"the tokenizer in {model_path!r} has {size} token(s): not a usable "
                   f"vocabulary (are its files complete? found {present})")
    return out
