"""gpt-oss: a mixture of experts (the top-k router logits, softmaxed, with biases; SwiGLU clamped at `swiglu_limit`
with `(up + 1) * gate * sigmoid(1.702 gate)`; biases on every expert), attention with q/k/v/o biases and a learned
sink logit per head, sliding-window and full layers alternating, yarn rope. transformers: models/gpt_oss; GGUF
`gpt-oss` as llama.cpp's converter writes it (experts split into gate / up / down with their biases)."""

from specdec.models.family import Family, Meta

GPT_OSS_LAYER = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.sinks",
    "post_attention_layernorm",
    "mlp.router",
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.experts.down_proj",
)
RECIPE = {"router": "topk_softmax", "router_bias": True, "expert_bias": True, "attn_sinks": True}


def _hf(d: dict) -> dict:
    return {
        "num_experts": d["num_local_experts"],
        "experts_per_token": d["num_experts_per_tok"],
        "expert_intermediate_size": d["intermediate_size"],
        "swiglu_limit": float(d.get("swiglu_limit", 7.0)),
        "o_bias": bool(d.get("attention_bias", True)),
    }


def _gguf(meta: Meta) -> dict:
    layers = int(meta("block_count"))
    return {
        "num_experts": int(meta("expert_count")),
        "experts_per_token": int(meta("expert_used_count")),
        "expert_intermediate_size": int(meta("expert_feed_forward_length")),
        "swiglu_limit": 7.0,  # fixed by llama.cpp (LLM_FFN_SWIGLU_OAI_MOE in src/models/openai-moe.cpp)
        "sliding_window": int(meta("attention.sliding_window")),
        "layer_types": tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)),
        "o_bias": True,
    }


FAMILY = Family(
    name="gpt_oss",
    hf_types={"gpt_oss": "GptOssForCausalLM"},
    gguf_archs=("gpt-oss",),
    recipe=RECIPE,
    hf_fields=_hf,
    gguf_fields=_gguf,
    layer=GPT_OSS_LAYER,
)
