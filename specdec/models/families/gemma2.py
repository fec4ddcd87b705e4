"""Gemma 2: sandwich norms (RMS norm before and after attention and MLP) scaling by 1 + weight, GELU (tanh) gate,
embeddings times sqrt(hidden), query scale from `query_pre_attn_scalar`, tanh soft-capping of attention scores and
logits, sliding-window and full layers alternating (the first sliding). transformers: models/gemma2."""

from specdec.models.family import Family, Meta

GEMMA_LAYER = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "post_feedforward_layernorm",
)
GEMMA_RECIPE = {"norms": "sandwich", "norm_offset": 1.0, "hidden_act": "gelu_tanh", "tie_word_embeddings": True}


def gemma_query_scale(meta: Meta, num_layers_27b: int) -> float:
    """llama.cpp's rule for a GGUF (which stores no query scale): 1/sqrt(hidden/heads) for the 27B, 1/sqrt(head_dim)
    otherwise (gemma_pytorch's configs; the HF configs of the released sizes agree)."""
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    dim = hidden / heads if meta("block_count") == num_layers_27b else meta("attention.key_length", hidden // heads)
    return dim**-0.5


def swa_types(meta: Meta, pattern: int, num_layers: int) -> tuple[str, ...]:
    """Per-layer types as llama.cpp reads them: a stated per-layer array, else layer i slides when
    i % pattern < pattern - 1 (`sliding_window_pattern` may restate the pattern)."""
    stated = meta("attention.sliding_window_pattern")
    if isinstance(stated, list):
        slides = [bool(x) for x in stated]
    else:
        n = int(stated or pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in slides)


def gemma_fields(d: dict) -> dict:
    """The scales and soft-caps of a Gemma 2 / 3 config.json."""
    return {
        "attn_scale": d["query_pre_attn_scalar"] ** -0.5,
        "attn_softcap": d.get("attn_logit_softcapping"),
        "final_softcap": d.get("final_logit_softcapping"),
        "embed_scale": d["hidden_size"] ** 0.5,
    }


def _gguf(meta: Meta) -> dict:
    n = meta("block_count")
    return {
        "attn_scale": gemma_query_scale(meta, 46),
        "attn_softcap": meta("attn_logit_softcapping"),
        "final_softcap": meta("final_logit_softcapping"),
        "embed_scale": meta("embedding_length") ** 0.5,
        "sliding_window": meta("attention.sliding_window", 4096),
        "layer_types": swa_types(meta, 2, n),
    }


FAMILY = Family(
    name="gemma2",
    hf_types={"gemma2": "Gemma2ForCausalLM"},
    gguf_archs=("gemma2",),
    recipe=GEMMA_RECIPE,
    hf_fields=gemma_fields,
    gguf_fields=_gguf,
    layer=GEMMA_LAYER,
)
