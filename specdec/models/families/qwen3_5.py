"""Qwen3.5 (text): gated DeltaNet layers (`models/linear_attention.py`, a recurrent state per sequence) with a
full-attention layer every `full_attention_interval` (4); attention with per-head q/k norms, a per-head output gate
from q_proj (out * sigmoid(gate)) and rotary on the first quarter of each head; norms scale by (1 + weight).
transformers: models/qwen3_5 (`qwen3_5_text`, Qwen3_5ForCausalLM)."""

import numpy as np

from specdec.models.family import LLAMA_LAYER, QK_NORMS, Family, Meta

LINEAR_LAYER = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.conv1d",
    "linear_attn.A_log",
    "linear_attn.dt_proj",  # the GGUF's name of dt_bias: ssm_dt.bias
    "linear_attn.norm",
    "linear_attn.out_proj",
)


def _hf(d: dict) -> dict:
    n, rope = d["num_hidden_layers"], d.get("rope_parameters") or d.get("rope_scaling") or {}
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    interval = d.get("full_attention_interval", 4)
    types = d.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return {
        "layer_types": tuple(types),
        "rotary_dim": int(head_dim * rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
        "linear_key_heads": d["linear_num_key_heads"],
        "linear_value_heads": d["linear_num_value_heads"],
        "linear_key_dim": d["linear_key_head_dim"],
        "linear_value_dim": d["linear_value_head_dim"],
        "linear_conv_kernel": d.get("linear_conv_kernel_dim", 4),
    }


def _gguf(meta: Meta) -> dict:
    """llama.cpp's converter (conversion/qwen.py, Qwen3_5TextModel) writes the linear layers' sizes as ssm keys and
    counts the MTP blocks in block_count; it reorders value heads from grouped by key head to tiled."""
    layers = int(meta("block_count")) - int(meta("nextn_predict_layers", 0))
    interval, hv = int(meta("full_attention_interval", 4)), int(meta("ssm.time_step_rank"))
    recurrent = meta("attention.recurrent_layers") or [bool((i + 1) % interval) for i in range(layers)]
    return {
        "num_layers": layers,
        "layer_types": tuple("linear_attention" if r else "full_attention" for r in recurrent[:layers]),
        "linear_key_heads": int(meta("ssm.group_count")),
        "linear_value_heads": hv,
        "linear_key_dim": int(meta("ssm.state_size")),
        "linear_value_dim": int(meta("ssm.inner_size")) // hv,
        "linear_conv_kernel": int(meta("ssm.conv_kernel")),
        "linear_tiled": True,
    }


def _from_gguf(name: str, w: np.ndarray) -> np.ndarray:
    """The converter stores A_log as A = -exp(A_log)."""
    return np.log(-w) if name.endswith(".ssm_a") else w


FAMILY = Family(
    name="qwen3_5",
    hf_types={"qwen3_5_text": "Qwen3_5ForCausalLM"},
    gguf_archs=("qwen35",),
    recipe={"qk_norm": "head", "norm_offset": 1.0, "attn_gate": True},
    hf_fields=_hf,
    gguf_fields=_gguf,
    layer=LLAMA_LAYER + QK_NORMS + LINEAR_LAYER,
    from_gguf=_from_gguf,
    unshifted_norms=("ssm_norm.weight",),
)
