"""Qwen3 dense architecture hyper-parameters, read from / written to Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from typing import Any

import gin

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Shape of a Qwen3 dense decoder. Field names follow Hugging Face where they exist."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA needs whole groups)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "Qwen3Config":
        """Validates and converts a Hugging Face Qwen3 config dict (transformers 4.51+ and 5.x)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type != "qwen3" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
            raise ValueError(
                f"{source}: unsupported architecture (model_type={model_type!r}, "
                f"architectures={archs!r}); sparrow-jax supports {SUPPORTED_ARCHITECTURES} "
                "(model_type 'qwen3', dense). MoE Qwen3 and other families are not implemented.")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (Qwen3 dense uses "
                             "full attention in every layer)")
        # transformers 5 keeps RoPE under rope_parameters; 4.x used rope_theta (+ rope_scaling).
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        # Every RoPE type either place names must be plain RoPE: transformers reads a YaRN
        # rope_scaling even beside a default rope_parameters, and training plain RoPE under it
        # would be a silently different model (issue #45).
        types = {f"{where}.{key}": d.get(key) for where, d in (("rope_parameters", rope),
                                                               ("rope_scaling", scaling))
                 for key in ("rope_type", "type") if d.get(key) is not None}
        other = {k: v for k, v in types.items() if v != "default"}
        if other:
            named = ", ".join(f"{k}={v!r}" for k, v in other.items())
            raise ValueError(f"{source}: {named} is not supported (only plain RoPE, 'default'); "
                             "remove the RoPE scaling from the config to run at native context")
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ValueError(f"{source}: no rope_theta (looked in rope_parameters and rope_theta)")
        heads = int(cfg["num_attention_heads"])
        try:
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                pad_token_id=cfg.get("pad_token_id"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None

    def to_hf_dict(self, *, dtype: str = "float32") -> dict[str, Any]:
        """A config.json that `transformers.AutoModelForCausalLM` loads as Qwen3ForCausalLM."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "torch_dtype": dtype,
        }


# Exact shapes of the public Qwen3 dense checkpoints (their Hugging Face config.json values), for
# tools that need a model's shape but no weights (`sparrow dryrun --preset`).
_QWEN3_COMMON = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1_000_000.0, attention_bias=False, max_position_embeddings=40960,
                     bos_token_id=151643, eos_token_id=151645)
QWEN3_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, tie_word_embeddings=False),
}


def qwen3_preset(name: str) -> Qwen3Config:
    """The shape of a public Qwen3 checkpoint by name, e.g. "qwen3-8b" (case-insensitive)."""
    key = name.strip().lower()
    if key not in QWEN3_PRESETS:
        raise ValueError(f"unknown Qwen3 preset {name!r}; known: {', '.join(QWEN3_PRESETS)}")
    return Qwen3Config(**_QWEN3_COMMON, **QWEN3_PRESETS[key])
