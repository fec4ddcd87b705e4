"""Build (once per source, compiler, flags and CPU) and load the CPU kernels: GGUF block matmuls (`ggml_q.c`),
the attention of decode and verification steps (`attention.c`), a decoder layer's small operations
(`small_ops.c`) and a whole decoder layer in one call (`layer.c`).

The C files are compiled at first use with the system C compiler into
`$SPECDEC_HOME/kernels/ggml_q-HASH.so`, HASH covering the source, the compiler's version, the flags
and the CPU's model and feature flags, so a build is never reused on another CPU. The library is
written under a temp name and renamed into place (concurrent builders are harmless). Without a
compiler, or if the build fails, `library()` returns None after one warning and callers fall back
to dequantize + torch matmul.

Env: SPECDEC_KERNELS=off disables the library; SPECDEC_KERNEL_PATH=scalar|avx2|avx512bw|avx512|amx caps the
instruction set the kernels use (a path the CPU lacks is lowered to the best one it has).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from specdec.paths import home

SOURCES = [Path(__file__).with_name(f) for f in ("ggml_q.c", "attention.c", "small_ops.c", "layer.c")]
HEADERS = [
    Path(__file__).with_name(f)
    for f in ("gq_matmul.h", "x16_kernels.h", "x16_avx2.h", "x16_amx.h", "attention_body.h", "vec_exp.h")
]  # included: part of the hash
CFLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]
# avx512bw: AVX-512 without VNNI; amx: AVX-512 VNNI and AMX-INT8 tiles for calls of many rows (the same bits as avx512)
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512bw": 3, "avx512": 4, "amx": 5}
PATH_NAMES = {v: k for k, v in PATHS.items()}

# GGML type ids the kernels take
Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, MXFP4 = 3, 6, 8, 12, 14, 39
TYPES = {"Q4_1": Q4_1, "Q5_0": Q5_0, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K, "MXFP4": MXFP4}
X16 = 256  # added to a type: its blocks repacked 16 outputs at a time (`gq_repack`; AVX2 / AVX-512 kernels)
REPACKABLE = (Q4_K, Q6_K, Q8_0, Q5_0, Q4_1, MXFP4)
BLOCK = {
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q6_K: (256, 210),  # type -> (elements,
    MXFP4: (32, 17),
    X16 + Q4_1: (32, 20),
    X16 + Q5_0: (32, 22),
    X16 + Q8_0: (32, 34),
    X16 + Q4_K: (256, 148),  # bytes/output)
    X16 + Q6_K: (256, 210),
    X16 + MXFP4: (32, 17),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None  # why there is no library, when there is none


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_signature() -> str:
    """CPU model + feature flags (Linux /proc/cpuinfo; elsewhere the platform strings)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def _cc_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def lib_path(cc: str, flags: list[str] | None = None) -> Path:
    h = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in SOURCES + HEADERS),
        _cc_version(cc).encode(),
        " ".join(flags or CFLAGS).encode(),
        _cpu_signature().encode(),
        platform.machine().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return home() / "kernels" / f"ggml_q-{h.hexdigest()[:20]}.so"


