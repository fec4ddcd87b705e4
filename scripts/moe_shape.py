"""Random-block GGUFs at the shapes of released mixture-of-experts models, for speed measurements (weights do not
change speed). A checkpoint of that size fits neither in memory nor on disk in fp32, so the GGUF is written
directly with the `gguf` package's writer, tensor by tensor: the metadata llama.cpp's converter writes for the
architecture, Qwen2's tokenizer from the pinned llama.cpp source's vocab file (151,646 tokens; padded with reserved
control tokens to the model's vocabulary where it is larger, so the embedding has the released number of rows),
and each tensor in the type llama.cpp's tools give it, filled with random blocks whose scales keep weights near
N(0, 0.02^2) and centred:
- qwen3-30b-a3b, Q4_K_M (`llama_tensor_get_type`: attn_v and ffn_down(_exps) Q6_K in the layers its `use_more_bits`
  picks, the output Q6_K, the router and norms F32, the rest Q4_K);
- gpt-oss-20b, as the released MXFP4 GGUF (`MXFP4_MOE`): experts MXFP4, the other matrices Q8_0, biases, norms,
  sinks and the router F32;
- qwen3.5-35b-a3b, Q4_K_M as for Qwen3-MoE (the shared expert's down_proj as the experts'), its gated DeltaNet
  layers' small tensors (conv, A, dt bias, norms) F32 and their beta/alpha projections Q8_0, its MTP block as the
  converter writes it (a nextn layer after the model's), Qwen3.5's tokenizer;
- gemma4-26b-a4b, Q4_K_M: five sliding layers to one full (K/V heads 8 x 256, 2 x 512 whose values are the keys),
  experts beside a dense MLP in every layer (gate and up fused), the rows of 2112 and 704 (not whole Q4_K/Q6_K
  blocks) as llama-quantize's fallback gives them (Q5_0, Q8_0 where it would take Q6_K), the embedding Q6_K (it is
  also the LM head), Gemma 4's tokenizer.

    python scripts/moe_shape.py qwen3-30b-a3b OUT_DIR --layers 24   # OUT_DIR/qwen3-30b-a3b-24l-q4_k_m.gguf
    python scripts/moe_shape.py gpt-oss-20b OUT_DIR                 # OUT_DIR/gpt-oss-20b-24l-mxfp4.gguf
    python scripts/moe_shape.py qwen3.5-35b-a3b OUT_DIR --layers 16 # OUT_DIR/qwen3.5-35b-a3b-16l-q4_k_m.gguf
    python scripts/moe_shape.py gemma4-26b-a4b OUT_DIR --layers 12  # OUT_DIR/gemma4-26b-a4b-12l-q4_k_m.gguf
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
Q = gguf.GGMLQuantizationType
Q4_K, Q6_K, Q8_0, Q5_0, MXFP4, F32 = Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.MXFP4, Q.F32
SHAPES = {  # config.json values of the released models
    "qwen3-30b-a3b": dict(
        arch=gguf.MODEL_ARCH.QWEN3MOE,
        file="q4_k_m",
        vocab=151_936,
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
    "gpt-oss-20b": dict(
        arch=gguf.MODEL_ARCH.GPT_OSS,
        file="mxfp4",
        vocab=201_088,
        layers=24,
        hidden=2880,
        ff=2880,
        expert_ff=2880,
        experts=32,
        used=4,
        heads=64,
        kv_heads=8,
        head_dim=64,
        context=131_072,
        rope_theta=150_000.0,
        eps=1e-5,
        sliding_window=128,
        yarn=dict(factor=32.0, orig_ctx_len=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0),
    ),
    "qwen3.5-35b-a3b": dict(
        arch=gguf.MODEL_ARCH.QWEN35MOE,
        file="q4_k_m",
        vocab=248_320,
        vocab_file="ggml-vocab-qwen35.gguf",
        layers=40,
        hidden=2048,
        ff=512,
        expert_ff=512,
        shared_ff=512,
        experts=256,
        used=8,
        heads=16,
        kv_heads=2,
        head_dim=256,
        rotary_dim=64,
        linear=dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv=4, interval=4),
        context=262_144,
        rope_theta=10_000_000.0,
        eps=1e-6,
    ),
    "gemma4-26b-a4b": dict(
        arch=gguf.MODEL_ARCH.GEMMA4,
        file="q4_k_m",
        vocab=262_144,
        vocab_file="ggml-vocab-gemma-4.gguf",
        layers=30,
        hidden=2816,
        ff=2112,
        expert_ff=704,
        experts=128,
        used=8,
        heads=16,
        kv_heads=8,
        head_dim=256,
        context=262_144,
        rope_theta=1_000_000.0,
        eps=1e-6,
        sliding_window=1024,
        gemma4=dict(full_head_dim=512, full_kv_heads=2, pattern=6, local_theta=10_000.0, rotary=0.25, softcap=30.0),
    ),
}
FILE_TYPE = {"q4_k_m": 15, "mxfp4": 38}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_K_M, LLAMA_FTYPE_MOSTLY_MXFP4_MOE
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
    elif kind == Q8_0:  # d first; int8 quants, rms 74
        data[:, 0:2] = np.array([2.7e-4], dtype=np.float16).view(np.uint8)
    elif kind == Q5_0:  # d first; 5-bit quants, rms 9.2
        data[:, 0:2] = np.array([2.2e-3], dtype=np.float16).view(np.uint8)
    elif kind == MXFP4:  # e8m0 e first: 2^(e - 128) x doubled e2m1 values (rms 5.7)
        data[:, 0] = 120
    else:  # Q6_K: d (fp16) last
        data[:, size - 2 : size] = np.array([2.0e-5], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, -1)


Tensors = list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]


def name(t: T, i: int | None = None, part: str = "weight") -> str:
    return f"{gguf.TENSOR_NAMES[t].format(bid=i)}.{part}"


def tensors(s: dict) -> Tensors:
    """(name, numpy shape, type) of every tensor, in the converter's order."""
    writers = {gguf.MODEL_ARCH.GPT_OSS: gpt_oss, gguf.MODEL_ARCH.QWEN35MOE: qwen3_5_moe, gguf.MODEL_ARCH.GEMMA4: gemma4}
    return writers.get(s["arch"], qwen3_moe)(s)


