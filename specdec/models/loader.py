"""Resolve a model name or path to a checkpoint directory and load it."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.state import is_mtp_tensor
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer, fuse_projections
from specdec.paths import home
from specdec.runtime.cpu import has_bf16

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str, device: str = "cpu", quant: str = "none") -> torch.dtype:
    """auto: float32 for a `gguf` target on the CPU (the kernels take and give float32: bf16 activations only add
    conversions, measured 29 vs 37 tok/s on the 1.5B), else bf16 where the device computes it natively."""
    if name == "auto" and quant == "gguf" and device == "cpu":
        return torch.float32
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") or has_bf16() else torch.float32
    if name not in DTYPES:
        raise SpecdecError(f"unknown dtype {name!r} (choose auto, bf16, fp16 or fp32)")
    return DTYPES[name]


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """A pack name, a GGUF file or a checkpoint directory -> checkpoint directory."""
    from specdec.models import packs

    if name_or_path in packs.PACKS:
        return packs.pull(name_or_path, progress=progress)
    p = packs.local_path(name_or_path)
    if p.is_dir():
        if not (p / "config.json").exists() or not list(p.glob("*.safetensors")):
            raise SpecdecError(f"{p}: not a checkpoint directory (needs config.json and *.safetensors)")
        return p
    return converted_gguf(p, progress)


QUANT_CHOICES = ("auto", "gguf", "int8", "int4", "none")  # --quant (target) and --draft-quant


def resolve_quant(quant: str, name_or_path: str) -> str:
    """`auto` -> the file's own precision: `gguf` for a model pack or a GGUF file (its blocks through the kernels),
    `none` for a checkpoint directory (its safetensors' dtype). Other choices pass through."""
    if quant != "auto":
        return quant
    from specdec.models import packs

    if name_or_path in packs.PACKS:
        return "gguf"
    return "none" if packs.local_path(name_or_path).is_dir() else "gguf"


def resolve_gguf(name_or_path: str, progress: bool = True) -> Path:
    """A pack name or a GGUF file -> the GGUF file itself (for `--quant gguf`); a checkpoint directory has no
    GGUF: an error."""
    from specdec.models import packs

    if name_or_path in packs.PACKS:
        return packs.pack_gguf(name_or_path, progress)
    p = packs.local_path(name_or_path)
    if p.is_dir():
        raise SpecdecError(
            f"--quant gguf needs a GGUF file or a model pack; {p} is a checkpoint directory "
            "(use --quant none, int8 or int4)"
        )
    return p


def _content_sha(path: Path) -> str:
    from specdec.models.packs import sha256_file

    try:
        return sha256_file(path)
    except OSError as e:
        raise SpecdecError(f"cannot read {path}: {e.strerror or e}") from None


def converted_gguf(path: Path, progress: bool = True) -> Path:
    """Convert a GGUF file once; later calls reuse the conversion cached under its content's SHA-256. Two processes
    converting the same file take turns (a lock per conversion), so the second finds the first's."""
    from specdec.models.gguf_convert import convert_gguf, is_converted
    from specdec.paths import file_lock

    sha = _content_sha(path)
    out = home() / "converted" / f"{path.stem}-{sha[:16]}"
    if is_converted(out, sha):
        return out
    with file_lock(home() / "locks" / f"{out.name}.lock", "waiting for another conversion" if progress else ""):
        if is_converted(out, sha):
            return out
        return convert_gguf(path, out, sha, progress=progress)


# multimodal checkpoints' other parts (Qwen3.5, Gemma 3, Gemma 4's vision and audio)
VISION = (
    "model.visual.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)


def text_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model (a multimodal checkpoint's `model.language_model.*` ->
    `model.*`), None for its vision parts."""
    if name.startswith(VISION):
        return None
    return "model." + name.removeprefix("model.language_model.") if name.startswith("model.language_model.") else name


def load_checkpoint(directory: Path, dtype: torch.dtype, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    from safetensors import safe_open

    cfg = ModelConfig.from_file(directory / "config.json")
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {}
    try:
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    ours = text_name(name)
                    if ours is None or is_mtp_tensor(ours, cfg.num_layers):  # MTP blocks: models/mtp.py loads them
                        continue
                    state[ours] = sf.get_tensor(name).to(device=device, dtype=dtype)
    except Exception as e:
        raise SpecdecError(f"{directory}: cannot read weights ({type(e).__name__}: {e})") from None
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fuse_projections(state, cfg.num_layers)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise SpecdecError(
            f"{directory}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model, Tokenizer(directory)
