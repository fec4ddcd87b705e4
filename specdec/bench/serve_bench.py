"""`specdec bench serve`: sweep client concurrency against the live server with speculation off, always
on, and load-controlled (auto), each also without the prefix cache (`MODE-nocache`: every request says
`cache_prompt: false`); throughput, TTFT and time per output token, with plots. A prompt of several turns is a
conversation: one request per turn, each carrying the earlier turns and the server's answers. Each level runs every
mode `--passes` times in alternating order (as given, then reversed: drift over time hits every mode alike); a
mode's figures are its passes' means, a ratio to off the geometric mean of the ratios within each pass."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from specdec.bench.report import bench_meta, write_atomic, write_report
from specdec.bench.workloads import load_workload
from specdec.errors import SpecdecError

MODES = ("off", "on", "auto")
NOCACHE = "-nocache"  # mode suffix: the same mode with `cache_prompt: false` on every request
SERVE_MAX_TOKENS = 64  # new tokens per turn where the workload gives none and -n is not set


@dataclass
class Conversation:
    turns: list[str]
    max_tokens: int  # per turn: the workload's own limit (capped by -n), else -n or SERVE_MAX_TOKENS


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",")]
    except ValueError:
        raise SpecdecError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise SpecdecError(f"concurrency levels must be >= 1, got {s!r}")
    return vals


def pass_order(modes: list[str], passes: int) -> list[tuple[int, str]]:
    """(pass, mode) in run order: the modes as given, then reversed, and so on."""
    return [(p, m) for p in range(passes) for m in (modes if p % 2 == 0 else modes[::-1])]


def run_serve_bench(args: argparse.Namespace) -> Path:
    import torch

    from specdec.api import build_llm
    from specdec.drafters import default_spec_type
    from specdec.engine.adaptive import CostModel
    from specdec.models.packs import DEFAULT_DRAFT, DEFAULT_TARGET

    levels = _ints(args.concurrency)
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m.removesuffix(NOCACHE) not in MODES for m in modes):
        raise SpecdecError(f"--modes: choose from {', '.join(MODES)}, each optionally with {NOCACHE}")
    if len(set(modes)) < len(modes):
        raise SpecdecError("--modes: each mode once (--passes repeats them)")
    prompts = load_workload(args.workload, args.workload_dir, args.per_category, args.seed, args.categories)
    spec = args.spec_type or default_spec_type(args.model, args.draft)  # what `specdec serve` runs without --spec-type
    if args.model is None:
        args.model, args.draft = DEFAULT_TARGET, args.draft or DEFAULT_DRAFT
    if "draft" in spec.split(",") and args.draft is None:
        raise SpecdecError("spec type draft needs a draft model (-md)")
    args.threads = args.threads or torch.get_num_threads()  # fixed for every mode
    out_dir = Path(args.out or Path("bench-out") / datetime.now().strftime("serve-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    llm = build_llm(args, spec_type=spec, parallel=max(levels))
    convs = [
        Conversation(list(p.turns), p.limit(args.max_tokens) if p.max_tokens else args.max_tokens or SERVE_MAX_TOKENS)
        for p in prompts
    ]
    meta = {
        **bench_meta(args, llm, prompts),
        "spec_type": spec,
        "concurrency": levels,
        "modes": modes,
        "passes": args.passes,
        "cache_mb": llm.config.cache_mb,
    }
    runs: list[dict] = []
    _level(llm, [Conversation(convs[0].turns[:1], 8)], 1, "on", 1)  # warm-up
    for c in levels:
        n = args.requests or max(4, 2 * c)
        for p, mode in pass_order(modes, args.passes):  # interleaved per level so drift hits every mode alike
            print(f"concurrency {c}, {mode} (pass {p + 1}/{args.passes}): {n} conversations...", file=sys.stderr)
            llm.reset_drafters()
            llm.engine.cost = CostModel()  # a fresh server's measurements: no mode steers the next one's drafts
            if llm.prefix_cache is not None:
                llm.prefix_cache.clear()  # no mode starts with what another one cached
            res, report, engine = _level(llm, convs, c, mode, n)
            runs.append(
                {
                    "concurrency": c,
                    "mode": mode,
                    "pass": p,
                    **_summary(res),
                    **engine,
                    "controller": report,
                    "requests": res,
                }
            )
            _write(out_dir, runs, meta)
    print(render(runs, meta))
    print(f"results: {out_dir}/results.json, {out_dir}/report.md", file=sys.stderr)
    return out_dir


def _level(llm, convs: list["Conversation"], conc: int, mode: str, n: int) -> tuple[list[dict], dict, dict]:
    """`n` conversations (one streaming request per turn) from `conc` client threads against a fresh server in
    `mode`: (per request results, the load controller's report, the engine's time split)."""
    import httpx

    from specdec.engine.load_control import LoadController
    from specdec.engine.scheduler import Scheduler
    from specdec.sampling import SamplingParams
    from specdec.server.app import ServerConfig, create_app
    from specdec.server.serve import ServerThread

    spec_mode = mode.removesuffix(NOCACHE)
    extra = {
        **({"speculative": False} if spec_mode == "off" else {}),
        **({"cache_prompt": False} if mode.endswith(NOCACHE) else {}),
    }
    controller = LoadController(llm.engine.spec.draft_max) if spec_mode == "auto" else None
    scheduler = Scheduler(llm.engine, conc, max_queue=n, controller=controller)
    srv = ServerThread(create_app(llm, scheduler, ServerConfig("m", SamplingParams(max_tokens=SERVE_MAX_TOKENS))))
    results: list[dict] = []
    lock, counter = threading.Lock(), iter(range(n))

    def worker():
        with httpx.Client(timeout=3600) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                conv = convs[i % len(convs)]
                results.extend(_conversation(client, srv.url, llm, conv.turns, conv.max_tokens, extra, i))

    try:
        threads = [threading.Thread(target=worker) for _ in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        srv.close()
    tokens = sum(r["tokens"] for r in results if not r["error"])
    engine = {
        "prefill_s": round(scheduler.prefill_s, 2),
        "step_s": round(scheduler.step_s, 2),
        "step_tok_s": round(tokens / scheduler.step_s, 3) if scheduler.step_s else None,
    }
    return sorted(results, key=lambda r: (r["index"], r["turn"])), controller.report() if controller else {}, engine


def _conversation(client, url: str, llm, turns: list[str], max_tokens: int, extra: dict, index: int) -> list[dict]:
    """One request per turn, each with the earlier turns and answers in the chat template (as the client's ids)."""
    messages: list[dict] = []
    out = []
    for t, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        r = _one(client, url, llm.encode_chat(messages), max_tokens, extra, index)
        messages.append({"role": "assistant", "content": r.pop("text")})
        out.append({**r, "turn": t})
    return out


def _one(client, url: str, ids: list[int], max_tokens: int, extra: dict, index: int) -> dict:
    body = {
        "model": "m",
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    first, tokens, stats, error, text, cached = None, 0, {}, None, [], 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            error = f"HTTP {r.status_code}"
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                error = ev["error"]["message"]
            elif ev.get("choices") and ev["choices"][0].get("text"):
                first = first or time.perf_counter()
                text.append(ev["choices"][0]["text"])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("speculative"):
                stats = ev["speculative"]
            if ev.get("timings"):
                cached = ev["timings"].get("cache_n", 0)
    end = time.perf_counter()
    first = first or end
    return {
        "index": index,
        "start": t0,
        "end": end,
        "ttft_s": first - t0,
        "latency_s": end - t0,
        "tokens": tokens,
        "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None,
        "drafted": stats.get("drafted", 0),
        "accepted": stats.get("accepted", 0),
        "error": error,
        "cached_tokens": cached,
        "text": "".join(text),
    }


def _summary(res: list[dict]) -> dict:
    ok = [r for r in res if not r["error"]]
    wall = max(r["end"] for r in res) - min(r["start"] for r in res)
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    tokens = sum(r["tokens"] for r in ok)
    drafted = sum(r["drafted"] for r in ok)
    return {
        "throughput_tok_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "errors": len(res) - len(ok),
        "ttft_s": med([r["ttft_s"] for r in ok]),
        "tpot_s": med([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "latency_s": med([r["latency_s"] for r in ok]),
        "ttft_later_turns_s": med([r["ttft_s"] for r in ok if r["turn"] > 0]),
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "acceptance_rate": round(sum(r["accepted"] for r in ok) / drafted, 4) if drafted else None,
    }


def combined(runs: list[dict], c: int, mode: str, key: str) -> float | None:
    """The mean of `key` over a mode's passes at concurrency `c` (None where no pass measured it, or recorded it:
    runs from before a key existed)."""
    vals = [r[key] for r in runs if r["concurrency"] == c and r["mode"] == mode and r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def ratios(runs: list[dict], c: int, mode: str, base: str, key: str) -> list[float]:
    """Per pass at concurrency `c`: `mode`'s `key` over `base`'s in the same pass."""
    by = {(r["pass"], r["mode"]): r[key] for r in runs if r["concurrency"] == c and r[key] is not None}
    return [by[p, mode] / by[p, base] for p, m in by if m == base and by.get((p, mode)) and by[p, base]]


def _ratio_cell(xs: list[float]) -> str:
    """The geometric mean, with each pass's ratio where there are several."""
    if not xs:
        return ""
    mean = math.exp(statistics.fmean(math.log(x) for x in xs))
    return f"{mean:.2f}x" + (f" ({', '.join(f'{x:.2f}' for x in xs)})" if len(xs) > 1 else "")


def _mean_cells(runs: list[dict], c: int, modes: list[str], fields: tuple[tuple[str, str], ...]) -> list[str]:
    """Per mode, per (key, format) field: its mean over passes at concurrency `c`, formatted ("" where none)."""
    return ["" if (v := combined(runs, c, m, key)) is None else format(v, fmt) for m in modes for key, fmt in fields]


def render(runs: list[dict], meta: dict) -> str:
    """Markdown: one row per concurrency, per mode throughput / TTFT / TPOT (means over passes), auto and on over
    off, and each mode's TTFT without the prefix cache over with it (geometric means of per-pass ratios)."""
    modes = meta["modes"]
    head = "| concurrency | " + " | ".join(f"{m} tok/s | {m} TTFT s | {m} TPOT s" for m in modes)
    over_off = [m for m in ("on", "auto") if m in modes and "off" in modes]
    cached = [m for m in modes if m + NOCACHE in modes]
    head += "".join(f" | {m}/off" for m in over_off) + "".join(f" | {m} TTFT nocache/cache" for m in cached) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * len(modes) + len(over_off) + len(cached))]
    for c in meta["concurrency"]:
        cells = _mean_cells(runs, c, modes, (("throughput_tok_s", ".2f"), ("ttft_s", ".2f"), ("tpot_s", ".3f")))
        cells += [_ratio_cell(ratios(runs, c, m, "off", "throughput_tok_s")) for m in over_off]
        cells += [_ratio_cell(ratios(runs, c, m + NOCACHE, m, "ttft_s")) for m in cached]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_engine(runs: list[dict], meta: dict) -> str:
    """Markdown: per concurrency and mode, the engine thread's seconds in prefill and in decode steps, and tokens per
    second of step time (means over passes; runs from before these were recorded show blanks)."""
    modes = meta["modes"]
    lines = [
        "| concurrency | " + " | ".join(f"{m} prefill s | {m} step s | {m} step tok/s" for m in modes) + " |",
        "|" + "---|" * (1 + 3 * len(modes)),
    ]
    for c in meta["concurrency"]:
        cells = _mean_cells(runs, c, modes, (("prefill_s", ".1f"), ("step_s", ".1f"), ("step_tok_s", ".2f")))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _max_tokens_note(meta: dict) -> str:
    cap = meta["max_tokens"]
    return f"the workload's, at most {cap} (-n)" if cap else f"the workload's, else {SERVE_MAX_TOKENS}"


def _write(out_dir: Path, runs: list[dict], meta: dict) -> None:
    write_atomic(out_dir / "results.json", json.dumps({"runs": runs, "meta": meta}, indent=1))
    plots = _plots(out_dir, runs, meta)
    text = [
        "# specdec bench serve",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['date']} · {meta['machine']['cpu']} · {meta['dtype']} · {meta['threads']} threads · "
        f"target {meta['models']['target']} · spec type `{meta['spec_type']}` for on/auto · "
        f"workload {meta['workload']} · max tokens per turn: {_max_tokens_note(meta)}",
        "",
        "Throughput: completion tokens over all requests / wall time of the level. TTFT and TPOT: medians "
        "per request (streaming). off: `speculative: false`; on: speculation at any load; auto: the "
        f"load controller (engine/load_control.py); MODE{NOCACHE}: `cache_prompt: false` (prefix cache "
        f"{meta['cache_mb']} MiB, emptied before every level and mode). Turns after the first of a conversation "
        f"carry the earlier turns and answers. {meta['passes']} passes per level, the modes as given, then "
        "reversed, ...: figures are means over passes, ratios geometric means of each pass's ratio (each pass's "
        "in parentheses).",
        "",
        render(runs, meta),
        "## Engine time",
        "",
        "Seconds the engine thread spent prefilling prompts and in decode steps (drafting, the target forward, "
        "verification, commits), and completion tokens per second of step time: what the load controller's "
        "goodput measures (it cannot change the prefill, so it leaves it out). Means over passes.",
        "",
        render_engine(runs, meta),
        "## Plots",
        "",
        *[f"![{p}]({p})" for p in plots],
    ]
    write_report(out_dir, "\n".join(text) + "\n")


def _plots(out_dir: Path, runs: list[dict], meta: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, label, name in (
        ("throughput_tok_s", "throughput (tokens/s, all requests)", "serve_throughput.png"),
        ("ttft_s", "median time to first token (s)", "serve_ttft.png"),
        ("tpot_s", "median time per output token (s)", "serve_tpot.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for m in meta["modes"]:
            pts = [(c, v) for c in meta["concurrency"] if (v := combined(runs, c, m, key)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names
