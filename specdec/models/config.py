"""Model configuration: one dataclass for every supported decoder-only family."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specdec.errors import SpecdecError

# HF `model_type` values we run, mapped to the family that decides the layer details.
SUPPORTED_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mimo": "qwen2"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def family(self) -> str:
        return SUPPORTED_TYPES[self.model_type]

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_TYPES:
            raise SpecdecError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope_scaling = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        family = SUPPORTED_TYPES[model_type]
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            attention_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict:
        """A config.json that `transformers` (and we) can read back."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mimo": "MiMoForCausalLM"}[self.model_type]
        d = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "hidden_act": "silu",
        }
        return d

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            return cls.from_hf_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SpecdecError(f"cannot read model config {path}: {e}") from None
