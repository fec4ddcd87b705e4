"""Random-block GGUFs at the shapes of released mixture-of-experts models, for speed measurements (weights do not
change speed). A checkpoint of that size fits neither in memory nor on disk in fp32, so the GGUF is written
directly with the `gguf` package's writer, tensor by tensor: the metadata llama.cpp's converter writes for the
architecture, Qwen2's tokenizer from the pinned llama.cpp source's vocab file (151,646 tokens, so the embedding has
that many rows), and each tensor in the type `llama-quantize` gives it for Q4_K_M (`llama_tensor_get_type`: attn_v
and ffn_down(_exps) Q6_K in the layers its `use_more_bits` picks, the output Q6_K, the router and norms F32, the
rest Q4_K), filled with random blocks whose scales keep weights near N(0, 0.02^2) and centred.

    python scripts/moe_shape.py qwen3-30b-a3b OUT_DIR --layers 24   # OUT_DIR/qwen3-30b-a3b-24l-q4_k_m.gguf
    specdec bench -m OUT_DIR/qwen3-30b-a3b-24l-q4_k_m.gguf --methods none,synthetic,llama-none --llama-server auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from families import source  # noqa: E402

T = gguf.MODEL_TENSOR
Q4_K, Q6_K, F32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32
SHAPES = {  # config.json values of the released models
    "qwen3-30b-a3b": dict(
        arch=gguf.MODEL_ARCH.QWEN3MOE,
        layers=48,
        hidden=2048,
        ff=6144,
        expert_ff=768,
        experts=128,
        used=8,
        heads=32,
        kv_heads=4,
        head_dim=128,
        context=40960,
        rope_theta=1_000_000.0,
        eps=1e-6,
    ),
}
MOSTLY_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
META = {  # shape key -> the GGUFWriter method (add_...) that writes its metadata, as the converter does
    "layers": "block_count",
    "context": "context_length",
    "hidden": "embedding_length",
    "ff": "feed_forward_length",
    "heads": "head_count",
    "kv_heads": "head_count_kv",
    "head_dim": "key_length",
    "rope_theta": "rope_freq_base",
    "eps": "layer_norm_rms_eps",
    "experts": "expert_count",
    "used": "expert_used_count",
    "expert_ff": "expert_feed_forward_length",
}


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get Q6_K under Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def blocks(kind: gguf.GGMLQuantizationType, rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks [rows, bytes per row]: random quants and sub-block scales, super-block scales set so that
    weights are about N(0, 0.02^2) (Q4_K: min = 7.5 d, the mean of its scaled quants, so they are centred)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows * row_len // block, size), dtype=np.uint8)
    if kind == Q4_K:  # d, dmin (fp16) first
        data[:, 0:4] = np.array([1.0e-4, 7.5e-4], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: d (fp16) last
        data[:, size - 2 : size] = np.array([2.0e-5], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def tensors(s: dict, vocab: int) -> list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]:
    """(name, numpy shape, type) of every tensor, in the converter's order."""
    h, n, e = s["hidden"], s["layers"], s["experts"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def name(t: T, i: int | None = None) -> str:
        return gguf.TENSOR_NAMES[t].format(bid=i) + ".weight"

    out = [(name(T.TOKEN_EMBD), (vocab, h), Q4_K)]
    for i in range(n):
        more = Q6_K if use_more_bits(i, n) else Q4_K
        out += [
            (name(T.ATTN_NORM, i), (h,), F32),
            (name(T.ATTN_Q, i), (q, h), Q4_K),
            (name(T.ATTN_K, i), (kv, h), Q4_K),
            (name(T.ATTN_V, i), (kv, h), more),
            (name(T.ATTN_OUT, i), (h, q), Q4_K),
            (name(T.ATTN_Q_NORM, i), (s["head_dim"],), F32),
            (name(T.ATTN_K_NORM, i), (s["head_dim"],), F32),
            (name(T.FFN_NORM, i), (h,), F32),
            (name(T.FFN_GATE_INP, i), (e, h), F32),
            (name(T.FFN_GATE_EXP, i), (e, s["expert_ff"], h), Q4_K),
            (name(T.FFN_UP_EXP, i), (e, s["expert_ff"], h), Q4_K),
            (name(T.FFN_DOWN_EXP, i), (e, h, s["expert_ff"]), more),
        ]
    return out + [(name(T.OUTPUT_NORM), (h,), F32), (name(T.OUTPUT), (vocab, h), Q6_K)]


def data(shape: tuple[int, ...], kind: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if kind != F32:
        rows = int(np.prod(shape[:-1]))
        return blocks(kind, rows, shape[-1], rng).reshape(*shape[:-1], -1)
    if len(shape) == 1:  # norms
        return np.ones(shape, np.float32)
    return rng.normal(0.0, 0.02, shape).astype(np.float32)  # the router


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_file: Path) -> int:
    """The vocab file's tokenizer.* metadata into `writer`; returns its token count."""
    reader = gguf.GGUFReader(vocab_file)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = gguf.GGUFValueType(field.types[0])
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def write(shape: str, out: Path, layers: int | None, seed: int = 0) -> Path:
    s = dict(SHAPES[shape], layers=layers or SHAPES[shape]["layers"])
    path = out / f"{shape}-{s['layers']}l-q4_k_m.gguf"
    arch = gguf.MODEL_ARCH_NAMES[s["arch"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{shape} shape, random weights, {s['layers']} layers")
    for key, add in META.items():
        getattr(w, f"add_{add}")(s[key])
    w.add_value_length(s["head_dim"])
    w.add_file_type(MOSTLY_Q4_K_M)
    vocab = copy_tokenizer(w, source() / "models" / "ggml-vocab-qwen2.gguf")
    todo = tensors(s, vocab)
    for name, shp, kind in todo:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shp)) // block * size
        w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes, None if kind == F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shp, kind in todo:
        w.write_tensor_data(data(shp, kind, rng))
    w.close()
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, help="fewer layers than the released model's (speed per layer is the same)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(write(args.shape, args.out, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
