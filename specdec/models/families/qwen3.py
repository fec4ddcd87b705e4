"""Qwen3: the Llama recipe with an RMS norm over each head of q and k before rotary. transformers: models/qwen3."""

from specdec.models.family import LLAMA_LAYER, QK_NORMS, Family

FAMILY = Family(
    name="qwen3",
    hf_types={"qwen3": "Qwen3ForCausalLM"},
    gguf_archs=("qwen3",),
    recipe={"qk_norm": "head"},
    layer=LLAMA_LAYER + QK_NORMS,
)
