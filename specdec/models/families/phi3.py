"""Phi-3, Phi-3.5, Phi-4: the Llama recipe with q/k/v fused in one `qkv_proj` and gate/up in one `gate_up_proj`
(as our layers hold them), longrope scaling (short factors: sequences within the original context), a sliding
window where the config sets one; from a GGUF none (llama.cpp runs Phi-3 without its window: `src/models/phi3.cpp`).
transformers: models/phi3."""

from specdec.errors import SpecdecError
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
    if d.get("partial_rotary_factor", 1.0) < 1.0:
        raise SpecdecError(f"phi3 with partial_rotary_factor {d['partial_rotary_factor']} is not supported yet")
    scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return {}
    orig = scaling.get("original_max_position_embeddings") or d["original_max_position_embeddings"]
    return {"rope_scaling": {**scaling, "rope_type": "longrope", "original_max_position_embeddings": orig}}


FAMILY = Family(
    name="phi3",
    hf_types={"phi3": "Phi3ForCausalLM"},
    gguf_archs=("phi3",),
    hf_fields=_hf,
    layer=PHI3_LAYER,
)
