"""Qwen3 dense decoder (Flax NNX) and Hugging Face checkpoint I/O."""

from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf_io import (load_hf, load_tokenizer, read_config, save_hf,
                                     stop_token_ids)
from sparrow_jax.model.attention import chunked_causal_attention, dense_causal_attention
from sparrow_jax.model.qwen3 import (Qwen3ForCausalLM, apply_rope, compute_copy, default_dtype,
                                     rope_cos_sin)

__all__ = ["Qwen3Config", "Qwen3ForCausalLM", "load_hf", "load_tokenizer", "read_config", "save_hf",
           "stop_token_ids", "apply_rope", "compute_copy", "chunked_causal_attention",
           "default_dtype", "dense_causal_attention", "rope_cos_sin"]
