"""Where one forward of the target goes: each GGUF kernel call (by matrix shape and type) and the attention, timed
in place, the rest ("everything else": norms, rotary, KV writes, residuals, Python) by difference. The forward is
timed as the engine runs it (each decoder layer one C call, `runtime/layer_kernel.py`) and, for the breakdown, with
the layers' Python path (the same arithmetic, one call per operation).

    python scripts/profile_step.py                      # default target, 500-token context, 1 and 8 rows
    python scripts/profile_step.py -m qwen2.5-coder-0.5b --context 1000 --rows 1,4,16
    python scripts/profile_step.py --rows 512 --context 100 --last-only   # a prefill chunk: logits of its last row
    python scripts/profile_step.py --rows 1 --other-thread [--keep-workers]  # forwards on a thread of their own
    python scripts/profile_step.py -m MOE.gguf --rows 1,2,3,5 --routing uniform  # each row's experts drawn at random

For a model with recurrent layers (Qwen3.5) it also times the rollback after each verify of R rows that keeps m of
them (the held rows replayed in every linear-attention layer) and prints the memory a slot keeps for it.

`--other-thread` runs the forwards on a new thread after the main thread (which loaded the model and prefilled)
ends its OpenMP workers, as the server's engine thread runs; `--keep-workers` leaves them
(as the engine thread did before it ended them).

Above the kernels' row limit the projections dequantize and multiply in torch (`GGUFLinear._dequant_matmul`, fused
parts in `GGUFConcatLinear._dequant_matmul`): timed as "dequantize + matmul" per shape.

A mixture of experts prints the distinct experts a layer ran per forward (counted in the instrumented forwards,
whose router runs through `MoE.route`). Random weights route nearly every row to the same experts, so `--routing
uniform` draws each row's experts uniformly at random instead (a fixed seed, the router's weights kept): the most
spread routing a verify step can meet, where a real model's lies between the two. Its forwards route in Python
between two C calls a layer, since the C router would choose the model's experts.

Prints one Markdown table per row count."""

from __future__ import annotations

import argparse
import collections
import threading
import time
from pathlib import Path

import torch

