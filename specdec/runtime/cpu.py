"""What this CPU computes natively, read at run time (never assumed, never cached across machines)."""
from __future__ import annotations

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
