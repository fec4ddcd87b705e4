"""Llama 1/2/3.x, Mistral, Ministral: pre-norm layers, SwiGLU, rotary embeddings (linear, llama3 and yarn scaling;
GGUF `rope_freqs`), sliding windows where the config sets one. transformers: models/llama, models/mistral."""

from specdec.models.family import Family

FAMILY = Family(
    name="llama",
    hf_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "ministral": "MinistralForCausalLM"},
    gguf_archs=("llama",),
    permute_qk=True,
)
