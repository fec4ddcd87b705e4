"""Model configuration: one dataclass for every supported decoder-only family (`models/families/`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.models import families
from specdec.models.family import sliding_layers


@dataclass
class ModelConfig:
    """Sizes plus the layer recipe; the recipe's defaults are Llama's, a family (`models/families/`) sets its own."""

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
    attention_bias: bool = False  # q/k/v biases
    mlp_bias: bool = False
    qk_norm: str = ""  # "head": RMS norm per head of q and k (Qwen3, Gemma 3); "full": all heads (OLMo 2)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    family: str = "llama"
    o_bias: bool = False
    hidden_act: str = "silu"  # silu | gelu_tanh, on the gate of a gated MLP
    norms: str = "pre"  # pre: x + f(norm(x)); sandwich: x + norm(f(norm(x))) (Gemma); post: x + norm(f(x))
    norm_offset: float = 0.0  # RMS norm scales by (offset + weight): Gemma's 1
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden), Granite: its multiplier)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    attn_scale: float | None = None  # attention score scale, None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2/3)
    logit_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer "sliding_attention" | "full_attention"; None: all full
    rope_local_theta: float | None = None  # rope base of sliding layers where it differs (Gemma 3), unscaled
    no_rope_layers: tuple[int, ...] = ()  # layers without rotary embeddings (SmolLM3)
    rope_freq_factors: tuple[float, ...] | None = None  # divide each inverse frequency (GGUF rope_freqs, longrope)
    rotary_dim: int | None = None  # channels of a head that rotate, where fewer than head_dim (Phi-4-mini)
    num_experts: int = 0  # mixture-of-experts MLPs (Qwen3-MoE): experts per layer, 0 for a dense model
    experts_per_token: int = 0  # experts each token is routed to (top-k of the router's softmax)
    expert_intermediate_size: int = 0  # each expert's MLP width
    norm_topk: bool = True  # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (`intermediate_size`) instead
    router: str = "softmax_topk"  # softmax over the experts, then the top k (Qwen3-MoE); "topk_softmax" (gpt-oss)
    router_bias: bool = False
    expert_bias: bool = False  # each expert's gate/up and down carry biases (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha g), g clamped
    swiglu_alpha: float = 1.702
    attn_sinks: bool = False  # a learned logit per head beside the keys in each softmax (gpt-oss)
    shared_expert_intermediate_size: int = 0  # an MoE's always-on expert, gated by sigmoid(shared_expert_gate(x))
    attn_gate: bool = False  # q_proj also gives a per-head output gate: out * sigmoid(gate) (Qwen3.5)
    # gated DeltaNet layers (layer_types "linear_attention", Qwen3.5): heads and head dims of keys and values
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 4
    linear_tiled: bool = False  # value heads in llama.cpp's tiled order (head j reads key head j % keys), not grouped
    # Gemma 4: full-attention layers' own head size and K/V heads, where they differ from the sliding layers'
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    kv_shared_layers: int = 0  # the last n layers read the K/V of the last earlier layer of their type (Gemma 4)
    k_eq_v: bool = False  # full-attention layers' values are their keys' projection, before the k norm (Gemma 4)
    v_norm: bool = False  # values RMS-normalised per head, without a weight (Gemma 4)
    per_layer_dim: int = 0  # Gemma 4's per-layer inputs: a [per_layer_dim] input per token and layer, 0 = none
    per_layer_vocab: int = 0  # the per-layer embedding table's rows
    layer_scalar: bool = False  # each layer's output times a learned scalar (Gemma 4)
    double_wide_mlp: bool = False  # layers that read another layer's K/V have an MLP twice as wide (Gemma 4)
    moe_beside_mlp: bool = False  # every layer runs a dense MLP and the experts side by side (Gemma 4)

    def __post_init__(self):
        if self.qk_norm is True or self.qk_norm is False:  # the older boolean form: per-head norms or none
            self.qk_norm = "head" if self.qk_norm else ""
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
        if self.rope_freq_factors is not None:
            self.rope_freq_factors = tuple(self.rope_freq_factors)
        self.no_rope_layers = tuple(self.no_rope_layers)
        self.dense_layers = tuple(self.dense_layers)

    def sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def attn_shape(self, layer: int) -> tuple[int, int]:
        """(K/V heads, head size) of an attention layer."""
        if self.global_head_dim and not self.sliding(layer):
            return self.global_kv_heads or self.num_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    def kv_layer(self, layer: int) -> int:
        """The layer whose K/V `layer` attends to: itself, or for the last `kv_shared_layers` layers the last layer
        of the same type before them (transformers' `kv_sharing_modes`); -1 where there is none: another model's
        (a Gemma 4 assistant, every layer of which reads its target's)."""
        first = self.num_layers - self.kv_shared_layers
        if layer < first:
            return layer
        return max((i for i in range(first) if self.sliding(i) == self.sliding(layer)), default=-1)

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` computes and caches K/V of its own."""
        return not self.linear(layer) and self.kv_layer(layer) == layer

    def mlp_size(self, layer: int) -> int:
        """The dense MLP's width in `layer`."""
        return self.intermediate_size * (2 if self.double_wide_mlp and not self.owns_kv(layer) else 1)

    def rope_dim_of(self, sliding: bool) -> int:
        """Channels that rotary embeddings rotate in a sliding or a full-attention layer (the first ones)."""
        return self.head_dim if sliding and self.global_head_dim else self.rope_dim

    def linear(self, layer: int) -> bool:
        """Whether `layer` is a gated DeltaNet (linear attention, a recurrent state) rather than attention."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.linear(i))

    def moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def rope_dim(self) -> int:
        """Channels of each head that rotary embeddings rotate (the first ones), of full-attention layers."""
        return self.rotary_dim or self.global_head_dim or self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if "specdec" in d:  # written by `to_hf_dict`: every field as it was
            return cls(**d["specdec"])
        if "text_config" in d and "num_hidden_layers" not in d:  # a multimodal checkpoint: its text model
            tied = {"tie_word_embeddings": d["tie_word_embeddings"]} if "tie_word_embeddings" in d else {}
            d = {**d["text_config"], **tied}
        fam = families.by_hf_type(d.get("model_type", ""))
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope_scaling = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        window, types = sliding_layers(d, d["num_hidden_layers"])
        fields = dict(
            model_type=d["model_type"],
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
            attention_bias=bool(d.get("attention_bias", False)),
            o_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_types=types,
            family=fam.name,
        )
        return cls(**{**fields, **fam.recipe, **fam.hf_fields(d)})

    def to_hf_dict(self, exact: bool = False) -> dict:
        """A config.json that `transformers` reads as this family's config (the common keys); `exact`: every field
        under "specdec" too, so that we read it back as it is (a converted GGUF's recipe has no HF keys)."""
        fam = families.by_name(self.family)
        d = {
            "architectures": [fam.hf_types.get(self.model_type, next(iter(fam.hf_types.values())))],
            "model_type": self.model_type if self.model_type in fam.hf_types else next(iter(fam.hf_types)),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "hidden_act": "gelu_pytorch_tanh" if self.hidden_act == "gelu_tanh" else "silu",
        }
        return {**d, "specdec": asdict(self)} if exact else d

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            return cls.from_hf_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SpecdecError(f"cannot read model config {path}: {e}") from None
