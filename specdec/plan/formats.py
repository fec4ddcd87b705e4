"""Weight and KV formats: bytes per tensor from the real block sizes of each GGML quant type.

A plan's weight format is one of
- `file`: every tensor as stored in the file (a GGUF's own quant types; what llama.cpp/Ollama load),
- a runtime dtype `auto|bf16|fp16|fp32`: what specdec's own runtime holds (GGUF weights are
  dequantized at conversion, so each tensor costs params x dtype bytes; draft linears int8/int4),
- a GGML type (`q8_0`, `q4_k`, `iq4_xs`...): the file requantized to it, as llama-quantize would
  do it uniformly (2-D weights in that type, 1-D tensors in F32).
"""

from __future__ import annotations

import functools

from specdec.errors import SpecdecError

RUNTIME_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
_ALIASES = {
    "f32": "F32",
    "fp32": "F32",
    "float32": "F32",
    "f16": "F16",
    "fp16": "F16",
    "float16": "F16",
    "bf16": "BF16",
    "bfloat16": "BF16",
}
# safetensors dtype -> (GGML-style name, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": ("F64", 8),
    "F32": ("F32", 4),
    "F16": ("F16", 2),
    "BF16": ("BF16", 2),
    "I64": ("I64", 8),
    "I32": ("I32", 4),
    "I16": ("I16", 2),
    "I8": ("I8", 1),
    "U8": ("I8", 1),
    "BOOL": ("I8", 1),
    "F8_E4M3": ("F8", 1),
    "F8_E5M2": ("F8", 1),
}


@functools.cache
def quant_sizes() -> dict[str, tuple[int, int]]:
    """GGML type name -> (block size in elements, bytes per block), from the installed `gguf` package."""
    import gguf

    sizes = {t.name: v for t, v in gguf.GGML_QUANT_SIZES.items()}
    sizes.setdefault("F8", (1, 1))
    return sizes


def ggml_type(name: str) -> str:
    """'q4_k' / 'Q4_K' / 'f16' / 'bf16' -> the GGML type name; unknown: SpecdecError listing the known ones."""
    key = _ALIASES.get(name.lower(), name.upper())
    sizes = quant_sizes()
    if key not in sizes:
        raise SpecdecError(
            f"unknown quant type {name!r} (the installed gguf package knows: {', '.join(sorted(sizes))})"
        )
    return key


def type_bytes(type_name: str, n_elements: int, row_len: int | None = None) -> int:
    """Bytes of `n_elements` stored as GGML type `type_name` (rows of `row_len` must fill whole blocks)."""
    sizes = quant_sizes()
    if type_name not in sizes:
        raise SpecdecError(
            f"unknown quant type {type_name!r}: its block size is not known to the installed gguf "
            "package (upgrade `gguf`)"
        )
    block, size = sizes[type_name]
    row = n_elements if row_len is None else row_len
    if row % block or n_elements % block:
        raise SpecdecError(f"{type_name} stores blocks of {block} elements; a row of {row} does not fit it")
    return n_elements // block * size


def weight_format(name: str) -> str:
    """Validate a `--dtype` value: 'file', a runtime dtype ('auto' kept as is) or a GGML type name."""
    low = name.lower()
    if low in ("file", "auto") or low in RUNTIME_DTYPES:
        return low
    return ggml_type(name)


def is_runtime_format(fmt: str) -> bool:
    return fmt == "auto" or fmt in RUNTIME_DTYPES


def kv_type(name: str, weight_fmt: str, runtime_dtype: str) -> str:
    """`--kv-dtype`: 'auto' = the runtime dtype for runtime formats, F16 (llama.cpp's default) otherwise."""
    if name.lower() == "auto":
        return {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[runtime_dtype] if is_runtime_format(weight_fmt) else "F16"
    return ggml_type(name)
