"""Gemma 3 (text): Gemma 2's layer plus per-head q/k RMS norms (1 + weight), no attention soft-capping, a separate
unscaled rope base for sliding layers (10000), five sliding layers to one full. transformers: models/gemma3
(`gemma3_text`, Gemma3ForCausalLM)."""

from specdec.models.families.gemma2 import GEMMA_LAYER, GEMMA_RECIPE, gemma_fields, gemma_query_scale, swa_types
from specdec.models.family import QK_NORMS, Family, Meta

LOCAL_THETA = 10000.0  # HF Gemma3TextConfig.default_theta["local"]; llama.cpp's rope_freq_base_train_swa default


def _hf(d: dict) -> dict:
    rope = d.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = full if full.get("rope_type", "default") != "default" else d.get("rope_scaling")
    return {
        **gemma_fields(d),
        "rope_theta": float(full.get("rope_theta") or d.get("rope_theta") or 1_000_000.0),
        "rope_scaling": scaling or None,
        "rope_local_theta": float(local.get("rope_theta") or d.get("rope_local_base_freq") or LOCAL_THETA),
    }


def _gguf(meta: Meta) -> dict:
    n, window = meta("block_count"), meta("attention.sliding_window")
    fields = {
        "attn_scale": gemma_query_scale(meta, 62),
        "final_softcap": meta("final_logit_softcapping"),
        "embed_scale": meta("embedding_length") ** 0.5,
    }
    if window:
        fields.update(
            sliding_window=window,
            layer_types=swa_types(meta, 6, n),
            rope_local_theta=float(meta("rope.freq_base_swa", LOCAL_THETA)),
        )
    return fields


FAMILY = Family(
    name="gemma3",
    hf_types={"gemma3_text": "Gemma3ForCausalLM"},
    gguf_archs=("gemma3",),
    recipe={**GEMMA_RECIPE, "qk_norm": "head"},
    hf_fields=_hf,
    gguf_fields=_gguf,
    layer=GEMMA_LAYER + QK_NORMS,
)
