"""Sizes and bandwidths as users write them ('24GiB', '16G', '936GB/s') and as the plan prints them."""

from __future__ import annotations

import math
import re

from specdec.errors import SpecdecError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_NUM = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size", default_unit: str = "gib") -> int:
    """'24GiB' -> bytes. A bare number is in `default_unit` (GiB). Zero, negative or junk: SpecdecError."""
    s = str(text)
    m = _NUM.match(s)
    unit = (m.group(2).lower() if m else "") or default_unit
    if not m or unit not in _UNITS:
        raise SpecdecError(f"{what}: cannot read {s!r} as a size (e.g. 24GiB, 16GB, 512MiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise SpecdecError(f"{what} must be a positive size, got {s!r}")
    return int(value)


def parse_bandwidth(text: str | int | float, what: str = "bandwidth") -> float:
    """'936GB/s' or '936' (GB/s) -> bytes per second."""
    s = str(text).strip()
    body = s[:-2] if s.lower().endswith("/s") else s
    m = _NUM.match(body)
    unit = (m.group(2).lower() if m else "") or "gb"
    if not m or unit not in _UNITS:
        raise SpecdecError(f"{what}: cannot read {s!r} as a bandwidth (e.g. 936GB/s, 64, 25GB/s)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise SpecdecError(f"{what} must be a positive bandwidth, got {s!r}")
    return value


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, 3 significant figures: 1.04 GiB, 119 MiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def fmt_bw(bps: float) -> str:
    return f"{bps / 1e9:.4g} GB/s"
