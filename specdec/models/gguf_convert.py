"""Convert one GGUF file into a fast-loading checkpoint directory.

The output is what `load_checkpoint` reads: config.json, model.safetensors (float32, dequantized
with the `gguf` package and streamed to disk tensor by tensor, llama.cpp's Q/K row permutation
undone), the tokenizer files (tokenizer, special tokens and chat template from the GGUF metadata)
and, written last, a marker holding the GGUF's SHA-256: a directory without it is not a finished
conversion. Everything is written in a unique temp directory under `PARENT/.partial/` and renamed
into place; temp directories of killed conversions (process gone, or older than 6 hours) are
removed by the next conversion.
"""

from __future__ import annotations

import functools
import json
import math
import os
import reprlib
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

from specdec.errors import SpecdecError
from specdec.models import families
from specdec.models.config import ModelConfig
from specdec.models.family import Family
from specdec.paths import home

MARKER = "specdec-converted.json"  # written last: {"sha256": GGUF's SHA-256}
PARTIAL = ".partial"  # temp dirs `HOST.PID.RANDOM` of conversions under way
STALE_S = 6 * 3600


ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")  # read into the config


def hf_names(reader, cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, for every tensor of the file but the rope factors (held by
    the config); a tensor the family does not know is a one-line error."""
    arch = _field(reader, "general.architecture")
    base = families.by_name(cfg.family).gguf_tensor_names(arch, cfg.num_layers)
    names = {}
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        stem, _, kind = t.name.rpartition(".")
        if t.name in base:  # no .weight / .bias (ssm_a)
            names[t.name] = base[t.name]
        elif stem in base:
            names[t.name] = f"{base[stem]}.{kind}"
        elif not _next_n(t.name, cfg.num_layers):  # MTP blocks past the model's layers: models/mtp.py reads them
            raise SpecdecError(f"unsupported GGUF tensor {t.name!r} for architecture {arch!r}")
    return names


def _next_n(name: str, num_layers: int) -> bool:
    """Whether a GGUF tensor belongs to the next-n / MTP layers: a block past the model's layers, or `nextn.*` (the
    Gemma 4 assistant's projections)."""
    layer = name.split(".")[1] if name.startswith("blk.") else ""
    return layer.isdigit() and int(layer) >= num_layers or name.startswith("nextn.")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of q/k weights (llama arch only)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def fast_reader_class():
    """gguf.GGUFReader parsing a plain ndarray view of its memory map (`.memmap` keeps the map): slicing a
    numpy.memmap builds a memmap object per field part, and a 151K-token vocabulary has 1.8M of them (the 1.5B
    pack: 10 s and 0.5 GB of transient memory to open; 1.6 s and none this way). Its `_get` (one call per part)
    skips the byte-order view where the file's order is the machine's, and sizes each dtype once: 1.1 s (llama.cpp's
    models/ggml-vocab-qwen2.gguf, Zen 5)."""
    import gguf
    import numpy as np

    sizes: dict = {}

    class FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mm):
            self.memmap, self._plain = mm, mm.view(np.ndarray)

        def _get(self, offset, dtype, count=1, override_order=None):
            if self.byte_order != "I" or override_order not in (None, "I"):
                return super()._get(offset, dtype, count, override_order)
            size = sizes.get(dtype) or sizes.setdefault(dtype, np.dtype(dtype).itemsize)
            return self._plain[offset : offset + size * int(count)].view(dtype)

    return FastGGUFReader


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` of a GGUF file read from its header alone, where it is the first key (llama.cpp's
    converter writes it first): opening the whole file parses every vocabulary entry (1.1 s for a 151K one). Other
    files: through the reader."""
    from gguf import GGUFValueType

    with open(path, "rb") as f:
        head = f.read(4096)
    if len(head) >= 24 + 8 and head[:4] == b"GGUF" and struct.unpack_from("<I", head, 4)[0] in (2, 3):
        (klen,) = struct.unpack_from("<Q", head, 24)
        key, at = head[32 : 32 + klen], 32 + klen
        string = len(head) >= at + 12 and struct.unpack_from("<I", head, at)[0] == GGUFValueType.STRING
        if key == b"general.architecture" and string:
            (vlen,) = struct.unpack_from("<Q", head, at + 4)
            if len(head) >= at + 12 + vlen:
                return head[at + 12 : at + 12 + vlen].decode("utf-8", "replace")
    return _field(open_gguf(path), "general.architecture")


def tokenizer_digest(reader) -> str:
    """SHA-256 of what a GGUF's tokenizer is built from: the architecture and every `tokenizer.*` key's bytes as
    stored (fields follow each other in the file, so a field ends where the next begins). Files of one model in
    several quantizations, and a draft model of its family, share it (and the tokenizer built from it), and no
    file is read whole to key it."""
    import hashlib

    h = hashlib.sha256()
    fields = list(reader.fields.values())
    for f, nxt in zip(fields, [*fields[1:], None]):
        if f.name == "general.architecture" or f.name.startswith("tokenizer."):
            end = nxt.offset if nxt is not None else f.offset + sum(int(p.nbytes) for p in f.parts)
            h.update(reader.data[f.offset : end].tobytes())
    return h.hexdigest()


def open_gguf(path: Path):
    try:
        return fast_reader_class()(path)
    except Exception as e:  # the reader raises a variety of types on bad files
        raise SpecdecError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def meta_number(value, key: str, path: Path, kind: type = int) -> int | float:
    """Metadata `key`'s `value` as a positive `kind`; missing, zero or not a number -> one-line SpecdecError."""
    try:
        v = kind(value)
    except (TypeError, ValueError, OverflowError):
        v = None
    if v is None or not v > 0:
        what = "missing" if value is None else f"{reprlib.repr(value)} (need a positive number)"
        raise SpecdecError(f"{path}: GGUF metadata {key} is {what}")
    return v


def config_from_gguf(reader, path: Path, family: Family | None = None) -> ModelConfig:
    """The model's config from GGUF metadata: the common keys here, the family's own through its `gguf_fields`;
    `family`: the one that reads the file's architecture, where the registry does not list it as a model (the Gemma 4
    assistant's `gemma4-assistant`)."""
    arch = _field(reader, "general.architecture")
    try:
        fam = family or families.by_gguf_arch(arch)
    except SpecdecError as e:
        raise SpecdecError(f"{path}: {e}") from None
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    first = lambda v: v[0] if isinstance(v, list) and v else v  # per-layer arrays (Gemma 4): the first layer's  # noqa: E731
    num = lambda k, d=None, kind=int: meta_number(first(g(k, d)), f"{arch}.{k}", path, kind)  # noqa: E731
    names = {t.name: t for t in reader.tensors}
    g.tensors = {n: tuple(int(x) for x in reversed(t.shape)) for n, t in names.items()}  # (`family.Meta`)
    if "token_embd.weight" not in names:
        raise SpecdecError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden, heads = num("embedding_length"), num("attention.head_count")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        model_type=next(iter(fam.hf_types)),
        family=fam.name,
        vocab_size=int(names["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=num("feed_forward_length"),
        num_layers=num("block_count"),
        num_heads=heads,
        num_kv_heads=num("attention.head_count_kv", heads),
        head_dim=num("attention.key_length", hidden // heads),
        max_position_embeddings=num("context_length", 4096),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=num("rope.freq_base", 10000.0, float),
        rope_scaling=_rope_scaling(g, names, f"{arch}.", path),
        rope_freq_factors=_factors(names.get("rope_freqs.weight")),
        rotary_dim=_rotary_dim(g("rope.dimension_count"), g("attention.key_length", hidden // heads)),
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_down.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )
    fields.update(fam.recipe)
    fields.update(fam.gguf_fields(g))
    return ModelConfig(**fields)


def _rotary_dim(dims, head_dim) -> int | None:
    """`rope.dimension_count` where it is fewer than a head's channels (partial rotary), else None."""
    return int(dims) if dims is not None and 0 < int(dims) < int(head_dim) else None


def _factors(t) -> tuple[float, ...] | None:
    return None if t is None else tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))


def _rope_scaling(g, tensors: dict, prefix: str, path: Path) -> dict | None:
    """HF-style rope scaling from GGUF metadata (`g(key, default)` of the file's architecture, keys under `prefix`):
    linear / yarn from `rope.scaling.*`, longrope from the `rope_factors_*` tensors (Phi-3); None for none (llama3
    scaling arrives as the `rope_freqs` tensor)."""
    orig = int(g("rope.scaling.original_context_length", 0))
    if "rope_factors_short.weight" in tensors:
        return {
            "rope_type": "longrope",
            "short_factor": list(_factors(tensors["rope_factors_short.weight"])),
            "long_factor": list(_factors(tensors["rope_factors_long.weight"])),
            "original_max_position_embeddings": orig,
            "attention_factor": g("rope.scaling.attn_factor"),
        }
    kind = g("rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {
        "rope_type": kind,
        "factor": meta_number(g("rope.scaling.factor"), f"{prefix}rope.scaling.factor", path, float),
        "original_max_position_embeddings": orig,
    }


def is_converted(out_dir: Path, sha256: str) -> bool:
    """Whether `out_dir` is a finished conversion of the GGUF whose content hashes to `sha256`."""
    try:
        return json.loads((out_dir / MARKER).read_text()).get("sha256") == sha256
    except (OSError, ValueError, AttributeError):
        return False


def convert_gguf(path: Path, out_dir: Path, sha256: str, progress: bool = True) -> Path:
    """Write a checkpoint directory for `path` (content SHA-256 `sha256`) at `out_dir` atomically; return it."""
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    try:
        with _temp_dir(out_dir.parent) as tmp:
            _write_weights(reader, cfg, tmp / "model.safetensors", f"dequantize {path.name}", progress)
            (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(exact=True), indent=2))
            shutil.copytree(gguf_tokenizer(path, reader), tmp, dirs_exist_ok=True)
            (tmp / MARKER).write_text(json.dumps({"sha256": sha256, "source": str(path)}))
            _publish(tmp, out_dir, sha256)
    except OSError as e:
        raise SpecdecError(f"cannot write converted model to {out_dir}: {e.strerror or e}") from None
    return out_dir


def _write_weights(reader, cfg: ModelConfig, dest: Path, desc: str, progress: bool) -> None:
    """A float32 safetensors file, dequantized and written one tensor at a time (never all in memory)."""
    from tqdm import tqdm

    header, offset = {}, 0
    names = hf_names(reader, cfg)
    tensors = [t for t in reader.tensors if t.name in names]
    for t in tensors:
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists ne0 (the row length) first
        n_bytes = 4 * math.prod(shape)
        header[names[t.name]] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(dest, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in tqdm(tensors, desc=desc, unit="tensor", disable=not progress):
            f.write(_dequantize(t, cfg).data)


def _dequantize(t, cfg: ModelConfig) -> np.ndarray:
    """One GGUF tensor as contiguous float32 [rows, ne0] (or [ne0]) as the Hugging Face checkpoint holds it: the
    converter's q/k row interleave undone, its norm shift (Gemma's + 1) taken off."""
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type)
    fam = families.by_name(cfg.family)
    if permuted(t.name, cfg):
        w = unpermute(w, cfg.num_heads if t.name.endswith("attn_q.weight") else cfg.num_kv_heads)
    if cfg.norm_offset and fam.gguf_norm_shifted(t.name):
        w = w - np.float32(cfg.norm_offset)
    return np.ascontiguousarray(fam.from_gguf(t.name, w), dtype=np.float32)


def permuted(name: str, cfg: ModelConfig) -> bool:
    """Whether llama.cpp's converter interleaved this tensor's rows for rotary (q/k of llama-style families)."""
    return families.by_name(cfg.family).permute_qk and name.endswith(("attn_q.weight", "attn_k.weight"))


@contextmanager
def _temp_dir(parent: Path) -> Iterator[Path]:
    """A fresh `parent/.partial/HOST.PID.RANDOM` (dead siblings removed first); removed on exit if still there."""
    partial = parent / PARTIAL
    partial.mkdir(parents=True, exist_ok=True)
    clean_stale(partial)
    tmp = Path(tempfile.mkdtemp(prefix=f"{socket.gethostname()}.{os.getpid()}.", dir=partial))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the published model from other users
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out_dir: Path, sha256: str) -> None:
    """Rename the finished `tmp` to `out_dir` unless a concurrent conversion got there first."""
    if is_converted(out_dir, sha256):
        return
    (out_dir / MARKER).unlink(missing_ok=True)  # an old entry stops counting as finished before it goes
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def clean_stale(partial: Path) -> None:
    """Remove temp dirs in `partial` whose conversion is dead: its process is gone, or it is over STALE_S old."""
    now = time.time()
    for d in partial.iterdir():
        if _is_stale(d, now):
            shutil.rmtree(d, ignore_errors=True)


def _is_stale(d: Path, now: float) -> bool:
    """Over STALE_S old, or named `HOST.PID.*` by a process of this host that is gone."""
    try:
        if now - d.stat().st_mtime > STALE_S:
            return True
        host, pid, _ = d.name.rsplit(".", 2)
        return host == socket.gethostname() and not _pid_alive(int(pid))
    except (OSError, ValueError):
        return False


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def gguf_tokenizer(path: Path, reader=None) -> Path:
    """A folder with the tokenizer of a GGUF file (`reader`: the file opened already), built once (transformers takes
    ~6 s for a 151K vocabulary) and cached under the digest of what it is built from (`tokenizer_digest`); built in a
    temp folder and renamed into place."""
    out = home() / "tokenizers" / f"gguf-{tokenizer_digest(reader or open_gguf(path))[:16]}"
    if (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _save_tokenizer(path, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process published it first
            if not (out / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    """The GGUF's tokenizer, built by transformers from the file's `tokenizer.ggml.*` metadata. transformers builds it
    from those keys alone (`tokenizer.ggml.model`, `.pre`) but refuses architectures whose weights it cannot load
    (granite, olmo2, smollm3, ...): ours are let through its check, the tokenizer being the same either way."""
    import logging

    from transformers import AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import gguf

    class TokenizerReader(fast_reader_class()):
        """Without the rope scaling fields, which the tokenizer does not need and transformers' gpt-oss branch cannot
        read (it takes each field's first part, the key's length, for the value: 'only 0-dimensional arrays can be
        converted to Python scalars'), nor the model's per-layer arrays (Gemma 4's MLP widths: its config wants one)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            arrays = [k for k, f in self.fields.items() if f.types[:1] == [gguf.GGUFValueType.ARRAY]]
            model_arrays = {k for k in arrays if not k.startswith(("tokenizer.", "general."))}
            for key in [k for k in self.fields if ".rope.scaling." in k or k in model_arrays]:
                del self.fields[key]

    archs = [*hf_gguf.GGUF_SUPPORTED_ARCHITECTURES, *(a for f in families.ALL for a in f.gguf_archs)]
    try:
        with (
            mock.patch.object(gguf, "GGUFReader", TokenizerReader),  # what transformers opens the file with
            mock.patch.object(hf_gguf, "GGUF_SUPPORTED_ARCHITECTURES", archs),
        ):
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise SpecdecError(f"{gguf_path}: cannot build its tokenizer ({type(e).__name__}: {e})") from None
    tok.save_pretrained(str(out))
