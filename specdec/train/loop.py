"""What head trainers share: conversations cut and packed into batches, the learning-rate schedule, the
autocast choice, atomic checkpoint files."""
from __future__ import annotations

import math
import os
import random
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.runtime.cpu import has_bf16


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of conversation `conv` (an index into a `FeatureCache` view)."""
    conv: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


Row = list[Segment]    # segments laid one after another in one batch row
Batch = list[Row]


def cut(conv: int, length: int, max_len: int) -> list[Segment]:
    """A conversation of `length` tokens as pieces of at most `max_len` tokens."""
    return [Segment(conv, a, min(a + max_len, length)) for a in range(0, length, max_len)]


def pack(segments: list[Segment], max_len: int, rows_per_batch: int, seed: int | None) -> list[Batch]:
    """Segments (shuffled with `seed`; None keeps their order) laid into rows of at most `max_len` tokens (a
    segment goes to the current row when it fits, else opens a new one), `rows_per_batch` rows per batch."""
    order = list(segments)
    if seed is not None:
        random.Random(seed).shuffle(order)
    rows: list[Row] = []
    for s in order:
        if rows and sum(map(len, rows[-1])) + len(s) <= max_len:
            rows[-1].append(s)
        else:
            rows.append([s])
    return [rows[i:i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


def learning_rate(progress: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first `warmup` share of training, then cosine to zero; progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """bf16 | fp32 | auto (bf16 on a GPU or a CPU with native bf16 instructions) -> the autocast dtype (None =
    plain fp32)."""
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" or (device.type == "cpu" and has_bf16()) else "fp32"
    return torch.bfloat16 if choice == "bf16" else None


def save_atomic(obj: object, path: Path) -> None:
    """torch.save to a temporary file, then rename over `path` (a killed run leaves the old file whole)."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    torch.save(obj, tmp)
    os.replace(tmp, path)
