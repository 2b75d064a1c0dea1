"""Builds tiny random Qwen3 checkpoints with transformers + PyTorch (the independent reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_tiny_qwen3(path: Path, *, vocab=96, hidden=48, layers=3, heads=4, kv_heads=2,
                    head_dim=16, intermediate=80, tie=True, seed=0, dtype="float32"):
    """Saves a random Qwen3ForCausalLM to `path`; returns the torch model (eval mode)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tie,
                      max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF init leaves norms at 1; randomise them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def torch_logits(model, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def make_tiny_synthetic_model(path: Path, *, hidden=32, intermediate=64, layers=3, heads=2,
                              kv_heads=1, head_dim=16, chat_template: str | None = None,
                              rope_theta: float = 10000.0, seed: int = 0):
    """A random Qwen3 with the synthetic task's word-level tokenizer, saved as an HF directory.

    Layers 0 and 1 stay dense in sparse rollouts, so 3 layers give one sparse layer.
    """
    from flax import nnx

    from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
    from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM, save_hf

    tok = build_synthetic_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True,
                      rope_theta=rope_theta, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_hf(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), path, tokenizer=tok)
    return path
