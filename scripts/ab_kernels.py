"""Two builds of the kernel library timed against each other in one process, alternating pass by pass, so that the
host's drift (other tenants, memory bandwidth) falls on both alike; the ratio of medians and the median of pairwise
ratios are printed, and whether the two gave the same bits.

    git worktree add /tmp/old HEAD~1                      # the "before" code
    OLD=$(cd /tmp/old && PYTHONPATH=/tmp/old \
        python -c "from specdec.runtime import kernels as K; print(K.library()._name)")
    python scripts/ab_kernels.py $OLD --rows 1,4,16       # projections, weights from DRAM (copies beyond L3)
    python scripts/ab_kernels.py $OLD --model --rows 1,8  # whole forwards of the default target (decode, verify)
    python scripts/ab_kernels.py NEW.so --model --old-without-stack  # the decoder stack in one C call vs per layer

The working tree's library is "new" (built at first use, keyed by its sources)."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_kernels import random_blocks

from specdec.runtime import kernels as K
from specdec.runtime.gguf_linear import GGUFLinear, for_this_cpu, matmul_args

SHAPES = "Q4_K:17920x1536,Q6_K:1536x8960,Q4_K:1536x1536"  # gate/up, down, o_proj of the 1.5B
COLD_BYTES = 240 << 20


def load(path: str) -> ctypes.CDLL:
    """A library build, declared as `kernels._declare` does; an older build without gq_decoder_stack (declared
    last but one) gets the rest declared."""
    lib = ctypes.CDLL(path)
    try:
        return K._declare(lib)
    except AttributeError:
        lib.gq_best_path.restype = ctypes.c_int
        return lib


def alternate(libs: dict, passes: int, run) -> dict[str, list[float]]:
    """Seconds per pass for each library, the order flipped every pass; run(lib) does one pass."""
    times: dict[str, list[float]] = {name: [] for name in libs}
    for i in range(passes):
        for name in list(libs) if i % 2 == 0 else list(libs)[::-1]:
            t0 = time.perf_counter()
            run(libs[name])
            times[name].append(time.perf_counter() - t0)
    return times


def ratios(times: dict[str, list[float]]) -> str:
    old, new = times["old"], times["new"]
    return (
        f"new/old {statistics.median(new) / statistics.median(old):.3f} "
        f"(pairwise {statistics.median([n / o for n, o in zip(new, old)]):.3f})"
    )


def projections(libs: dict, rows: int, threads: int, passes: int, shapes: str) -> None:
    rng = np.random.default_rng(0)
    for spec in shapes.split(","):
        qtype, shape = spec.split(":")
        out, inp = map(int, shape.split("x"))
        blocks = torch.from_numpy(random_blocks(K.TYPES[qtype], out, inp, rng))
        first = for_this_cpu(GGUFLinear.from_blocks(blocks.clone(), qtype, (out, inp)))
        n = max(1, COLD_BYTES // first.qweight.numel())
        lays = [first] + [for_this_cpu(GGUFLinear.from_blocks(blocks.clone(), qtype, (out, inp))) for _ in range(n - 1)]
        args, x = [matmul_args([lay]) for lay in lays], torch.randn(rows, inp)
        ys = {}

        def run(lib):
            y = torch.empty(rows, out)
            for a in args:
                lib.gq_matmul_parts(*a[:-1], inp, x.data_ptr(), rows, y.data_ptr(), threads, K.requested_path())
            ys[id(lib)] = y

        times = alternate(libs, passes, run)
        nbytes = sum(lay.qweight.numel() for lay in lays)
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        same = torch.equal(*ys.values())
        print(f"| {qtype} {out}x{inp} | {rows} | {gbs['old']:.1f} | {gbs['new']:.1f} | {ratios(times)} | {same} |")


def forwards(libs: dict, rows_list: list[int], passes: int, model: str, threads: int, old_without_stack: bool) -> None:
    """5 forwards of `rows` rows per pass over a 200-token context (each writes the same cache rows). The decoder
    stack in one call (`LayerStack`) where both libraries have it, and not on the old side with old_without_stack."""
    from specdec.api import LLM
    from specdec.runtime.layer_kernel import LayerStack

    stack_run = LayerStack.run
    no_stack = not all(hasattr(lib, "gq_decoder_stack") for lib in libs.values())
    if no_stack:
        print("(the old library has no gq_decoder_stack: both sides run the layers one call each)")
    llm = LLM(model, spec_type="none", threads=threads, progress=False)
    runner = llm.runner
    ids = llm.tokenizer.encode(Path(__file__).resolve().parent.parent.joinpath("README.md").read_text())[:200]
    runner.prefill(ids, 0)
    for rows in rows_list:
        logits = {}

        def run(lib):
            K._lib = lib  # the library every kernel call reads
            off = no_stack or (old_without_stack and lib is libs["old"])
            LayerStack.run = (lambda self, *args: None) if off else stack_run
            for j in range(5):
                logits[id(lib)] = runner.forward([[100 + j] * rows], [len(ids)], [0])[0]

        times = alternate(libs, passes, run)
        ms = {k: statistics.median(v) / 5 * 1e3 for k, v in times.items()}
        same = torch.equal(*logits.values())
        print(f"| {model} | {rows} | {ms['old']:.2f} ms | {ms['new']:.2f} ms | {ratios(times)} | {same} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the other build of the library (.so), e.g. from a git worktree")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--shapes", default=SHAPES, help="TYPE:OUTxIN,...")
    ap.add_argument("--model", nargs="?", const="qwen2.5-coder-1.5b", help="time whole forwards of this model")
    ap.add_argument(
        "--old-without-stack",
        action="store_true",
        help="with --model: the old side runs the layers one "
        "call each (give the working tree's own library as OLD to time the stack alone)",
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    libs = {"old": load(a.old), "new": K.library()}
    what = "forward, median ms" if a.model else "projection, median GB/s"
    print(f"| {what} | rows | old | new | time ratio | same bits |\n|---|---|---|---|---|---|")
    rows_list = [int(r) for r in a.rows.split(",")]
    if a.model:
        forwards(libs, rows_list, a.passes, a.model, a.threads, a.old_without_stack)
    for rows in [] if a.model else rows_list:
        projections(libs, rows, a.threads, a.passes, a.shapes)


if __name__ == "__main__":
    main()
