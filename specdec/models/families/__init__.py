"""The model-family registry: one file per family in this folder, one line per family below."""

from __future__ import annotations

from specdec.errors import SpecdecError
from specdec.models.families import (
    gemma2,
    gemma3,
    gemma4,
    gpt_oss,
    granite,
    llama,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    smollm3,
)
from specdec.models.family import Family

ALL: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5_moe.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    gemma4.FAMILY,
    phi3.FAMILY,
    gpt_oss.FAMILY,
    granite.FAMILY,
    olmo2.FAMILY,
    smollm3.FAMILY,
)


def supported() -> str:
    """'llama (llama, mistral, ministral), qwen2 (...), ...' for error messages."""
    return "; ".join(f"{f.name} ({', '.join(f.hf_types)})" for f in ALL)


def by_name(name: str) -> Family:
    return next(f for f in ALL if f.name == name)


def by_hf_type(model_type: str) -> Family:
    """The family of a Hugging Face `model_type`, or a one-line error naming the supported ones."""
    for f in ALL:
        if model_type in f.hf_types:
            return f
    raise SpecdecError(f"unsupported architecture {model_type!r} (supported families and model_types: {supported()})")


def by_gguf_arch(arch: str) -> Family:
    """The family of a GGUF `general.architecture`, or a one-line error naming the supported ones."""
    for f in ALL:
        if arch in f.gguf_archs:
            return f
    archs = ", ".join(a for f in ALL for a in f.gguf_archs)
    raise SpecdecError(f"unsupported architecture {arch!r} (supported GGUF architectures: {archs})")


def known(name: str) -> bool:
    """Whether a Hugging Face model_type or a GGUF architecture is one of ours."""
    return any(name in f.hf_types or name in f.gguf_archs for f in ALL)


def recipe_of(name: str) -> dict:
    """The recipe of the family of a model_type or GGUF architecture ({} for an unknown one)."""
    return next((f.recipe for f in ALL if name in f.hf_types or name in f.gguf_archs), {})