def qwen3_5_moe(s: dict) -> Tensors:
    """Qwen3.5-MoE: three gated DeltaNet layers before each gated full-attention layer, experts plus a shared expert
    in every layer, then the MTP block (block `layers`)."""
    h, n, e, vocab, lin = s["hidden"], s["layers"], s["experts"], s["vocab"], s["linear"]
    q, kv, hd = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["head_dim"]
    conv = 2 * lin["key_heads"] * lin["key_dim"] + lin["value_heads"] * lin["value_dim"]
    inner, hv = lin["value_heads"] * lin["value_dim"], lin["value_heads"]
    out = [(name(T.TOKEN_EMBD), (vocab, h), Q4_K)]
    for i in range(n + 1):
        more = Q6_K if i < n and use_more_bits(i, n) else Q4_K
        out.append((name(T.ATTN_NORM, i), (h,), F32))
        if i < n and (i + 1) % lin["interval"]:
            out += [
                (name(T.ATTN_QKV, i), (conv, h), Q4_K),
                (name(T.ATTN_GATE, i), (inner, h), Q4_K),
                (name(T.SSM_CONV1D, i), (conv, lin["conv"]), F32),
                (name(T.SSM_DT, i, "bias"), (hv,), F32),
                (gguf.TENSOR_NAMES[T.SSM_A].format(bid=i), (hv,), F32),
                (name(T.SSM_BETA, i), (hv, h), Q8_0),
                (name(T.SSM_ALPHA, i), (hv, h), Q8_0),
                (name(T.SSM_NORM, i), (lin["value_dim"],), F32),
                (name(T.SSM_OUT, i), (h, inner), Q4_K),
            ]
        else:
            out += [
                (name(T.ATTN_Q, i), (2 * q, h), Q4_K),
                (name(T.ATTN_K, i), (kv, h), Q4_K),
                (name(T.ATTN_V, i), (kv, h), more),
                (name(T.ATTN_OUT, i), (h, q), Q4_K),
                (name(T.ATTN_Q_NORM, i), (hd,), F32),
                (name(T.ATTN_K_NORM, i), (hd,), F32),
            ]
        out += [
            (name(T.ATTN_POST_NORM, i), (h,), F32),
            (name(T.FFN_GATE_INP, i), (e, h), F32),
            (name(T.FFN_GATE_EXP, i), (e, s["expert_ff"], h), Q4_K),
            (name(T.FFN_UP_EXP, i), (e, s["expert_ff"], h), Q4_K),
            (name(T.FFN_DOWN_EXP, i), (e, h, s["expert_ff"]), more),
            (name(T.FFN_GATE_INP_SHEXP, i), (1, h), F32),
            (name(T.FFN_GATE_SHEXP, i), (s["shared_ff"], h), Q4_K),
            (name(T.FFN_UP_SHEXP, i), (s["shared_ff"], h), Q4_K),
            (name(T.FFN_DOWN_SHEXP, i), (h, s["shared_ff"]), more),
        ]
    out += [
        (name(T.NEXTN_EH_PROJ, n), (h, 2 * h), Q4_K),
        (name(T.NEXTN_ENORM, n), (h,), F32),
        (name(T.NEXTN_HNORM, n), (h,), F32),
        (name(T.NEXTN_SHARED_HEAD_NORM, n), (h,), F32),
    ]
    return out + [(name(T.OUTPUT_NORM), (h,), F32), (name(T.OUTPUT), (vocab, h), Q6_K)]