import specdec.models.transformer as T
from specdec.api import LLM
from specdec.runtime import gguf_linear as GL
from specdec.runtime.cpu import release_openmp_workers
from specdec.runtime.layer_kernel import LayerKernel, LayerStack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=500, help="tokens in the KV cache before the timed forwards")
    ap.add_argument("--last-only", action="store_true", help="the LM head on the last row only (as prefill runs it)")
    ap.add_argument("--rows", default="1,8", help="query rows per forward (1 = decode, more = verification)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--forwards", type=int, default=30, help="timed forwards per row count (the median is shown)")
    ap.add_argument("--other-thread", action="store_true", help="the forwards on a new thread (as the server's)")
    ap.add_argument(
        "--keep-workers",
        action="store_true",
        help="with --other-thread: the main thread's OpenMP workers kept (not `release_openmp_workers`)",
    )
    ap.add_argument(
        "--routing",
        choices=["model", "uniform"],
        default="model",
        help="a mixture of experts: the router's choices, or each row's experts drawn uniformly at random",
    )
    a = ap.parse_args()
    spread = count_experts(a.routing == "uniform")
    llm = LLM(a.model, spec_type="none", threads=a.threads, progress=False)
    runner = llm.runner
    text = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    ids = (llm.tokenizer.encode(text) * 8)[: a.context]
    runner.prefill(ids, 0)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    kernel, attention = GL.kernel_matmul, T.attention

    def timed_kernel(parts, x2, path=None):
        t0 = time.perf_counter()
        y = kernel(parts, x2, path)
        name = "+".join(p.type_name for p in parts) + f" {sum(p.out_features for p in parts)}x{parts[0].in_features}"
        spent[name] += time.perf_counter() - t0
        calls[name] += 1
        return y

    def timed_attention(*args):
        t0 = time.perf_counter()
        y = attention(*args)
        spent["attention"] += time.perf_counter() - t0
        calls["attention"] += 1
        return y

    def timed_dequant(cls):
        """`cls._dequant_matmul` timed per shape (where `cls` has one)"""
        inner = getattr(cls, "_dequant_matmul", None)

        def timed(self, x2):
            t0 = time.perf_counter()
            y = inner(self, x2)
            parts = getattr(self, "parts", [self])
            name = "+".join(p.type_name for p in parts) + f" {self.out_features}x{self.in_features} dequantize + matmul"
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
            return y

        return inner, timed

    dequants = {
        cls: timed_dequant(cls) for cls in (GL.GGUFLinear, GL.GGUFConcatLinear) if hasattr(cls, "_dequant_matmul")
    }
    c_layers, c_stack = LayerKernel.run, LayerStack.run

    def median_forward(rows: int, n: int, instrument: bool) -> float:
        GL.kernel_matmul, T.attention = (timed_kernel, timed_attention) if instrument else (kernel, attention)
        LayerKernel.run, LayerStack.run = ((lambda *args: None),) * 2 if instrument else (c_layers, c_stack)
        for cls, (inner, timed) in dequants.items():
            cls._dequant_matmul = timed if instrument else inner
        spent.clear()
        calls.clear()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            runner.forward([(ids * rows)[:rows]], [len(ids)], [0], last_only=a.last_only)  # the text's tokens
            ts.append(time.perf_counter() - t0)
        GL.kernel_matmul, T.attention, LayerKernel.run, LayerStack.run = kernel, attention, c_layers, c_stack
        for cls, (inner, _) in dequants.items():
            cls._dequant_matmul = inner
        return sorted(ts)[n // 2]

    print(
        f"{a.model}: {llm.quant_info}; context {len(ids)}, {a.threads} threads, medians of {a.forwards} forwards"
        + (
            f"; on another thread, main's OpenMP workers {'kept' if a.keep_workers else 'ended'}"
            if a.other_thread
            else ""
        )
    )
    if runner.recurrent:
        replays(runner, len(ids), [int(r) for r in a.rows.split(",")], a.forwards)
    if not a.other_thread:
        report(a, median_forward, spent, calls, spread)
        return
    if not a.keep_workers:
        release_openmp_workers()
    t = threading.Thread(target=report, args=(a, median_forward, spent, calls, spread))
    t.start()
    t.join()


def count_experts(uniform: bool) -> list[int]:
    """Distinct experts per MoE layer call, appended to the list returned (`MoE.route` wrapped); `uniform`: each
    row's experts drawn uniformly at random, distinct within the row."""
    route, gen = T.MoE.route, torch.Generator().manual_seed(0)
    spread: list[int] = []
    if uniform:  # no C router in the layers: they call `MoE.route` between their two C calls
        T.MoE.kernel_router = lambda self: None

    def counted(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = route(self, rows)  # [N, k] each
        if uniform:
            chosen = torch.rand(len(rows), self.gate.out_features, generator=gen).argsort(dim=-1)[:, : chosen.shape[1]]
        spread.append(len(chosen.unique()))
        return weights, chosen

    T.MoE.route = counted
    return spread


def replays(runner, start: int, rows: list[int], n: int) -> None:
    """A model with recurrent layers (Qwen3.5): after a verify of R rows, a rollback that keeps m of them replays m
    held rows from the settled state in every linear-attention layer (`runtime/recurrent.py`); its median time, and
    the memory a slot keeps per layer."""
    from specdec.runtime.recurrent import replay

    layers = runner.cache.states.layers.values()
    print("\n| verify rows | rollback keeping m rows: ms (m = 1, ..., R - 1) |\n|---|---|")
    for r in (r for r in rows if r > 1):
        runner.forward([[100] * r], [start], [0])
        held = [(s.base, s.rows) for s in (layer.slots[0] for layer in layers)]
        times = []
        for m in range(1, r):
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                for base, kept in held:
                    replay(base, kept.head(m))
                ts.append(time.perf_counter() - t0)
            times.append(sorted(ts)[n // 2] * 1e3)
        print(f"| {r} | {', '.join(f'{t:.2f}' for t in times)} |")
    base, kept = held[0]
    state = sum(t.numel() * 4 for t in (base.conv, base.ssm))
    row = sum(t[0].numel() * 4 for t in kept.parts())
    print(
        f"\n{len(held)} linear layers; per slot and layer 2 states of {state / 2**20:.2f} MiB, {row / 1024:.1f} KiB"
        " a held row"
    )


def report(a: argparse.Namespace, median_forward, spent: dict, calls: collections.Counter, spread: list) -> None:
    """One Markdown table per row count: the forward's median, and where an instrumented forward's time goes."""
    for rows in (int(r) for r in a.rows.split(",")):
        median_forward(rows, 3, False)
        plain = median_forward(rows, a.forwards, False)
        spread.clear()
        inst = median_forward(rows, a.forwards, True)
        experts = f"; {sum(spread) / len(spread):.2f} experts a layer" if spread else ""
        print(
            f"\n### {rows} row(s): forward {plain * 1e3:.1f} ms{experts}; with the layers' Python path "
            f"{inst * 1e3:.1f} (instrumented)\n"
        )
        print("| part | ms per forward | calls per forward |\n|---|---|---|")
        total = 0.0
        for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
            total += s / a.forwards
            print(f"| {name} | {s / a.forwards * 1e3:.2f} | {calls[name] // a.forwards} |")
        print(f"| everything else | {(inst - total) * 1e3:.2f} | |")


if __name__ == "__main__":
    main()
