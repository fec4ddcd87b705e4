#!/usr/bin/env python
"""Micro-benchmark: one projection (default the 1.5B target's MLP shapes 1536x8960 and 8960x1536),
ms per call (median of many) at several row counts, for the GGUF block kernels (each type, each
instruction-set path the CPU has on the file's layout and on the x16 layout the loader repacks to on AVX2 and
AVX-512) and
torch's candidates: bf16 and fp32 matmul of the dequantized
weight, `_weight_int8pack_mm` (int8 weight-only) and FBGEMM dynamic int8 (quantize_dynamic).
Prints the CPU flags, the measured read bandwidth and one Markdown table per shape; then a table for the logit
rows' best token and lead (`small_ops.top2`, which greedy decoding, verification and every commit call) against
torch's argmax + topk(2) (`--vocab`, default Qwen2.5's 151936; 0 skips it).

    python scripts/bench_kernels.py [--threads 2] [--rows 1,2,4,8,16,64] [--shapes 1536x8960,8960x1536] [--vocab V]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.runtime import kernels as K  # noqa: E402
from specdec.runtime.gguf_linear import GGUFLinear, for_this_cpu  # noqa: E402


def timeit(fn, min_time: float = 0.25, min_calls: int = 7, max_calls: int = 400) -> float:
    """Median ms per call."""
    fn()
    fn()
    times, t_end = [], time.perf_counter() + min_time
    while len(times) < min_calls or (time.perf_counter() < t_end and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_interleaved(fns: list, rounds: int = 25, budget_s: float = 1.5) -> list[tuple[float, float]]:
    """(median, min) ms per call of each fn, called in turns (one call of each per round), so that load from
    other processes, which comes and goes over seconds on a shared machine, hits every candidate alike. A
    candidate stops once it has used `budget_s` (at least 3 calls)."""
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    spent = [0.0] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            if len(times[i]) >= 3 and spent[i] > budget_s:
                continue
            t0 = time.perf_counter()
            f()
            dt = time.perf_counter() - t0
            times[i].append(dt)
            spent[i] += dt
    return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def random_blocks(qtype: int, out: int, inp: int, rng) -> np.ndarray:
    """Valid blocks: gguf's quantizer where it has one (Q8_0, Q5_0), else random bytes with sane fp16 scales."""
    import gguf

    be, bb = K.BLOCK[qtype]
    if qtype in (K.Q8_0, K.Q5_0):
        w = (rng.standard_normal((out, inp)) * 0.02).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).reshape(out, -1)
    nb = out * inp // be
    b = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    half = (rng.uniform(0.5, 1.5, (nb, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == K.Q4_K:
        b[:, 0:2] = half
        b[:, 2:4] = half
    else:
        b[:, 208:210] = half
    return b.reshape(out, -1)


def read_bandwidth() -> float:
    """GB/s of a streaming read (torch sum over 512 MB of int32... float32), all threads."""
    t = torch.ones(128 << 20, dtype=torch.float32)
    ms = timeit(lambda: t.sum(), min_time=0.5, min_calls=5, max_calls=30)
    return t.numel() * 4 / ms / 1e6


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    keep = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return f"{model}; {' '.join(keep)}"


COLD_BYTES = 96 << 20  # each candidate cycles through copies of its weight totalling this (> the L3 cache)


def copies(make, nbytes: int, cold: bool) -> list:
    return [make() for _ in range(max(1, -(-COLD_BYTES // nbytes)) if cold else 1)]


def bench_shape(
    out: int, inp: int, rows_list: list[int], paths: list[str], types: list[str], rng, cold: bool = True
) -> list[tuple]:
    """Each candidate cycles through copies of its weight (`cold`: weights come from DRAM, as in a model
    far larger than the caches, not from L3 where one 1536x8960 projection would otherwise stay)."""
    w = torch.randn(out, inp) * 0.02
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)

    def dyn_module():
        lin = torch.nn.Linear(inp, out, bias=False)
        lin.weight.data.copy_(w)
        return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)

    xs = {r: torch.randn(r, inp) for r in rows_list}
    xb = {r: x.to(torch.bfloat16) for r, x in xs.items()}

    cands = []

    def row(name, items, fn, nbytes=None):
        state = {"i": 0}

        def call(r):
            it = items[state["i"] % len(items)]
            state["i"] += 1
            return fn(it, r)

        cands.append((name, call, nbytes))

    for t in types:
        blocks = torch.from_numpy(random_blocks(K.TYPES[t], out, inp, rng))
        lays = copies(lambda: GGUFLinear.from_blocks(blocks.clone(), t, (out, inp)), blocks.numel(), cold)
        for p in (p for p in paths if p != "avx512bw"):  # the file's layout runs the AVX2 row kernels there
            pid = K.PATHS[p]
            row(f"GGUF {t} kernel ({p})", lays, lambda lay, r, pid=pid: lay._kernel(xs[r], pid), blocks.numel())
        x16 = [for_this_cpu(lay) for lay in lays]  # the layout the loader picks here (x16 on AVX-512)
        for p in (p for p in paths if p != "scalar" and x16[0] is not lays[0]):
            row(
                f"GGUF {t} x16 kernel ({p}{', the default here' if p == K.best_path() else ''})",
                x16,
                lambda lay, r, pid=K.PATHS[p]: lay._kernel(xs[r], pid),
                x16[0].qweight.numel(),
            )
        row(f"GGUF {t} dequant+bf16 matmul", lays[:1], lambda lay, r: lay._dequant_matmul(xb[r]))
    row(
        "bf16 matmul (dense)",
        copies(lambda: w.to(torch.bfloat16), w.numel() * 2, cold),
        lambda wb, r: F.linear(xb[r], wb),
        w.numel() * 2,
    )
    row(
        "fp32 matmul (dense)",
        copies(lambda: w.clone(), w.numel() * 4, cold),
        lambda wf, r: F.linear(xs[r], wf),
        w.numel() * 4,
    )
    row(
        "int8 weight-only `_weight_int8pack_mm` (fp32 x)",
        copies(lambda: w8.clone(), w8.numel(), cold),
        lambda q, r: torch.ops.aten._weight_int8pack_mm(xs[r], q, scale),
        w8.numel(),
    )
    row(
        "FBGEMM dynamic int8 (`quantize_dynamic`)",
        copies(dyn_module, w8.numel(), cold),
        lambda m, r: m(xs[r]),
        w8.numel(),
    )
    cells = {name: [] for name, _, _ in cands}
    for r in rows_list:
        res = time_interleaved([lambda call=call, r=r: call(r) for _, call, _ in cands])
        for (name, _, _), mm in zip(cands, res):
            cells[name].append(mm)
        print(f"  rows {r} done", file=sys.stderr, flush=True)
    return [(name, cells[name], nbytes) for name, _, nbytes in cands]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--shapes", default="1536x8960,8960x1536", help="OUTxIN (torch weight shape)")
    ap.add_argument("--types", default="Q4_K,Q5_0,Q6_K,Q8_0")
    ap.add_argument("--paths", default="", help="kernel paths to time (default: every one the CPU has)")
    ap.add_argument("--warm", action="store_true", help="one weight copy per candidate (stays in cache if small)")
    ap.add_argument("--vocab", type=int, default=151936, help="logit row width for the top2 table (0: none)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows_list = [int(r) for r in a.rows.split(",")]
    best = K.best_path()
    if a.paths:
        paths = a.paths.split(",")
    else:
        order = ["amx", "avx512", "avx512bw", "avx2", "scalar"]
        paths = order[order.index(best) :] if best in order else []
        paths = [p for p in paths if p != "scalar"] or paths  # scalar is slow; ask for it with --paths
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_flags()}")
    print(
        f"torch {torch.__version__}, {a.threads} threads; kernel library: "
        f"{'built, best path ' + best if best != 'none' else 'unavailable (' + str(K.build_error) + ')'}"
    )
    bw = read_bandwidth()
    print(f"streaming read bandwidth (torch sum over 512 MB): {bw:.1f} GB/s\n")
    for shape in a.shapes.split(","):
        out, inp = (int(v) for v in shape.split("x"))
        table = bench_shape(out, inp, rows_list, paths, a.types.split(","), rng, cold=not a.warm)
        for k, what in ((0, "median"), (1, "min")):
            print(
                f"### {out}x{inp} (out x in), ms per call, {what} "
                f"({'warm' if a.warm else 'cold: weights from DRAM'}, candidates interleaved)\n"
            )
            print("| kernel | " + " | ".join(str(r) for r in rows_list) + " | GB/s at 1 row |")
            print("|---|" + "---|" * (len(rows_list) + 1))
            for name, cells, nbytes in table:
                c = [mm[k] for mm in cells]
                gbs = f"{nbytes / c[0] / 1e6:.1f}" if nbytes and rows_list[0] == 1 else ""
                print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in c) + f" | {gbs} |")
            print()
    if a.vocab:
        bench_top2(a.vocab, rows_list)


def bench_top2(vocab: int, rows_list: list[int]) -> None:
    """ms per call, median, candidates interleaved: small_ops.top2 against torch's argmax + topk(2)."""
    from specdec.runtime.small_ops import top2

    logits = [torch.randn(r, vocab) for r in rows_list]
    cands = [
        ("small_ops.top2 (C)", top2),
        ("torch argmax + topk(2)", lambda x: (x.argmax(-1).tolist(), x.topk(2, dim=-1).values.tolist())),
    ]
    res = [time_interleaved([lambda x=x, f=f: f(x) for _, f in cands]) for x in logits]
    print(f"### best token and lead of logit rows [rows, {vocab}], ms per call, median (candidates interleaved)\n")
    print("| call | " + " | ".join(str(r) for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    for i, (name, _) in enumerate(cands):
        print(f"| {name} | " + " | ".join(f"{r[i][0]:.3f}" for r in res) + " |")
    print()


if __name__ == "__main__":
    main()
