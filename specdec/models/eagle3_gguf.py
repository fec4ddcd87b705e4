"""llama.cpp GGUF export of an EAGLE-3 head: architecture `eagle3` (src/models/eagle3.cpp of the pinned llama.cpp).

The file llama.cpp's own converter writes (`convert_hf_to_gguf.py <save_head dir> --target-model-dir <HF target>`;
tests/test_eagle3_conformance.py compares the two tensor by tensor), made from the target's GGUF instead, which is
what model packs are: the target's tokenizer is copied (llama-server refuses a draft whose vocabulary differs).
q/k rows are interleaved for llama.cpp's rotary (the converter's `LlamaModel.permute`), `d2t` holds absolute target
ids (I64), and `eagle3.target_layers` are layer-input ids, as `aux_layers` are.

    llama-server -m target.gguf -md head.gguf --spec-type draft-eagle3
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecdecError
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, hf_state
from specdec.models.gguf_convert import open_gguf

ARCH = "eagle3"
GGUF_NAMES = {  # HF / SpecForge name -> GGUF name (llama-arch.cpp); t2d is not used by llama.cpp
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
OUT_TYPES = {"f32": (np.float32, 0), "f16": (np.float16, 1)}  # --outtype -> (matrix dtype, general.file_type)


def save_gguf(head: Eagle3Head, path: Path, target_gguf: Path, outtype: str = "f32") -> Path:
    """Write `head` as an `eagle3` GGUF for the target in `target_gguf` (its tokenizer is copied; vocabulary, hidden
    size and layer count are checked). `outtype` f16 stores matrices in F16 (norms stay F32), as the converter."""
    import gguf

    if outtype not in OUT_TYPES:
        raise SpecdecError(f"GGUF outtype {outtype!r}: use one of {', '.join(OUT_TYPES)}")
    c = head.config
    if c.rope_scaling is not None:
        raise SpecdecError(
            "EAGLE-3 GGUF export: RoPE scaling is not written here; use llama.cpp's "
            "convert_hf_to_gguf.py on a save_head directory"
        )
    reader = open_gguf(Path(target_gguf))
    _check_target(reader, c, Path(target_gguf))
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        _add_hparams(writer, c, OUT_TYPES[outtype][1])
        _copy_tokenizer(reader, writer)
        for name, array in gguf_tensors(head, OUT_TYPES[outtype][0]).items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def gguf_tensors(head: Eagle3Head, matrix_dtype: type = np.float32) -> dict[str, np.ndarray]:
    """GGUF name -> array ([out, in] row-major, as GGUFWriter takes them): q/k rows interleaved, d2t absolute."""
    c = head.config
    out = {}
    for name, t in hf_state(head).items():
        if name in GGUF_NAMES:
            w = t.float().numpy()
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                w = permute(w, c.num_heads if "q_proj" in name else c.num_kv_heads)
            out[GGUF_NAMES[name]] = w.astype(matrix_dtype if w.ndim == 2 else np.float32)
    out["d2t"] = head.draft_to_target.to(torch.int64).numpy()  # [Vd] absolute target ids
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows [n_head * hd, in] -> llama.cpp's interleaved rotary order (inverse of `gguf_convert.unpermute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_target(reader, c: Eagle3Config, path: Path) -> None:
    """The target GGUF must be the model the head was made for (vocabulary, hidden size, enough layers)."""
    arch = reader.fields["general.architecture"].contents()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else None
    hidden = _number(reader, f"{arch}.embedding_length")
    layers = _number(reader, f"{arch}.block_count")
    if n_vocab != c.vocab_size or hidden != c.target_hidden_size or layers is None or layers <= max(c.aux_layers):
        raise SpecdecError(
            f"{path}: not the target of this EAGLE-3 head (vocabulary {n_vocab}, hidden {hidden}, "
            f"{layers} layers; the head needs {c.vocab_size}, {c.target_hidden_size}, "
            f"> {max(c.aux_layers)})"
        )


def _number(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    return None if f is None else int(f.contents())


def _add_hparams(writer, c: Eagle3Config, file_type: int) -> None:
    """The keys `llama_model_eagle3::load_arch_hparams` and the generic llama loader read."""
    from gguf import GGUFValueType

    writer.add_key_value(f"{ARCH}.target_layers", list(c.aux_layers), GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_uint32(f"{ARCH}.target_hidden_size", c.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for key, value in {
        "block_count": 1,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_heads,
        "attention.head_count_kv": c.num_kv_heads,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "rope.dimension_count": c.head_dim,
        "vocab_size": c.vocab_size,
    }.items():
        writer.add_uint32(f"{ARCH}.{key}", value)
    writer.add_float32(f"{ARCH}.rope.freq_base", c.rope_theta)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_type("model")
    writer.add_name("EAGLE-3 head")
    writer.add_uint32("general.file_type", file_type)
    writer.add_quantization_version(2)


def _copy_tokenizer(reader, writer) -> None:
    """Every `tokenizer.*` key of the target, with its GGUF value types."""
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)
