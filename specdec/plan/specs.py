"""Model specs for planning: shape numbers plus every tensor with its stored type and size.

Read from a model pack name (its GGUF), a GGUF file (tensor list via `gguf.GGUFReader`), a
checkpoint directory (config.json + safetensors headers, no weights loaded) or a bare config.json
(tensors derived from the config). Architectures our runtime does not run can still be planned.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.models import families
from specdec.models.gguf_convert import meta_number
from specdec.plan.formats import SAFETENSORS_DTYPES, quant_sizes, type_bytes

# Hugging Face repositories of the packs' models (for exports to engines that load from the hub).
PACK_HF_REPOS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
}
_LAYER = re.compile(r"^(?:blk|model\.layers|layers|model\.language_model\.layers)\.(\d+)\.")
_EMBED = {
    "token_embd.weight",
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
}
_OUTPUT = {"output.weight", "lm_head.weight"}
_NORM = {"output_norm.weight", "model.norm.weight", "model.language_model.norm.weight"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    role: str  # embed | output | norm | layer | other
    layer: int | None  # block index for role 'layer'
    n_elements: int
    rows: int  # output rows (1 for a vector)
    row_len: int  # elements per row
    file_type: str  # GGML-style type name as stored (Q4_K, F32, BF16...)
    file_bytes: int  # bytes as stored


@dataclass(frozen=True)
class Dims:
    arch: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    hidden: int
    intermediate: int
    vocab: int
    max_ctx: int
    tied: bool
    experts: int = 0  # mixture of experts: experts per layer (0: dense)
    experts_used: int = 0  # experts each token is routed to
    expert_intermediate: int = 0


@dataclass
class ModelSpec:
    label: str  # what the user named (pack, path)
    kind: str  # pack | gguf | checkpoint | config
    path: Path | None
    dims: Dims
    tensors: list[TensorSpec]
    gguf_path: Path | None = None
    hf_repo: str | None = None
    notes: list[str] = field(default_factory=list)
    reader_parts: int = 0  # GGUF: numpy views `gguf.GGUFReader` makes of the header (memory.reader_bytes)

    @property
    def params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: of each layer's experts, only the `experts_used` it is routed to."""
        d = self.dims
        experts = sum(t.n_elements for t in self.tensors if is_expert(t.name))
        return self.params - (experts - experts * d.experts_used // d.experts if d.experts else 0)

    @property
    def file_bytes(self) -> int:
        return sum(t.file_bytes for t in self.tensors)

    @property
    def runtime_supported(self) -> bool:
        return families.known(self.dims.arch)

    def type_summary(self) -> str:
        """'Q4_K x169, F32 x141, Q6_K x29' (most common first)."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.file_type] = counts.get(t.file_type, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def role_of(name: str) -> tuple[str, int | None]:
    m = _LAYER.match(name)
    if m:
        return "layer", int(m.group(1))
    if name in _EMBED:
        return "embed", None
    if name in _OUTPUT:
        return "output", None
    if name in _NORM:
        return "norm", None
    return "other", None


def load_spec(name_or_path: str) -> ModelSpec:
    """A pack name, GGUF file, checkpoint directory or config.json -> ModelSpec (no weights loaded)."""
    from specdec.models import packs

    if name_or_path in packs.PACKS:
        gguf = packs.gguf_path(name_or_path)
        if gguf.exists():
            spec = read_gguf(gguf)
        elif packs.is_pulled(name_or_path):
            spec = read_checkpoint(packs.model_dir(name_or_path))
        else:
            raise SpecdecError(
                f"model pack {name_or_path} is not pulled; run `specdec models pull {name_or_path}` "
                "(the plan reads its GGUF file)"
            )
        spec.label, spec.kind, spec.hf_repo = name_or_path, "pack", PACK_HF_REPOS.get(name_or_path)
        return spec
    p = packs.local_path(name_or_path)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise SpecdecError(f"{p}: no config.json (give a GGUF file, a checkpoint directory or a config.json)")
        return read_checkpoint(p) if list(p.glob("*.safetensors")) else read_config(p / "config.json")
    if p.suffix == ".json":
        return read_config(p)
    return read_gguf(p)


# ---------------------------------------------------------------- GGUF


def read_gguf(path: Path) -> ModelSpec:
    """Tensor list (name, type, shape, bytes) and metadata of a GGUF file; no tensor data is read."""
    header = read_gguf_header(path)
    tensors = []
    for name, shape, qtype in header.tensors:
        role, layer = role_of(name)
        n = math.prod(shape)
        row_len = shape[0] if shape else 1
        tensors.append(
            TensorSpec(name, role, layer, n, n // max(row_len, 1), row_len, qtype, type_bytes(qtype, n, row_len))
        )
    dims = _gguf_dims(header.meta, path, tensors)
    return ModelSpec(path.name, "gguf", path, dims, tensors, gguf_path=path, reader_parts=header.reader_parts)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_MAX = 4096  # numeric metadata arrays up to this many entries are kept, longer ones skipped


@dataclass
class GGUFHeader:
    meta: dict
    tensors: list[tuple[str, list[int], str]]  # (name, shape ne0.., GGML type name)
    reader_parts: int  # numpy views `gguf.GGUFReader` makes of the same header


def read_gguf_header(path: Path) -> GGUFHeader:
    """Metadata and tensor table of a GGUF v2/v3 file.

    A small reader instead of `gguf.GGUFReader`, which decodes every tokenizer string in Python
    (20 s for a 150k-token vocabulary); quant types and sizes still come from the `gguf` package.
    Large arrays (the tokenizer) are skipped, numeric arrays up to 4096 entries kept.
    """
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse_header(mm, path)
    except SpecdecError:
        raise
    except (OSError, ValueError, struct.error, IndexError, OverflowError, MemoryError) as e:
        raise SpecdecError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _parse_header(mm, path: Path) -> GGUFHeader:
    if mm[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    c = _Cursor(mm, 4)
    version, n_tensors, n_kv = c.unpack("<IQQ")
    c.parts += 3
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 and 3 are supported)")
    meta: dict = {}
    for _ in range(n_kv):
        key = c.string()
        (vtype,) = c.unpack("<I")
        c.parts += 1
        meta[key] = c.value(vtype, not key.startswith("tokenizer."))
    infos = [c.tensor_info(path) for _ in range(n_tensors)]
    align = int(meta.get("general.alignment", 32) or 32)
    _check_extent(len(mm), (c.off + align - 1) // align * align, infos)
    return GGUFHeader(meta, [(name, shape, qtype) for name, shape, qtype, _ in infos], c.parts)


class _Cursor:
    """Reads a GGUF header from a memory map and counts the numpy views `gguf.GGUFReader` makes for it (one per
    number, two per string: its length and its bytes), what opening the file costs the runtime's loader."""

    def __init__(self, mm, off: int):
        self.mm, self.off, self.parts = mm, off, 0

    def unpack(self, fmt: str) -> tuple:
        vals = struct.unpack_from(fmt, self.mm, self.off)
        self.off += struct.calcsize(fmt)
        return vals

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.off + n > len(self.mm):
            raise ValueError("string runs past the end of the file")
        self.off += n
        self.parts += 2
        return self.mm[self.off - n : self.off].decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool) -> object:
        if vtype in _SCALARS:
            self.parts += 1
            return self.unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(keep)
        raise ValueError(f"unknown metadata value type {vtype}")

    def array(self, keep: bool) -> list | None:
        """The array's values when `keep` and it is short; long or unwanted string arrays are skipped undecoded."""
        etype, count = self.unpack("<IQ")
        self.parts += 2
        keep = keep and count <= _KEEP_MAX
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            vals = list(struct.unpack_from(f"<{count}{fmt[1]}", self.mm, self.off)) if keep else None
            self.off += struct.calcsize(fmt) * count
            self.parts += count
            return vals
        if etype == _STRING and not keep:
            self.skip_strings(count)
            return None
        items = [self.value(etype, keep) for _ in range(count)]
        return items if keep else None

    def skip_strings(self, count: int) -> None:
        """Skip `count` strings without decoding them (tokenizer vocabularies)."""
        o = self.off
        for _ in range(count):
            o += 8 + struct.unpack_from("<Q", self.mm, o)[0]
        if o > len(self.mm):
            raise ValueError("string array runs past the end of the file")
        self.off = o
        self.parts += 2 * count

    def tensor_info(self, path: Path) -> tuple[str, list[int], str, int]:
        """(name, shape ne0.., GGML type name, data offset) of the next tensor in the table."""
        name = self.string()
        (n_dims,) = self.unpack("<I")
        shape = list(self.unpack(f"<{n_dims}Q"))
        raw_type, data_off = self.unpack("<IQ")
        self.parts += 4  # n_dims, dims, type, offset
        return name, shape, _type_name(path, name, raw_type), data_off