def full_layer(s: dict, i: int) -> bool:
    """Gemma 4: the last layer of every `pattern` is a full-attention one, and the model's last (transformers'
    Gemma4TextConfig forces it)."""
    return (i + 1) % s["gemma4"]["pattern"] == 0 or i == s["layers"] - 1


def gemma4(s: dict) -> Tensors:
    """Gemma 4 MoE: per layer attention (no attn_v in full layers: values are the keys), a dense GELU MLP and the
    experts beside it with their norms, the router's scale and per-expert scale, the layer's output scale."""
    h, n, e, f, vocab, g = s["hidden"], s["layers"], s["experts"], s["expert_ff"], s["vocab"], s["gemma4"]
    dense_down = lambda i: Q8_0 if use_more_bits(i, n) else Q5_0  # noqa: E731 (rows of 2112 / 704: no K blocks)
    out = [(name(T.TOKEN_EMBD), (vocab, h), Q6_K), ("rope_freqs.weight", (g["full_head_dim"] // 2,), F32)]
    for i in range(n):
        full = full_layer(s, i)
        hd, kvh = (g["full_head_dim"], g["full_kv_heads"]) if full else (s["head_dim"], s["kv_heads"])
        more = Q6_K if use_more_bits(i, n) else Q4_K
        out += [
            (name(T.ATTN_NORM, i), (h,), F32),
            (name(T.ATTN_Q, i), (s["heads"] * hd, h), Q4_K),
            (name(T.ATTN_K, i), (kvh * hd, h), Q4_K),
            *([] if full else [(name(T.ATTN_V, i), (kvh * hd, h), more)]),
            (name(T.ATTN_OUT, i), (h, s["heads"] * hd), Q4_K),
            (name(T.ATTN_Q_NORM, i), (hd,), F32),
            (name(T.ATTN_K_NORM, i), (hd,), F32),
            (name(T.ATTN_POST_NORM, i), (h,), F32),
            (name(T.FFN_NORM, i), (h,), F32),
            (name(T.FFN_GATE, i), (s["ff"], h), Q4_K),
            (name(T.FFN_UP, i), (s["ff"], h), Q4_K),
            (name(T.FFN_DOWN, i), (h, s["ff"]), dense_down(i)),
            (f"blk.{i}.post_ffw_norm_1.weight", (h,), F32),
            (f"blk.{i}.pre_ffw_norm_2.weight", (h,), F32),
            (f"blk.{i}.post_ffw_norm_2.weight", (h,), F32),
            (name(T.FFN_GATE_INP, i), (e, h), F32),
            (name(T.FFN_GATE_INP, i, "scale"), (h,), F32),
            (f"blk.{i}.ffn_gate_up_exps.weight", (e, 2 * f, h), Q4_K),
            (name(T.FFN_DOWN_EXP, i), (e, h, f), dense_down(i)),
            (name(T.FFN_DOWN_EXP, i, "scale"), (e,), F32),
            (name(T.FFN_POST_NORM, i), (h,), F32),
            (f"blk.{i}.layer_output_scale.weight", (1,), F32),
        ]
    return out + [(name(T.OUTPUT_NORM), (h,), F32)]


def gpt_oss(s: dict) -> Tensors:
    h, e, f, vocab = s["hidden"], s["experts"], s["expert_ff"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = [(name(T.TOKEN_EMBD), (vocab, h), Q8_0)]
    for i in range(s["layers"]):
        out.append((name(T.ATTN_NORM, i), (h,), F32))
        for t, rows, cols in ((T.ATTN_Q, q, h), (T.ATTN_K, kv, h), (T.ATTN_V, kv, h), (T.ATTN_OUT, h, q)):
            out += [(name(t, i), (rows, cols), Q8_0), (name(t, i, "bias"), (rows,), F32)]
        out += [
            (name(T.ATTN_SINKS, i), (s["heads"],), F32),
            (name(T.ATTN_POST_NORM, i), (h,), F32),
            (name(T.FFN_GATE_INP, i), (e, h), F32),
            (name(T.FFN_GATE_INP, i, "bias"), (e,), F32),
        ]
        for t, rows, cols in ((T.FFN_GATE_EXP, f, h), (T.FFN_UP_EXP, f, h), (T.FFN_DOWN_EXP, h, f)):
            out += [(name(t, i), (e, rows, cols), MXFP4), (name(t, i, "bias"), (e, rows), F32)]
    return out + [(name(T.OUTPUT_NORM), (h,), F32), (name(T.OUTPUT), (vocab, h), Q8_0)]


def qwen3_moe(s: dict) -> Tensors:
    h, n, e, vocab = s["hidden"], s["layers"], s["experts"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
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


def data(name: str, shape: tuple[int, ...], kind: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if kind != F32:
        rows = int(np.prod(shape[:-1]))
        return blocks(kind, rows, shape[-1], rng).reshape(*shape[:-1], -1)
    if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "scale", "scale.weight")):
        return np.ones(shape, np.float32)
    if name == "rope_freqs.weight":  # Gemma 4's proportional rope: the first quarter of the pairs rotate
        return np.where(np.arange(shape[0]) < shape[0] // 4, 1.0, 1e30).astype(np.float32)
    if name.endswith(".ssm_a"):  # -exp(A_log): negative
        return -np.exp(rng.normal(0.0, 0.5, shape)).astype(np.float32)
    return rng.normal(0.0, 0.02, shape).astype(np.float32)  # the router, biases, sinks, the conv


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_file: Path, size: int) -> None:
    """The vocab file's tokenizer.* metadata into `writer`, its tokens padded to `size` with reserved control tokens."""
    reader = gguf.GGUFReader(vocab_file)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = gguf.GGUFValueType(field.types[0])
        if kind != gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind)
            continue
        values = field.contents()
        if key == "tokenizer.ggml.tokens":
            values += [f"<|reserved_{i}|>" for i in range(len(values), size)]
        elif key == "tokenizer.ggml.token_type":
            values += [int(gguf.TokenType.CONTROL)] * (size - len(values))
        writer.add_array(key, values)


def write(shape: str, out: Path, layers: int | None, seed: int = 0) -> Path:
    s = dict(SHAPES[shape], layers=layers or SHAPES[shape]["layers"])
    path = out / f"{shape}-{s['layers']}l-{s['file']}.gguf"
    arch = gguf.MODEL_ARCH_NAMES[s["arch"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{shape} shape, random weights, {s['layers']} layers")
    per_layer = ("kv_heads", "head_dim") if "gemma4" in s else ()  # Gemma 4 writes its own below
    for key, add in META.items():  # Qwen3.5's block_count also counts its MTP block
        if key not in per_layer:
            getattr(w, f"add_{add}")(s[key] + (key == "layers" and "linear" in s))
    if not per_layer:
        w.add_value_length(s["head_dim"])
    if "sliding_window" in s:
        w.add_sliding_window(s["sliding_window"])
    if "yarn" in s:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        for key, value in s["yarn"].items():
            getattr(w, f"add_rope_scaling_{key}")(value)
    if "gemma4" in s:  # per-layer K/V heads, the two head sizes, the layer pattern, the local rope base
        g, n = s["gemma4"], s["layers"]
        w.add_head_count_kv([g["full_kv_heads"] if full_layer(s, i) else s["kv_heads"] for i in range(n)])
        w.add_key_length(g["full_head_dim"])
        w.add_value_length(g["full_head_dim"])
        w.add_key_length_swa(s["head_dim"])
        w.add_value_length_swa(s["head_dim"])
        w.add_sliding_window_pattern([not full_layer(s, i) for i in range(n)])
        w.add_shared_kv_layers(0)
        w.add_embedding_length_per_layer_input(0)
        w.add_rope_freq_base_swa(g["local_theta"])
        w.add_rope_dimension_count(g["full_head_dim"])
        w.add_rope_dimension_count_swa(s["head_dim"])
        w.add_final_logit_softcapping(g["softcap"])
    if "linear" in s:  # Qwen3.5: block_count counts the MTP block
        lin = s["linear"]
        w.add_nextn_predict_layers(1)
        w.add_expert_shared_feed_forward_length(s["shared_ff"])
        w.add_rope_dimension_count(s["rotary_dim"])
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_ssm_conv_kernel(lin["conv"])
        w.add_ssm_state_size(lin["key_dim"])
        w.add_ssm_group_count(lin["key_heads"])
        w.add_ssm_time_step_rank(lin["value_heads"])
        w.add_ssm_inner_size(lin["value_heads"] * lin["value_dim"])
        w.add_full_attention_interval(lin["interval"])
    w.add_file_type(FILE_TYPE[s["file"]])
    copy_tokenizer(w, source() / "models" / s.get("vocab_file", "ggml-vocab-qwen2.gguf"), s["vocab"])
    todo = tensors(s)
    for name, shp, kind in todo:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shp)) // block * size
        w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes, None if kind == F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, shp, kind in todo:
        w.write_tensor_data(data(tname, shp, kind, rng))
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