def _build(cc: str, dest: Path, flags: list[str]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.stem + ".", suffix=".tmp.so", dir=dest.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_any(cc: str) -> Path:
    """The library for this source, compiler and CPU: cached, else built; without OpenMP (one thread) where the
    compiler cannot link it (e.g. clang without libomp)."""
    serial = [f for f in CFLAGS if f != "-fopenmp"]
    for flags in (CFLAGS, serial):
        dest = lib_path(cc, flags)
        if dest.exists():
            return dest
    try:
        _build(cc, lib_path(cc, CFLAGS), CFLAGS)
        return lib_path(cc, CFLAGS)
    except (RuntimeError, OSError, subprocess.SubprocessError) as first:
        try:
            _build(cc, lib_path(cc, serial), serial)
        except (RuntimeError, OSError, subprocess.SubprocessError):
            raise first from None
        return lib_path(cc, serial)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.gq_matmul_parts.argtypes = [i32, p, p, p, i64, p, i64, p, i32, i32]
    lib.gq_matmul_parts.restype = i32
    lib.gq_dequantize.argtypes = [i32, p, i64, i64, i64, p, i32, i32]
    lib.gq_dequantize.restype = i32
    lib.gq_dequantize_t.argtypes = [i32, p, i64, i64, i64, p, i64, i32]
    lib.gq_dequantize_t.restype = i32
    lib.gq_repack.argtypes = [i32, p, i64, i64, p, i32]
    lib.gq_repack.restype = i32
    lib.gq_attention.argtypes = [
        p,
        i64,
        i64,
        i64,
        p,
        p,
        p,
        i64,
        i64,
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_float,
        p,
        p,
        i32,
        i32,
    ]
    lib.gq_attention.restype = i32
    lib.gq_rmsnorm.argtypes = [p, p, ctypes.c_float, i64, i64, p]
    lib.gq_rope.argtypes = [p, i64, p, p, i64, i64, i64, i64]
    lib.gq_silu_mul.argtypes = [p, i64, i64, p]
    lib.gq_gelu_mul.argtypes = [p, i64, i64, p]
    lib.gq_swiglu_limit.argtypes = [p, i64, i64, ctypes.c_float, ctypes.c_float, p]
    lib.gq_top2.argtypes = [p, i64, i64, i64, p, p]
    lib.gq_route.argtypes = [p, p, p, p, ctypes.c_float, p, i64, i64, i64, i64, i32, i32, p, p]
    lib.gq_delta_rule.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, p]
    lib.gq_gdn_inputs.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i32, p, p, p, p, p]
    lib.gq_gated_norm.argtypes = [p, p, p, ctypes.c_float, i64, i64, p]
    small = (
        lib.gq_rmsnorm,
        lib.gq_rope,
        lib.gq_silu_mul,
        lib.gq_gelu_mul,
        lib.gq_swiglu_limit,
        lib.gq_top2,
        lib.gq_route,
    )
    for f in small + (lib.gq_delta_rule, lib.gq_gdn_inputs, lib.gq_gated_norm):
        f.restype = i32
    lib.gq_decoder_layer.argtypes = [p, p, p, p, i32, i32]
    lib.gq_decoder_layer.restype = i32
    lib.gq_decoder_stack.argtypes = [p, i32, p, p, p, p, p, p, p, p, i32, i32]
    lib.gq_decoder_stack.restype = i32
    lib.gq_attention_half.argtypes = [p, p, p, p, p, i32, i32]
    lib.gq_attention_half.restype = i32
    lib.gq_moe_experts.argtypes = [p, p, i64, i64, p, p, p, i32, i32]
    lib.gq_moe_experts.restype = i32
    lib.gq_best_path.argtypes = []
    lib.gq_best_path.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None (after one warning) when it cannot be."""
    global _lib, _tried, build_error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("SPECDEC_KERNELS", "").lower() in ("0", "off", "none"):
                raise RuntimeError("disabled by SPECDEC_KERNELS")
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
            _lib = _declare(ctypes.CDLL(str(_build_any(cc))))
        except Exception as e:  # any failure: fall back, never crash
            build_error = f"{type(e).__name__}: {e}"
            if "SPECDEC_KERNELS" not in build_error:
                print(
                    f"specdec: GGUF CPU kernels unavailable ({build_error}); using dequantize + matmul", file=sys.stderr
                )
            _lib = None
        _tried = True
    return _lib


def _reset() -> None:
    """Forget the loaded library (tests: rebuild or re-read the environment on the next call)."""
    global _lib, _tried, build_error
    with _lock:
        _lib, _tried, build_error = None, False, None


def requested_path() -> int:
    name = os.environ.get("SPECDEC_KERNEL_PATH", "auto").lower()
    if name not in PATHS:
        warnings.warn(f"SPECDEC_KERNEL_PATH={name!r} unknown (choose {', '.join(PATHS)}); using auto")
        return 0
    return PATHS[name]


FAST_PREFILL_ROWS = 64  # with fast prefill: rows above which torch computes (a draft tree's size stays below)
_fast_prefill = False


def set_fast_prefill(on: bool) -> None:
    """Opt in (process-wide) to the fast prefill arithmetic, or back out: forwards of more than FAST_PREFILL_ROWS rows
    dequantize the GGUF weights (to bf16 where the CPU has native bf16) for torch's matmul, and a sequence's chunk of
    more rows than that takes torch's fused attention. Faster on some CPUs, but a token's logits then depend on how its
    prompt was chunked, batched or cached. Off by default: every row count runs the kernels, whose per-row
    arithmetic does not depend on the rows beside it (one arithmetic per token)."""
    global _fast_prefill
    _fast_prefill = bool(on)


def fast_prefill() -> bool:
    """Whether the fast prefill arithmetic is on (`set_fast_prefill`)."""
    return _fast_prefill


def kernels_take(rows: int) -> bool:
    """Whether a forward of `rows` rows (a sequence's rows, for attention) runs the kernels: always, but above
    FAST_PREFILL_ROWS with fast prefill on."""
    return not _fast_prefill or rows <= FAST_PREFILL_ROWS


def best_path() -> str:
    """The instruction set the kernels use on this CPU ('amx' (AVX-512 VNNI with AMX tiles), 'avx512' (with VNNI),
    'avx512bw' (without), 'avx2', 'scalar'), or 'none' without the library."""
    lib = library()
    if lib is None:
        return "none"
    best = lib.gq_best_path()
    want = requested_path()
    return PATH_NAMES[min(best, want) if want else best]


def describe() -> str:
    """What the GGUF kernels run on here, for stats and reports: 'kernel path amx|avx512|avx512bw|avx2|scalar', or
    'no kernels (WHY): dequantize + matmul'."""
    path = best_path()
    if path == "none":
        return f"no kernels ({build_error or 'library unavailable'}): dequantize + matmul"
    return f"kernel path {path}"


def runs_x16() -> bool:
    """Whether the kernels here run the x16 layout (AVX2 or AVX-512; not the scalar path)."""
    return best_path() in ("amx", "avx512", "avx512bw", "avx2")
