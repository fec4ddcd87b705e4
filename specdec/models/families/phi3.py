"""Phi-3, Phi-3.5, Phi-4: the Llama recipe with q/k/v fused in one `qkv_proj` and gate/up in one `gate_up_proj`
(as our layers hold them), longrope scaling (`models.rope`), partial rotary (Phi-4-mini), a sliding window where
the config sets one; from a GGUF none (llama.cpp runs Phi-3 without its window: `src/models/phi3.cpp`).
transformers: models/phi3."""

from specdec.models.family import Family

PHI3_LAYER = (
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)


def _hf(d: dict) -> dict:
    out = {}
    scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
    partial = d.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))
    if partial < 1.0:  # transformers rotates int(head_dim * factor) channels
        out["rotary_dim"] = int((d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]) * partial)
    if scaling.get("rope_type", scaling.get("type")) == "longrope":
        orig = scaling.get("original_max_position_embeddings") or d["original_max_position_embeddings"]
        out["rope_scaling"] = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": orig}
    return out


FAMILY = Family(
    name="phi3",
    hf_types={"phi3": "Phi3ForCausalLM"},
    gguf_archs=("phi3",),
    hf_fields=_hf,
    layer=PHI3_LAYER,
)
