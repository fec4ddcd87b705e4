"""SmolLM3: the Llama recipe with rotary embeddings left out of some layers (every fourth: `no_rope_layers`).
transformers: models/smollm3."""

from specdec.models.family import Family, Meta

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step for smollm3; HF's default no_rope_layer_interval


def _hf(d: dict) -> dict:
    use = d.get("no_rope_layers")
    if use is None:
        use = [int((i + 1) % d.get("no_rope_layer_interval", NO_ROPE_STEP) != 0) for i in range(d["num_hidden_layers"])]
    return {"no_rope_layers": tuple(i for i, u in enumerate(use) if not u)}


def _gguf(meta: Meta) -> dict:
    return {"no_rope_layers": tuple(i for i in range(meta("block_count")) if (i + 1) % NO_ROPE_STEP == 0)}


FAMILY = Family(
    name="smollm3",
    hf_types={"smollm3": "SmolLM3ForCausalLM"},
    gguf_archs=("smollm3",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    permute_qk=True,
)
