"""Gemma 4 (text): Gemma's sandwich norms, here scaling by the weight itself, with
- per-head q, k and v RMS norms (v's without a weight) and an attention scale of 1;
- sliding-window layers (head size `head_dim`, rope base 10000) and full layers with their own head size and K/V
  heads (`global_head_dim`; with `attention_k_eq_v` their values are the keys' projection), rotating a quarter of
  each head at the whole head's frequencies (proportional rope, base 1e6);
- the last `num_kv_shared_layers` layers attending to the K/V of the last earlier layer of their type;
- per-layer inputs: a table row per token and layer plus a projection of the embeddings, fed into each layer
  through a gate; each layer's output times a learned scalar;
- in the MoE models, experts beside the dense MLP in every layer (router on the normed residual, scaled per expert).
transformers: models/gemma4 (`gemma4_text`, Gemma4ForCausalLM)."""

from specdec.errors import SpecdecError
from specdec.models.families.gemma2 import GEMMA_LAYER, swa_types
from specdec.models.family import QK_NORMS, Family, Meta

LOCAL_THETA = 10000.0  # HF Gemma4TextConfig's default for sliding layers


def _full_layer_overrides(d: dict) -> dict:
    """A full-attention layer's head size and K/V heads: config.json's `per_layer_config` (what transformers writes)
    or `global_head_dim` / `num_global_key_value_heads` (what it reads)."""
    types = d.get("layer_types") or []
    per = d.get("per_layer_config") or {}
    full = next((per[k] for k in per if types and types[int(k)] == "full_attention"), None)
    if full is not None:
        return {"global_head_dim": full.get("head_dim"), "global_kv_heads": full.get("num_key_value_heads")}
    kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v") else None
    return {"global_head_dim": d.get("global_head_dim", 512), "global_kv_heads": kv}


def _hf(d: dict) -> dict:
    if d.get("use_bidirectional_attention") == "all":
        raise SpecdecError("Gemma 4 with bidirectional attention over all tokens is not a causal language model")
    rope = d.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    moe = {}
    if d.get("enable_moe_block"):
        moe = {
            "num_experts": d["num_experts"],
            "experts_per_token": d["top_k_experts"],
            "expert_intermediate_size": d["moe_intermediate_size"],
            "moe_beside_mlp": True,
            "router": "scaled",
        }
    return {
        "tie_word_embeddings": d.get("tie_word_embeddings", True),  # (Gemma4TextConfig's default)
        "final_softcap": d.get("final_logit_softcapping"),
        "embed_scale": d["hidden_size"] ** 0.5,
        "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
        "rope_scaling": full if full.get("rope_type", "default") != "default" else None,
        "rope_local_theta": float(local.get("rope_theta", LOCAL_THETA)),
        "kv_shared_layers": d.get("num_kv_shared_layers", 0),
        "k_eq_v": bool(d.get("attention_k_eq_v")),
        "per_layer_dim": d.get("hidden_size_per_layer_input") or 0,
        "per_layer_vocab": d.get("vocab_size_per_layer_input") or 0,
        "double_wide_mlp": bool(d.get("use_double_wide_mlp")),
        **_full_layer_overrides(d),
        **moe,
    }


def _gguf(meta: Meta) -> dict:
    """llama.cpp's converter (conversion/gemma.py, Gemma4Model) writes per-layer arrays of K/V heads and MLP widths,
    full layers' head size as key_length (the sliding ones' as key_length_swa), and the proportional rope as
    `rope_freqs` (factor 1e30 on the pairs that do not rotate)."""
    n, hidden = int(meta("block_count")), int(meta("embedding_length"))
    types = swa_types(meta, 6, n)
    full = types.index("full_attention")
    kv, ff = meta("attention.head_count_kv"), meta("feed_forward_length")
    per_layer = lambda v, i: int(v[i] if isinstance(v, list) else v)  # noqa: E731
    shared = int(meta("attention.shared_kv_layers", 0))
    fields = {
        "head_dim": int(meta("attention.key_length_swa")),
        "num_kv_heads": per_layer(kv, types.index("sliding_attention")),
        "global_head_dim": int(meta("attention.key_length")),
        "global_kv_heads": per_layer(kv, full),
        "intermediate_size": per_layer(ff, 0),
        "double_wide_mlp": shared > 0 and per_layer(ff, n - 1) == 2 * per_layer(ff, 0),
        "kv_shared_layers": shared,
        "k_eq_v": f"blk.{full}.attn_v.weight" not in meta.tensors,
        "sliding_window": int(meta("attention.sliding_window")),
        "layer_types": types,
        "rope_local_theta": float(meta("rope.freq_base_swa", LOCAL_THETA)),
        "final_softcap": meta("final_logit_softcapping"),
        "embed_scale": hidden**0.5,
        "per_layer_dim": int(meta("embedding_length_per_layer_input", 0)),
        "per_layer_vocab": meta.tensors.get("per_layer_token_embd.weight", (0,))[0],
    }
    if meta("expert_count"):
        fields.update(
            num_experts=int(meta("expert_count")),
            experts_per_token=int(meta("expert_used_count")),
            expert_intermediate_size=int(meta("expert_feed_forward_length")),
            moe_beside_mlp=True,
            router="scaled",
        )
    return fields


PER_LAYER = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm", "layer_scalar")
MOE_LAYER = (
    "router.proj",
    "experts.gate_up_proj",
    "experts.down_proj",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
)
TOP = ("model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm")

FAMILY = Family(
    name="gemma4",
    hf_types={"gemma4_text": "Gemma4ForCausalLM"},
    gguf_archs=("gemma4",),
    recipe={
        "norms": "sandwich",
        "hidden_act": "gelu_tanh",
        "qk_norm": "head",
        "v_norm": True,
        "attn_scale": 1.0,
        "layer_scalar": True,
    },
    hf_fields=_hf,
    gguf_fields=_gguf,
    layer=GEMMA_LAYER + QK_NORMS + PER_LAYER + MOE_LAYER,
    top=TOP,
)
