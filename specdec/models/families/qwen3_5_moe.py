"""Qwen3.5-MoE (text): Qwen3.5's hybrid layers (`families/qwen3_5.py`) with a mixture-of-experts MLP in every layer:
a softmax router's top-k experts, renormalised, plus a shared expert gated by sigmoid(shared_expert_gate(x)).
transformers: models/qwen3_5_moe (`qwen3_5_moe_text`, Qwen3_5MoeForCausalLM)."""

from specdec.models.families import qwen3_5, qwen3_moe
from specdec.models.families.qwen3_moe import MOE_LAYER
from specdec.models.family import Family, Meta

SHARED_EXPERT = tuple(f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")) + ("mlp.shared_expert_gate",)


def _hf(d: dict) -> dict:
    return {
        **qwen3_5.FAMILY.hf_fields(d),
        "num_experts": d["num_experts"],
        "experts_per_token": d["num_experts_per_tok"],
        "expert_intermediate_size": d["moe_intermediate_size"],
        "shared_expert_intermediate_size": d["shared_expert_intermediate_size"],
    }


def _gguf(meta: Meta) -> dict:
    return {
        **qwen3_5.FAMILY.gguf_fields(meta),
        **qwen3_moe.FAMILY.gguf_fields(meta),  # the experts' counts and width
        "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length")),
    }


FAMILY = Family(
    name="qwen3_5_moe",
    hf_types={"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
    gguf_archs=("qwen35moe",),
    recipe={**qwen3_5.FAMILY.recipe, "norm_topk": True},
    hf_fields=_hf,
    gguf_fields=_gguf,
    layer=qwen3_5.FAMILY.layer + MOE_LAYER + SHARED_EXPERT,
    from_gguf=qwen3_5.FAMILY.from_gguf,
    unshifted_norms=qwen3_5.FAMILY.unshifted_norms,
)
