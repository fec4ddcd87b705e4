"""Granite 3.x: the Llama recipe with four multipliers: embeddings, each block's output before the residual add,
the attention scores (in place of head_dim ** -0.5), and logits divided by `logits_scaling`.
transformers: models/granite."""

from specdec.models.family import Family, Meta


def _hf(d: dict) -> dict:
    return {
        "embed_scale": d.get("embedding_multiplier", 1.0),
        "residual_scale": d.get("residual_multiplier", 1.0),
        "attn_scale": d.get("attention_multiplier", 1.0),
        "logit_divisor": d.get("logits_scaling", 1.0),
    }


def _gguf(meta: Meta) -> dict:
    return {
        "embed_scale": meta("embedding_scale", 1.0),
        "residual_scale": meta("residual_scale", 1.0),
        "attn_scale": meta("attention.scale", 1.0),
        "logit_divisor": meta("logit_scale", 1.0),
    }


FAMILY = Family(
    name="granite",
    hf_types={"granite": "GraniteForCausalLM"},
    gguf_archs=("granite",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    permute_qk=True,
)
