"""OLMo 2: norms after attention and after the MLP (none before), q and k each RMS-normed over all heads before
rotary. transformers: models/olmo2."""

from specdec.models.family import QK_NORMS, Family

OLMO2_LAYER = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    *QK_NORMS,
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "post_feedforward_layernorm",
)

FAMILY = Family(
    name="olmo2",
    hf_types={"olmo2": "Olmo2ForCausalLM"},
    gguf_archs=("olmo2",),
    recipe={"norms": "post", "qk_norm": "full"},
    layer=OLMO2_LAYER,
)
