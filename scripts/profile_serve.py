#!/usr/bin/env python
"""Where a `bench serve` level's time goes, per mode: the same in-process server and clients as
`specdec bench serve` (default pair, default spec type), and for each mode the engine thread's seconds in prefill,
in decode steps, in the target forwards inside them and in everything else a step does (drafting, verification,
commits, the controller), with steps and drafted tokens, and CPU seconds: the engine thread's own and the whole
process's (the engine's OpenMP worker, the HTTP server and the clients besides); `--profile N` adds cProfile's top
N functions of the engine thread by cumulative and by own time.

    python scripts/profile_serve.py [--concurrency 8] [--modes off,auto,off,auto] [--requests 16] [--profile 40]
        [--workload docs/bench/code-edit.jsonl] [--spec-type suffix-tree] [--explore-load 16]

After each mode it prints, for the load controller's steps (auto), each load bucket and arm's steps, seconds, tokens
per second, drafted tokens and tokens per sequence-step, then the engine's cost model: target forward seconds by
tokens, each drafter's (or chain member's) seconds per drafted token and per token of catch-up, and its acceptance
per draft position.
`--explore-load N` lets the load controller try speculation before it knows anything about it at loads up to N
(engine/load_control.py's EXPLORE_LOAD, 2: a level whose load starts above it never drafts).

Modes are run in the order given (repeat one to see run-to-run noise); one load of the models serves them all.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.api import LLM  # noqa: E402
from specdec.bench import serve_bench as sb  # noqa: E402
from specdec.bench.workloads import load_workload  # noqa: E402
from specdec.drafters import DEFAULT_WITH_DRAFT_MODEL  # noqa: E402
from specdec.engine import load_control  # noqa: E402
from specdec.engine.adaptive import CostModel  # noqa: E402
from specdec.engine.scheduler import Scheduler  # noqa: E402


def process_cpu() -> float:
    """CPU seconds this process has used (user + system, every thread, ended ones included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--modes", default="off,auto,off,auto")
    ap.add_argument("--requests", type=int, help="conversations per mode (default 2 x concurrency)")
    ap.add_argument("--workload", default="docs/bench/code-edit.jsonl")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions per mode")
    ap.add_argument("--spec-type", default=DEFAULT_WITH_DRAFT_MODEL)
    ap.add_argument("--explore-load", type=int, help="override the load controller's EXPLORE_LOAD")
    a = ap.parse_args()
    if a.explore_load is not None:
        load_control.EXPLORE_LOAD = a.explore_load
    llm = LLM(spec_type=a.spec_type, parallel=a.concurrency)
    convs = [
        sb.Conversation(list(p.turns), p.limit(None) if p.max_tokens else sb.SERVE_MAX_TOKENS)
        for p in load_workload(a.workload)
    ]
    forward = {"s": 0.0}
    step = llm.engine.step

    def timed_step(seqs, cap=None, light=False):
        info = step(seqs, cap, light)
        forward["s"] += info.forward_s
        return info

    llm.engine.step = timed_step
    last: dict = {}  # the latest level's scheduler, its engine thread's CPU seconds and profile
    loop = Scheduler._loop

    def measured_loop(self):
        pr = cProfile.Profile() if a.profile else None
        last.update(scheduler=self, profile=pr)
        t = time.thread_time()
        if pr:
            pr.enable()
        try:
            loop(self)
        finally:
            if pr:
                pr.disable()
            last["cpu"] = time.thread_time() - t

    Scheduler._loop = measured_loop
    arms: dict = {}  # (bucket, arm) -> [steps, seconds, committed, drafted, sequence-steps] of the current mode
    observe = load_control.LoadController.observe

    def counted_observe(self, arm, info, load=None):
        key = (load_control.bucket(load or info.batch), load_control._arm_name(arm))
        row = arms.setdefault(key, [0, 0.0, 0, 0, 0])
        for i, v in enumerate((1, info.seconds, info.committed, info.drafted, info.batch)):
            row[i] += v
        observe(self, arm, info, load)

    load_control.LoadController.observe = counted_observe
    sb._level(llm, [sb.Conversation(convs[0].turns[:1], 8)], 1, "on", 1)  # warm-up, as bench serve
    for mode in a.modes.split(","):
        llm.reset_drafters()
        llm.engine.cost = CostModel()
        forward["s"] = 0.0
        arms.clear()
        t, cpu = time.perf_counter(), process_cpu()
        res, report, _ = sb._level(llm, convs, a.concurrency, mode, a.requests or 2 * a.concurrency)
        wall, cpu = time.perf_counter() - t, process_cpu() - cpu
        s = last["scheduler"]
        tokens = sum(r["tokens"] for r in res)
        print(
            f"{mode}: {tokens / wall:.2f} tok/s over {wall:.1f} s; prefill {s.prefill_s:.1f} s, steps {s.step_s:.1f} s "
            f"({s.steps} steps: target forwards {forward['s']:.1f} s, the rest {s.step_s - forward['s']:.2f} s = "
            f"{(s.step_s - forward['s']) / max(1, s.steps) * 1e3:.2f} ms per step); drafted "
            f"{sum(r['drafted'] for r in res)}; controller {report}\n"
            f"  CPU seconds: engine thread {last['cpu']:.1f}, process {cpu:.1f} "
            f"(of {os.cpu_count() * wall:.1f} that {os.cpu_count()} CPUs give in {wall:.1f} s)",
            flush=True,
        )
        for (b, arm), (n, sec, com, dr, ss) in sorted(arms.items()):
            print(
                f"  load {b} {arm}: {n} steps, {sec:.1f} s, {com / sec:.1f} tok/s, {dr} drafted, "
                f"{com / ss:.2f} tokens per sequence-step"
            )
        c = llm.engine.cost
        print(
            f"  forward ms by tokens { ({t: round(v * 1e3, 1) for t, v in sorted(c.verify_s.items())}) }\n"
            f"  draft ms per token { ({d: round(v * 1e3, 3) for d, v in c.draft_s.items()}) }, catch-up ms per token "
            f"{ ({d: round(v * 1e3, 3) for d, v in c.setup_s.items()}) }\n"
            f"  acceptance by position { ({d: [round(r, 2) for r in e.rates[:8]] for d, e in c.history.items()}) }"
        )
        if a.profile:
            for key in ("cumulative", "tottime"):
                out = io.StringIO()
                pstats.Stats(last["profile"], stream=out).sort_stats(key).print_stats(a.profile)
                print(out.getvalue())


if __name__ == "__main__":
    main()
