"""What this CPU computes natively, read at run time (never assumed, never cached across machines), and handing
freed heap back to the OS."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(f for ln in text.splitlines() if ln.startswith("flags") for f in ln.split(":", 1)[1].split())


def has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX-BF16): bf16 matmuls run faster than fp32 ones."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def release_free_memory() -> None:
    """Hand freed heap back to the OS (glibc's `malloc_trim`; elsewhere nothing). glibc keeps freed blocks below its
    grown mmap threshold resident: after quantizing a draft model's weights 0.5-1 GB (docs/planning.md), and in a
    server the high-water mark of its largest batches until it is next idle."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
