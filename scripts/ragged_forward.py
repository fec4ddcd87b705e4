"""What a ragged step costs: one target forward over several sequences' chunks of different lengths (as the
server's batched verification feeds it), padded to the longest chunk against one row per token (the C layers'
path, `ModelRunner.forward`), median ms of several forwards at the same positions (the static cache is
rewritten in place, so nothing moves between them).

    python scripts/ragged_forward.py                                  # chunks 17,9,13,14 / 17,3,5,2 / 5,2,3,1
    python scripts/ragged_forward.py --chunks 17,17,17,17 --context 400

Prints one line per chunk set: real rows, padded rows, ms padded, ms one row each.
One row each needs chunks of different lengths and every layer in C for the total rows (`Transformer.layers_in_c`);
where not, that column says so (the runner pads then).
"""

from __future__ import annotations

import argparse

import torch
from bench_kernels import timeit  # scripts/: median ms per call

from specdec.api import LLM
from specdec.runtime.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument(
        "--chunks",
        nargs="+",
        default=["17,9,13,14", "17,3,5,2", "5,2,3,1"],
        help="chunk sets, each comma-separated lengths (one per sequence)",
    )
    ap.add_argument("--context", type=int, default=400, help="tokens each sequence holds before the chunk")
    ap.add_argument("--repeats", type=int, default=7, help="timed forwards per figure (at least)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    sets = [[int(n) for n in s.split(",")] for s in args.chunks]
    llm = LLM(model=args.model, threads=args.threads, progress=False)
    model = llm.runner.model
    num_slots = max(len(s) for s in sets)
    runner = ModelRunner(model, num_slots=num_slots, context=args.context + 64)
    gen = torch.Generator().manual_seed(0)
    for slot in range(num_slots):
        runner.prefill(torch.randint(0, 1000, (args.context,), generator=gen).tolist(), slot)
    real_in_c = type(model).layers_in_c
    for lens in sets:
        chunks = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lens]
        starts, slots = [args.context] * len(lens), list(range(len(lens)))

        def step():
            return runner.forward(chunks, starts, slots)

        flat = timeit(step, min_calls=args.repeats) if len(set(lens)) > 1 and model.layers_in_c(sum(lens)) else None
        type(model).layers_in_c = lambda self, rows: False
        try:
            padded = timeit(step, min_calls=args.repeats)
        finally:
            type(model).layers_in_c = real_in_c
        one_row = "n/a (equal lengths, or not every layer in C)" if flat is None else f"{flat:.1f}"
        print(
            f"chunks {lens}: {sum(lens)} rows, {len(lens) * max(lens)} padded; padded {padded:.1f} ms, "
            f"one row each {one_row} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
