"""One EAGLE-3 head step's matrices at one row (q/k/v, o, gate/up, down, LM head; fc aside), fp32 against Q8_0 blocks
through the GGUF kernels (`runtime.quant.q8_0_`, what `--spec-head-quant auto` runs). Shapes: the shipped
qwen2.5-coder-1.5b head (hidden 1536, MLP 2048, draft vocabulary 8192).

    python scripts/bench_head_step.py [--threads 2] [--reps 300]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from specdec.runtime.quant import q8_0_

SHAPES = {
    "qkv": (3072, 2048),
    "o": (1536, 1536),
    "gate_up": (1536, 4096),
    "down": (2048, 1536),
    "lm_head": (1536, 8192),
}


def step_ms(mats: nn.ModuleDict, reps: int) -> float:
    """Median of 5 timings of `reps` passes over every matrix at one row, in ms per pass."""
    xs = {n: torch.randn(1, SHAPES[n][0]) for n in mats}
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            for n, m in mats.items():
                m(xs[n])
        times.append((time.perf_counter() - t) / reps * 1e3)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fp32 = nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, (i, o) in SHAPES.items()})
    q8 = q8_0_(copy.deepcopy(fp32))
    for name, mats in (("fp32", fp32), ("q8_0", q8)):
        step_ms(mats, 20)
        print(f"{name}: {step_ms(mats, args.reps):.2f} ms per head step ({args.threads} threads)")


if __name__ == "__main__":
    main()