def _type_name(path: Path, tensor: str, raw_type: int) -> str:
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise SpecdecError(
            f"{path}: tensor {tensor} has unknown quant type id {raw_type} (the "
            "installed gguf package does not know it; upgrade `gguf`)"
        ) from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise SpecdecError(
            f"{path}: tensor {tensor} has quant type {qtype.name} with no known block size (upgrade `gguf`)"
        )
    return qtype.name


def _check_extent(file_size: int, data_start: int, infos: list[tuple[str, list[int], str, int]]) -> None:
    """Every tensor's data lies inside the file (a truncated download fails here, not at load)."""
    for name, shape, qtype, data_off in infos:
        block, size = quant_sizes()[qtype]
        if data_start + data_off + math.prod(shape) // block * size > file_size:
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")


def _gguf_field(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    return max(v) if isinstance(v, list) and v and isinstance(v[0], (int, float)) else v


def _gguf_dims(meta: dict, path: Path, tensors: list[TensorSpec]) -> Dims:
    arch = _gguf_field(meta, "general.architecture")
    if not arch:
        raise SpecdecError(f"{path}: GGUF without general.architecture")
    g = lambda k, d=None: _gguf_field(meta, f"{arch}.{k}", d)  # noqa: E731
    num = lambda k, d=None: meta_number(g(k, d), f"{arch}.{k}", path)  # noqa: E731
    hidden, heads, layers = num("embedding_length"), num("attention.head_count"), num("block_count")
    names = {t.name: t for t in tensors}
    embd = names.get("token_embd.weight")
    vocab = embd.rows if embd else int(g("vocab_size", 0) or 0)
    hd_k = num("attention.key_length", hidden // heads)
    return Dims(
        arch=arch,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=num("attention.head_count_kv", heads),
        head_dim_k=hd_k,
        head_dim_v=num("attention.value_length", hd_k),
        hidden=hidden,
        intermediate=int(g("feed_forward_length", 0) or 0),
        vocab=vocab,
        max_ctx=num("context_length", 4096),
        tied="output.weight" not in names,
        experts=int(g("expert_count", 0) or 0),
        experts_used=int(g("expert_used_count", 0) or 0),
        expert_intermediate=int(g("expert_feed_forward_length", 0) or 0),
    )


# ---------------------------------------------------------------- Hugging Face


def _hf_dims(d: dict, where: Path) -> Dims:
    d = d.get("text_config") or d
    try:
        heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
        hd = int(d.get("head_dim") or hidden // heads)
        return Dims(
            arch=d.get("model_type", "?"),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim_k=hd,
            head_dim_v=hd,
            hidden=hidden,
            intermediate=int(d.get("intermediate_size") or 4 * hidden),
            vocab=int(d["vocab_size"]),
            max_ctx=int(d.get("max_position_embeddings", 4096)),
            tied=bool(d.get("tie_word_embeddings", False)),
            experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
            experts_used=int(d.get("num_experts_per_tok") or 0),
            expert_intermediate=int(d.get("moe_intermediate_size") or 0),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise SpecdecError(
            f"{where}: config lacks or garbles {e} (need num_hidden_layers, num_attention_heads, "
            "hidden_size, vocab_size)"
        ) from None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"cannot read model config {path}: {e}") from None
    if not isinstance(d, dict):
        raise SpecdecError(f"{path}: not a model config (expected a JSON object)")
    return d


def read_config(path: Path) -> ModelSpec:
    """A bare config.json: tensors derived from the shapes; stored type from its torch_dtype (default BF16)."""
    d = _read_json(path)
    dims = _hf_dims(d, path)
    dtype = str((d.get("text_config") or d).get("torch_dtype") or d.get("dtype") or "bfloat16")
    ftype, size = {"float32": ("F32", 4), "float16": ("F16", 2)}.get(dtype, ("BF16", 2))
    bias = bool(d.get("attention_bias")) or families.recipe_of(dims.arch).get("attention_bias", False)
    h, hd, q, kv, inter = (
        dims.hidden,
        dims.head_dim_k,
        dims.num_heads * dims.head_dim_k,
        dims.num_kv_heads * dims.head_dim_k,
        dims.intermediate,
    )
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (dims.vocab, h))]
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
        ]
        if dims.experts:  # every layer a mixture of experts (Qwen3-MoE's released configs)
            e, f = dims.experts, dims.expert_intermediate
            shapes += [
                (p + "mlp.gate.weight", (e, h)),
                (p + "mlp.experts.gate_proj.weight", (e, f, h)),
                (p + "mlp.experts.up_proj.weight", (e, f, h)),
                (p + "mlp.experts.down_proj.weight", (e, h, f)),
            ]
        else:
            shapes += [
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
            ]
        if bias:
            shapes += [
                (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.bias", (kv,)),
            ]
        if families.recipe_of(dims.arch).get("qk_norm"):
            shapes += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
    shapes.append(("model.norm.weight", (h,)))
    if not dims.tied:
        shapes.append(("lm_head.weight", (dims.vocab, h)))
    tensors = [_hf_tensor(name, shape, ftype, size) for name, shape in shapes]
    spec = ModelSpec(str(path), "config", path, dims, tensors)
    spec.notes.append(f"tensors derived from {path.name} (stored as {ftype}); exact sizes need the weights file")
    return spec


def is_expert(name: str) -> bool:
    """Whether a tensor holds a mixture-of-experts layer's experts (GGUF `ffn_*_exps`, HF `mlp.experts.*`)."""
    return "_exps." in name or ".experts." in name


def _hf_tensor(name: str, shape: tuple[int, ...], ftype: str, size: int) -> TensorSpec:
    n = math.prod(shape)
    role, layer = role_of(name)
    row_len = shape[-1] if shape else 1
    return TensorSpec(name, role, layer, n, n // max(row_len, 1), row_len, ftype, n * size)


def read_checkpoint(directory: Path) -> ModelSpec:
    """config.json + the safetensors headers (names, dtypes, shapes); no weights are read."""
    dims = _hf_dims(_read_json(directory / "config.json"), directory / "config.json")
    tensors = []
    for f in sorted(directory.glob("*.safetensors")):
        for name, info in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            if info.get("dtype") not in SAFETENSORS_DTYPES:
                raise SpecdecError(f"{f}: tensor {name} has unknown dtype {info.get('dtype')!r}")
            ftype, size = SAFETENSORS_DTYPES[info["dtype"]]
            tensors.append(_hf_tensor(name, tuple(int(s) for s in info["shape"]), ftype, size))
    if not tensors:
        raise SpecdecError(f"{directory}: no tensors in its safetensors files")
    return ModelSpec(str(directory), "checkpoint", directory, dims, tensors)


def _safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("header too large")
            return json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise SpecdecError(f"{path}: not a readable safetensors file ({e})") from None
