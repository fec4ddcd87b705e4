"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture-of-experts MLP: a softmax router picks each
token's top-k experts, whose SwiGLU outputs are summed with the top-k weights (renormalised to 1 where the config
says `norm_topk_prob`; llama.cpp always does for this architecture). Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step`, keep a dense MLP. transformers: models/qwen3_moe."""

from specdec.models.family import LLAMA_LAYER, QK_NORMS, Family, Meta

MOE_LAYER = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def _hf(d: dict) -> dict:
    layers, step = d["num_hidden_layers"], d.get("decoder_sparse_step", 1)
    only = set(d.get("mlp_only_layers") or [])
    return {
        "num_experts": d.get("num_experts") or d["num_local_experts"],  # transformers 5 writes the latter
        "experts_per_token": d["num_experts_per_tok"],
        "expert_intermediate_size": d["moe_intermediate_size"],
        "norm_topk": bool(d.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(layers) if i in only or (i + 1) % step),
    }


def _gguf(meta: Meta) -> dict:
    return {
        "num_experts": int(meta("expert_count")),
        "experts_per_token": int(meta("expert_used_count")),
        "expert_intermediate_size": int(meta("expert_feed_forward_length")),
    }


FAMILY = Family(
    name="qwen3_moe",
    hf_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
    gguf_archs=("qwen3moe",),
    recipe={"qk_norm": "head"},
    hf_fields=_hf,
    gguf_fields=_gguf,
    layer=LLAMA_LAYER + QK_NORMS + MOE_LAYER,
)
