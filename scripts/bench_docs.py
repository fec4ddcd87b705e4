"""Rewrite docs/benchmarks.md from the bench results kept under docs/bench/.

docs/bench/index.json lists them: per CPU kind (`key`: its folder docs/bench/<key>/; `name`, `short`, `about`) the
runs in the order shown, each a `title`, the `dirs` whose results.json it reads (several: one table, rows or levels
together, `labels` naming them) and a `note`; optional `times` (prefill, decode, peak RSS columns), `categories`
(the summary keys tabled by category) and `commands` (shown instead of the recorded ones). Each results.json gives
the command, date, machine and every figure: the tables come from its stored summary (`specdec bench`, `bench
replay`) or its runs (`specdec bench serve`, through the same table code as its report).

    python scripts/bench_docs.py            # rewrite docs/benchmarks.md
    python scripts/bench_docs.py --check    # exit 1 if docs/benchmarks.md differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdec.bench.constrained import report_table
from specdec.bench.plots import ALL, PLAIN
from specdec.bench.report import fmt
from specdec.bench.serve_bench import render, render_engine

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
DOC = ROOT / "docs" / "benchmarks.md"

INTRO = """\
# Benchmarks

<!-- Written by `python scripts/bench_docs.py` from docs/bench/index.json and the results.json files it names.
Edit those and rerun the script; tests/test_bench_docs.py fails while this file is out of date. -->

The current figures, one section per CPU kind: the latest run of each workload kept in [bench/](bench/) (one folder
per run, its `results.json` holding every record; [bench/index.json](bench/index.json) lists them). Each table
gives the command that produced it (its `--out` is the folder it reads: rerunning the command there replaces the
run; then `python scripts/bench_docs.py` rewrites this page), its date and CPU. How to run a bench, and every
field: [bench.md](bench.md).

Every machine here has 2 cores and is shared with other work: the same run can take 20-50% longer at another
moment, and plain decoding, bound by memory bandwidth, swings more than speculative decoding, whose verification is
compute-bound. Compare ratios within one table. Unless a table says otherwise: greedy, target qwen2.5-coder-1.5b,
draft qwen2.5-coder-0.5b, their packs' GGUF files (Q4_K_M target, mostly Q5_0 draft) through our kernels.

