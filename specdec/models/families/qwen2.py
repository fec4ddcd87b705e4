"""Qwen2 / Qwen2.5 (and MiMo's Qwen2 body): the Llama recipe with q/k/v biases, no o_proj bias.
transformers: models/qwen2."""

from specdec.models.family import Family

FAMILY = Family(
    name="qwen2",
    hf_types={"qwen2": "Qwen2ForCausalLM", "mimo": "MiMoForCausalLM"},
    gguf_archs=("qwen2",),
    recipe={"attention_bias": True, "o_bias": False},
)
