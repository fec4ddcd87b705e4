"""What a model family is: its names in both formats, how its configs read, its tensors and its layer recipe.

Each family is one file under `specdec/models/families/` that builds one `Family`; `families/__init__.py` lists
them. The loader, the GGUF reader, the planner and error messages ask the registry (`families.by_hf_type`,
`families.by_gguf_arch`), so no other list of architectures exists.

GGUF tensor names come from the `gguf` package's own tables (`gguf.TensorNameMap`, the ones llama.cpp's
converter writes with): a family lists its tensors by their Hugging Face names and `gguf_tensor_names` maps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# per-layer tensors of a Llama-style layer, by their Hugging Face module names
LLAMA_LAYER = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
TOP = ("model.embed_tokens", "model.norm", "lm_head")

# GGUF metadata of the file's architecture: meta("rope.freq_base", default) -> value; meta.tensors: the file's tensor
# shapes by name (rows first, as numpy and torch order them)
Meta = Callable[..., Any]


def _nothing(_: Any) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family.

    recipe: `ModelConfig` fields every model of the family has (norm placement, activation, q/k norms, ...).
    hf_fields(config.json dict) / gguf_fields(meta): the family's own `ModelConfig` fields read from each format
    (the common ones, sizes and rope, are read by `models.config`).
    layer: the per-layer tensors by Hugging Face module name (`top`: others beside TOP); permute_qk: llama.cpp's
    converter interleaves q/k rows (its llama-style archs), undone when reading a GGUF; from_gguf: the family's other
    converter changes, undone.
    """

    name: str
    hf_types: dict[str, str]  # HF model_type -> the architecture class its config.json names
    gguf_archs: tuple[str, ...]  # GGUF general.architecture values
    recipe: dict = field(default_factory=dict)
    hf_fields: Callable[[dict], dict] = _nothing
    gguf_fields: Callable[[Meta], dict] = _nothing
    layer: tuple[str, ...] = LLAMA_LAYER
    top: tuple[str, ...] = ()  # tensors outside the layers beside `TOP` (Gemma 4's per-layer input tables)
    permute_qk: bool = False
    from_gguf: Callable[[str, np.ndarray], np.ndarray] = lambda name, w: w  # undo a converter change (by GGUF name)
    unshifted_norms: tuple[str, ...] = ()  # GGUF names of norms the converter left without the recipe's + offset

    def gguf_tensor_names(self, arch: str, num_layers: int) -> dict[str, str]:
        """GGUF tensor base name -> Hugging Face module name ("blk.0.attn_q" -> "model.layers.0.self_attn.q_proj")
        for this family's tensors, from the gguf package's tables."""
        import gguf

        ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        # an architecture the installed gguf package does not know (gemma4-assistant): the family's first one's names
        arch_id = ids.get(arch, ids[self.gguf_archs[0]])
        table = gguf.TensorNameMap(arch_id, num_layers)
        hf = list(TOP + self.top) + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in self.layer]
        return {g: n for n in hf if (g := table.get_name(n)) is not None}

    def gguf_norm_shifted(self, name: str) -> bool:
        """Whether the converter stored this norm weight (GGUF name) plus the recipe's offset."""
        return name.endswith("norm.weight") and not name.endswith(self.unshifted_norms)


def sliding_layers(d: dict, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) from an HF config: `layer_types` where given; a window with no types applies to
    every layer (Mistral); `use_sliding_window: false` (Qwen2) turns a stated window off."""
    window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
    types = d.get("layer_types")
    if window is None:
        return None, None
    if types is None:
        types = ["sliding_attention"] * num_layers
    if "sliding_attention" not in types:
        return None, None
    return int(window), tuple(types)