Columns. **tok/s**: the mean over prompts of each prompt's tokens per second (median over repeats), prefill
included. **speedup**: that mean over the same engine's plain decoding on the same prompts (`none`; `hf-plain` for
`transformers`' `hf-*` methods; `llama-none` for llama.cpp's `llama-*`), Spec-Bench style; **decode speedup**: the
same with the prefill left out. **vs llama.cpp plain**: tok/s over `llama-none`'s on the same prompts (llama.cpp's
`llama-server` built for the CPU from the pinned llama-cpp-python 0.3.36 sources, by `--llama-server auto` or at
the path the command names; the same GGUF files and threads). **vs hf-plain**: over `transformers` generate.
**acceptance**: accepted / drafted tokens. **mean accept len**: new tokens per target forward. **identical to
plain**: outputs token-identical to the same engine's plain decoding. **prefill s**, **decode s**: sums over the
prompts. **peak RSS MB**: the process's peak (ours: both models loaded; llama.cpp's: its server). Server tables
(`specdec bench serve`): completion tokens over the level's wall time, median time to first token (TTFT) and per
output token (TPOT), each mode's mean over passes, ratios to off the geometric mean of each pass's ratio (each
pass's in parentheses); off sends `"speculative": false`, on speculates at any load, auto runs the load controller;
engine time: the engine thread's seconds in prefill and in decode steps.
"""

CATEGORY_TABLES = {  # summary key -> (caption, number format, suffix)
    "speedup": ("Speedup by category", ".2f", "x"),
    "decode_speedup": ("Decode speedup by category", ".2f", "x"),
    "tokens_per_s": ("Tokens/s by category", ".2f", ""),
    "mean_accept_len": ("Mean acceptance length by category", ".2f", ""),
    "acceptance_rate": ("Acceptance by category", ".2f", ""),
}


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table, leaving out the columns (after the first) where no row has a value."""
    keep = [0] + [i for i in range(1, len(head)) if any(r[i] != "-" for r in rows)]
    return [
        "| " + " | ".join(head[i] for i in keep) + " |",
        "|---" * len(keep) + "|",
        *("| " + " | ".join(r[i] for i in keep) + " |" for r in rows),
    ]


def plural(n: int, word: str) -> str:
    """A count and its word: 1 prompt, 2 prompts, 3 passes."""
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def load(folder: str) -> dict:
    """The results.json of docs/bench/<folder>."""
    return json.loads((BENCH / folder / "results.json").read_text())


def command(meta: dict, folder: str) -> str:
    """The run's command line with its --out set to the folder the results are kept in."""
    argv = shlex.split(meta["command"])
    if "--out" in argv:
        del argv[argv.index("--out") : argv.index("--out") + 2]
    return shlex.join([*argv, "--out", f"docs/bench/{folder}"])


def stamp(meta: dict, cpu: dict) -> str:
    """Date, CPU and settings of a run, as one line."""
    m = meta
    quant = f" ({m['quant']})" if m.get("quant") else ""
    draft = f", draft {m['models']['draft']}" if m["models"].get("draft") else ""
    tokens = f"at most {m['max_tokens']} tokens per turn" if m.get("max_tokens") else "the prompts' own token limits"
    line = (
        f"{m['date'][:10]} · {cpu['short']} (`{m['machine']['cpu']}`, {m['machine']['cores']} cores) · "
        f"{plural(m['threads'], 'thread')} · {m['dtype']} · target {m['models']['target']}{quant}{draft} · "
        f"{plural(m['prompts'], 'prompt')}, {tokens}, {plural(m['repeat'], 'repeat')}, "
        f"temperature {m['temperature']:g}"
    )
    if "concurrency" in m:  # a serve sweep
        cache = f"prefix cache {m['cache_mb']} MiB" if m.get("cache_mb") else "prefix cache off"
        line += (
            f" · spec type `{m['spec_type']}` for on/auto · workload {m['workload']} · "
            f"{plural(m.get('passes', 1), 'pass')} per level · {cache}"
        )
    return line


def method_rows(data: dict, label: str, times: bool) -> list[list[str]]:
    """One row per method over all prompts: tok/s, speedups, acceptance, identical outputs, optionally times."""
    summary, runs = data["summary"], data["runs"]
    llama = summary.get("llama-none", {}).get(ALL, {}).get("tokens_per_s")
    rows = []
    for m, per in summary.items():
        s = per[ALL]
        row = [
            f"{m} ({label})" if label else m,
            str(s["prompts"]),
            fmt(s["tokens_per_s"]),
            fmt(s["speedup"], suffix="x"),
            fmt(s.get("decode_speedup"), suffix="x"),
            fmt(s["tokens_per_s"] / llama if llama else None, suffix="x"),
            fmt(s.get("speedup_vs_hf_plain"), suffix="x"),
            fmt(s["acceptance_rate"]),
            fmt(s["mean_accept_len"]),
            f"{s['matched']}/{s['compared']}" if s["compared"] else "-",
        ]
        if times:
            row += time_cells([r for r in runs if r["method"] == m and r["first_seen"]], data["meta"]["repeat"])
        rows.append(row)
    return rows


def time_cells(runs: list[dict], repeat: int) -> list[str]:
    """A method's prefill and decode seconds summed over its prompts (per repeat), and its peak RSS."""
    prefill = [r["prefill_s"] for r in runs]
    rss = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb")]
    if None in prefill:
        return ["-", "-", fmt(max(rss) if rss else None, ".0f")]
    seconds = sum(r["seconds"] for r in runs)
    return [
        fmt(sum(prefill) / repeat, ".1f"),
        fmt((seconds - sum(prefill)) / repeat, ".1f"),
        fmt(max(rss) if rss else None, ".0f"),
    ]


def bench_tables(datas: list[dict], labels: list[str], times: bool, keys: list[str]) -> list[str]:
    """The all-prompts table of one or more `specdec bench` runs, then one table per category key (one run only)."""
    head = [
        "method",
        "prompts",
        "tok/s",
        "speedup",
        "decode speedup",
        "vs llama.cpp plain",
        "vs hf-plain",
        "acceptance",
        "mean accept len",
        "identical to plain",
    ]
    head += ["prefill s", "decode s", "peak RSS MB"] * times
    lines = table(head, [row for d, label in zip(datas, labels) for row in method_rows(d, label, times)])
    summary = datas[0]["summary"]
    cats = list(dict.fromkeys(c for per in summary.values() for c in per if c != ALL)) + [ALL]
    for key in keys:
        caption, spec, suffix = CATEGORY_TABLES[key]
        rows = [
            [m] + [fmt(per.get(c, {}).get(key), spec, suffix) for c in cats]
            for m, per in summary.items()
            if not (key.endswith("speedup") and m in PLAIN)
        ]
        ceiling = summary.get("none", {}).get(ALL, {}).get("speedup_ceiling")
        if key == "speedup" and ceiling:
            rows.append(
                ["ceiling: every draft accepted"]
                + [fmt(summary["none"].get(c, {}).get("speedup_ceiling"), ".2f", "x") for c in cats]
            )
        lines += ["", f"{caption}:", "", *table(["method", *cats], [r for r in rows if set(r[1:]) != {"-"}])]
    return lines


def serve_tables(datas: list[dict]) -> list[str]:
    """`specdec bench serve`'s level table (and engine time where recorded) over the runs of one or more sweeps."""
    runs = [{"pass": 0, **r} for d in datas for r in d["runs"]]  # runs from before --passes had one pass
    meta = {**datas[0]["meta"], "concurrency": sorted({c for d in datas for c in d["meta"]["concurrency"]})}
    lines = render(runs, meta).splitlines()
    if any(r.get("step_s") is not None for r in runs):
        lines += ["", "Engine time:", "", *render_engine(runs, meta).splitlines()]
    return lines


def entry(cpu: dict, run: dict) -> list[str]:
    """One run's section: heading, commands, date and CPU, links, tables, note."""
    folders = [f"{cpu['key']}/{d}" for d in run["dirs"]]
    datas = [load(f) for f in folders]
    lines = [
        f"### {cpu['short']}: {run['title']}",
        "",
        "```bash",
        *(run.get("commands") or [command(d["meta"], f) for d, f in zip(datas, folders)]),
        "```",
        "",
    ]
    labels = run.get("labels", [""] * len(datas))
    names = run.get("labels", run["dirs"] if len(datas) > 1 else ["results.json"])
    links = [f"[{name}](bench/{f}/results.json)" for name, f in zip(names, folders)]
    stamps = [stamp(d["meta"], cpu) for d in datas]
    if len(set(stamps)) == 1:
        lines += [f"{stamps[0]} · {', '.join(links)}", ""]
    else:
        lines += [line for s, link in zip(stamps, links) for line in (f"{s} · {link}", "")]
    if "constrained" in datas[0]:
        lines += report_table(datas[0])
    elif "summary" in datas[0]:
        categories = {c for per in datas[0]["summary"].values() for c in per if c != ALL}
        keys = run.get("categories", ["speedup"] if len(datas) == 1 and len(categories) > 1 else [])
        lines += bench_tables(datas, labels, run.get("times", False), keys)
    else:
        lines += serve_tables(datas)
    return lines + (["", run["note"]] if run.get("note") else []) + [""]


def document(index: dict) -> str:
    """The whole of docs/benchmarks.md."""
    lines = [INTRO]
    for cpu in index["cpus"]:
        lines += [f"## {cpu['name']}", "", cpu["about"], ""]
        for run in cpu["runs"]:
            lines += entry(cpu, run)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is not what it would write")
    args = ap.parse_args(argv)
    text = document(json.loads((BENCH / "index.json").read_text()))
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is out of date: run python scripts/bench_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
