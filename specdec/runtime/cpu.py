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


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library (raises OSError where it cannot be loaded)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_free_memory() -> None:
    """Hand freed heap back to the OS (glibc's `malloc_trim`; elsewhere nothing). glibc keeps freed blocks below its
    grown mmap threshold resident: after quantizing a draft model's weights 0.5-1 GB (docs/planning.md), and in a
    server the high-water mark of its largest batches until it is next idle."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


LARGE_BLOCK = 256 << 20  # bytes: glibc serves and keeps blocks up to this size from its heap (`keep_large_blocks`)


def keep_large_blocks() -> None:
    """Let glibc serve blocks up to LARGE_BLOCK from its heap and keep them when freed (M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD; elsewhere nothing). By default a block over 32 MB is mapped at malloc and unmapped at free, so
    each prefill chunk's largest outputs (512 rows x 17920 fp32 of the 1.5B's gate/up: 37 MB) came as fresh pages,
    each zeroed at its first touch: a 512-row forward of the 1.5B took 2.42 s instead of 2.03 (Zen 5, 2 threads).
    Freed heap still goes back to the OS at `release_free_memory` (the server when idle)."""
    try:
        _libc().mallopt(-3, LARGE_BLOCK)  # M_MMAP_THRESHOLD
        _libc().mallopt(-1, LARGE_BLOCK)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def release_openmp_workers() -> None:
    """End the calling thread's idle OpenMP worker threads (`omp_pause_resource_all(omp_pause_hard)` of libgomp,
    torch's copy; they come back at the thread's next parallel region; elsewhere nothing). libgomp keeps a pool of
    workers for every thread that ran a parallel region until that thread ends, and once it manages more threads
    than the process has CPUs it hardly spins between regions, so each region wakes its workers through the kernel.
    Call it where a thread's compute is done for a while (it loaded the model; another thread decodes): such an idle
    pool made each 1.5B decode forward in the server's engine thread 66 ms instead of 53."""
    try:
        ctypes.CDLL("libgomp.so.1").omp_pause_resource_all(2)  # 2: omp_pause_hard
    except (OSError, AttributeError):  # another OpenMP runtime or none: nothing to do
        pass
