"""Convert one GGUF file into a fast-loading checkpoint directory.

The output is what `load_checkpoint` reads: config.json, model.safetensors (float32, dequantized
with the `gguf` package, llama.cpp's Q/K row permutation undone) and the tokenizer files
(tokenizer, special tokens and chat template from the GGUF metadata).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise SpecdecError(f"unsupported GGUF tensor {name!r}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of q/k weights (llama arch only)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path):
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises a variety of types on bad files
        raise SpecdecError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise SpecdecError(f"unsupported architecture {arch!r} (supported: {', '.join(_ARCHS)})")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise SpecdecError("GGUF with rope_freqs (llama3 rope scaling) is not supported yet")
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    rope_scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor")),
                        "original_max_position_embeddings": int(g("rope.scaling.original_context_length", 0))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=_ARCHS[arch], vocab_size=int(names["token_embd.weight"].shape[1]), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")), num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=int(g("attention.key_length", hidden // heads)),
        max_position_embeddings=int(g("context_length", 4096)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        qk_norm=arch == "qwen3", tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def convert_gguf(path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write a checkpoint directory for `path` at `out_dir` atomically; return `out_dir`."""
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = open_gguf(path)
    cfg = config_from_gguf(reader)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensors = {}
        for t in tqdm(reader.tensors, desc=f"dequantize {path.name}", unit="tensor", disable=not progress):
            w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if cfg.model_type == "llama" and t.name.endswith("attn_q.weight"):
                w = unpermute(w, cfg.num_heads)
            elif cfg.model_type == "llama" and t.name.endswith("attn_k.weight"):
                w = unpermute(w, cfg.num_kv_heads)
            tensors[hf_name(t.name)] = w
        save_file(tensors, str(tmp / "model.safetensors"))
        del tensors
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        _save_tokenizer(path, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    except OSError as e:
        raise SpecdecError(f"cannot write converted model to {out_dir}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise SpecdecError(f"{gguf_path}: cannot build its tokenizer ({type(e).__name__}: {e})") from None
    tok.save_pretrained(str(out))
