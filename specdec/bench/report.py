"""Bench results: the summary (Spec-Bench style speedups), results.json, report.md (and the same as one HTML page,
report.html), the run's metadata, and the methods that failed or were skipped (`Outcomes`)."""

from __future__ import annotations

import base64
import html
import json
import os
import platform
import re
import shlex
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from specdec.bench.plots import ALL, categories, write_plots
from specdec.errors import SpecdecError
from specdec.stats import mean_accept_len

LIKELY_BUG_GAP = 0.5  # a divergence where the plain run's top-2 logit gap is at least this is not rounding
T = TypeVar("T")


class Skip(SpecdecError):
    """A method that cannot run with these settings (a peer lacking that combination), known before it starts."""


@dataclass
class Outcomes:
    """A run's notes, and the requested methods that did not run to the end with their reasons: `skipped` before
    they started (`Skip`), `failed` by an exception while loading, warming up or running."""

    notes: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # method -> reason
    failed: dict[str, dict[str, str]] = field(default_factory=dict)  # method -> {"stage", "reason"}
    errors_log: Path | None = None  # where the tracebacks of exceptions other than SpecdecError go

    def attempt(self, names: list[str], stage: str, fn: Callable[[], T]) -> T | None:
        """fn(); None when it raises, every method in `names` then recorded as skipped or failed while `stage`,
        with one line on stderr."""
        try:
            return fn()
        except Skip as e:
            for name in names:
                self.skipped[name] = str(e)
                _say(f"note: skipped {name}: {e}")
        except Exception as e:  # a method's failure is recorded, the others go on
            reason = str(e) if isinstance(e, SpecdecError) else f"{type(e).__name__}: {e}{self._log(e, stage)}"
            for name in names:
                self.failed[name] = {"stage": stage, "reason": reason}
                _say(f"{name} failed while {stage}: {reason}; the bench goes on without it")
        return None

    def _log(self, error: Exception, stage: str) -> str:
        """Append the traceback of an unexpected error to `errors_log`; the note that says where it is."""
        if self.errors_log is None:
            return ""
        with open(self.errors_log, "a") as f:
            f.write(f"while {stage}:\n{''.join(traceback.format_exception(error))}\n")
        return f" (traceback: {self.errors_log})"


def _say(line: str) -> None:
    """A line on stderr that leaves a progress bar intact."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def bench_meta(args, llm, prompts) -> dict:
    """What a reader needs to reproduce the run: command, date, machine, versions, settings."""
    import torch
    import transformers

    return {
        **run_stamp(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "dtype": str(llm.dtype).removeprefix("torch."),
        "quant": getattr(llm, "quant_info", None),
        "threads": args.threads,
        "models": {"target": args.model, "draft": args.draft},
        "workload": args.workload,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "temperature": args.temp,
        "seed": args.seed,
        "unseeded": getattr(args, "unseeded", False),
        "draft_max": args.draft_max,
        "context": llm.context,
        "cache_mb": llm.config.cache_mb,  # 0: every method prefills every prompt
    }


def run_stamp() -> dict:
    """This run's command line and start time."""
    return {"command": shlex.join(["specdec", *sys.argv[1:]]), "date": datetime.now().isoformat(timespec="seconds")}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def summarize(records: list[dict], methods: list[str]) -> dict:
    """{method: {category: stats}} over first-seen runs; categories in workload order, then "all".

    tokens_per_s is the mean over prompts of each prompt's median over repeats (min/max: the means of
    each prompt's slowest and fastest run); speedup is the ratio of that mean to the one of the same
    engine's plain decoding (`none`, `hf-plain`, `llama-none`) on the same prompts (Spec-Bench style).
    decode_speedup is the same over decode tokens/s (prefill time left out), where the engine reports it.
    speedup_ceiling (our `none` only) is the same over its runs' `ceiling_tokens_per_s`: the most any
    speculation could reach on those prompts.
    """
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r["first_seen"]:
            runs.setdefault((r["method"], r["id"]), []).append(r)
    categories = list(dict.fromkeys(r["category"] for r in records))
    tps = {k: statistics.median(r["tokens_per_s"] for r in rs) for k, rs in runs.items()}
    dec = {
        k: statistics.median(r["decode_tokens_per_s"] for r in rs)
        for k, rs in runs.items()
        if all(r.get("decode_tokens_per_s") for r in rs)
    }
    ceil = {
        k: statistics.median(r["ceiling_tokens_per_s"] for r in rs)
        for k, rs in runs.items()
        if all(r.get("ceiling_tokens_per_s") for r in rs)
    }
    out: dict[str, dict] = {}
    for m in methods:
        for cat in categories + [ALL]:
            ids = [pid for (mm, pid), rs in runs.items() if mm == m and cat in (ALL, rs[0]["category"])]
            if ids:
                rs = [r for pid in ids for r in runs[(m, pid)]]
                out.setdefault(m, {})[cat] = _entry(rs, ids, m, rs[0]["baseline"], tps, dec, ceil, runs)
    return out


def _entry(rs: list[dict], ids: list[str], m: str, baseline: str, tps: dict, dec: dict, ceil: dict, runs: dict) -> dict:
    def speedup(base: str, rates: dict = tps) -> float | None:
        common = [pid for pid in ids if (base, pid) in rates and (m, pid) in rates]
        if not common:
            return None
        return _mean([rates[(m, pid)] for pid in common]) / _mean([rates[(base, pid)] for pid in common])

    def total(key: str) -> int | None:
        vals = [r[key] for r in rs]
        return None if any(v is None for v in vals) else sum(vals)

    drafted, accepted, steps = total("drafted"), total("accepted"), total("verify_steps")
    compared = [r["matches_baseline"] for r in rs if r["matches_baseline"] is not None]
    r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "prompts": len(ids),
        "runs": len(rs),
        "tokens_per_s": r4(_mean([tps[(m, pid)] for pid in ids])),
        "tokens_per_s_min": r4(_mean([min(r["tokens_per_s"] for r in runs[(m, pid)]) for pid in ids])),
        "tokens_per_s_max": r4(_mean([max(r["tokens_per_s"] for r in runs[(m, pid)]) for pid in ids])),
        "speedup": r4(speedup(baseline)),
        "speedup_vs_hf_plain": r4(speedup("hf-plain")),
        "decode_speedup": r4(speedup(baseline, dec)),
        "speedup_ceiling": r4(_mean([ceil[(m, p)] for p in ids]) / _mean([tps[(m, p)] for p in ids]))
        if all((m, p) in ceil for p in ids)
        else None,
        "acceptance_rate": r4(accepted / drafted) if drafted and accepted is not None else None,
        "mean_accept_len": r4(mean_accept_len(accepted or 0, steps)) if steps is not None else None,
        "per_position_acceptance": _per_position(rs),
        "matched": sum(compared),
        "compared": len(compared),
    }


def _per_position(rs: list[dict]) -> list[float] | None:
    if any(r["drafted_at"] is None for r in rs):
        return None
    width = max((len(r["drafted_at"]) for r in rs), default=0)
    sums = [
        (
            sum(r["accepted_at"][i] for r in rs if i < len(r["accepted_at"])),
            sum(r["drafted_at"][i] for r in rs if i < len(r["drafted_at"])),
        )
        for i in range(width)
    ]
    return [round(a / d, 4) if d else 0.0 for a, d in sums]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A number as a table cell; "-" where there is none."""
    return "-" if x is None else format(x, spec) + suffix


def _by_category(summary: dict, key: str, spec: str, suffix: str = "") -> list[str]:
    cats = categories(summary)
    rows = [f"| method | {' | '.join(cats)} |", "|---" * (len(cats) + 1) + "|"]
    for m, per in summary.items():
        rows.append(f"| {m} | " + " | ".join(fmt(per.get(c, {}).get(key), spec, suffix) for c in cats) + " |")
    return rows


def report_tables(summary: dict, records: list[dict], outcomes: Outcomes) -> str:
    """The tables of report.md (also printed at the end of a run)."""
    lines = [
        "## All prompts",
        "",
        "| method | prompts | tok/s (min-max) | speedup | decode speedup | speedup vs hf-plain "
        "| acceptance rate | mean accept len | identical to baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, per in summary.items():
        s = per[ALL]
        ident = f"{s['matched']}/{s['compared']}" if s["compared"] else "-"
        lines.append(
            f"| {m} | {s['prompts']} | {s['tokens_per_s']:.2f} ({s['tokens_per_s_min']:.2f}-"
            f"{s['tokens_per_s_max']:.2f}) | {fmt(s['speedup'], '.2f', 'x')} | "
            f"{fmt(s.get('decode_speedup'), '.2f', 'x')} | "
            f"{fmt(s['speedup_vs_hf_plain'], '.2f', 'x')} | {fmt(s['acceptance_rate'], '.0%')} | "
            f"{fmt(s['mean_accept_len'])} | {ident} |"
        )
    lines += _not_run(outcomes)
    for title, key, spec, suffix in (
        ("Speedup by category", "speedup", ".2f", "x"),
        ("Decode speedup by category (prefill left out)", "decode_speedup", ".2f", "x"),
        ("Tokens/s by category", "tokens_per_s", ".2f", ""),
        ("Mean acceptance length by category", "mean_accept_len", ".2f", ""),
        ("Acceptance rate by category", "acceptance_rate", ".0%", ""),
    ):
        lines += ["", f"## {title}", ""] + _by_category(summary, key, spec, suffix)
        if key == "speedup" and "none" in summary and summary["none"][ALL].get("speedup_ceiling"):
            cats = categories(summary)
            lines.append(
                "| ceiling: every draft accepted | "
                + " | ".join(fmt(summary["none"].get(c, {}).get("speedup_ceiling"), ".2f", "x") for c in cats)
                + " |"
            )
    diffs = [r for r in records if r["matches_baseline"] is False]
    if diffs:
        lines += ["", "## Outputs that differ from their baseline", ""]
        for r in diffs:
            d = r["first_divergence"]
            where = "" if d is None else f" at output token {d['index']} (top-2 gap {fmt(d['top2_gap'])})"
            bug = d is not None and (d["top2_gap"] is None or d["top2_gap"] >= LIKELY_BUG_GAP)
            lines.append(f"- {r['method']} on {r['id']} (repeat {r['repeat']}){where}" + (" **LIKELY BUG**" * bug))
    if outcomes.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in outcomes.notes]
    return "\n".join(lines) + "\n"


def _not_run(outcomes: Outcomes) -> list[str]:
    """A line per method that failed or was skipped, with its reason."""
    lines = [f"- {m} failed while {f['stage']}: {f['reason']}" for m, f in outcomes.failed.items()]
    lines += [f"- {m} skipped: {reason}" for m, reason in outcomes.skipped.items()]
    return ["", "## Failed and skipped methods", "", *lines] if lines else []


def render_report(summary: dict, records: list[dict], meta: dict, outcomes: Outcomes, plots: list[str]) -> str:
    m = meta
    head = [
        "# specdec bench",
        "",
        f"`{m['command']}`",
        "",
        f"{m['date']} · {m['machine']['cpu']} ({m['machine']['cores']} cores) · torch "
        f"{m['versions']['torch']} · transformers {m['versions']['transformers']} · {m['dtype']} · "
        f"{m['threads']} threads",
        "",
        f"target {m['models']['target']}{' (' + m['quant'] + ')' if m.get('quant') else ''}, "
        f"draft {m['models']['draft']} · workload {m['workload']} "
        f"({m['prompts']} prompts) · max tokens {m['max_tokens'] or 'per prompt'} · repeat {m['repeat']} · "
        f"temperature {m['temperature']}",
        "",
        "tok/s: mean over prompts of each prompt's median run (min-max: means of the slowest and fastest "
        "runs). speedup: ratio of mean tok/s to that of the same engine's plain decoding (`none`, "
        "`hf-plain`, `llama-none`) on the same prompts; decode speedup: the same with the prefill time "
        "left out (our engine and llama.cpp report it); speedup vs hf-plain: the same against "
        "`transformers` generate. ceiling: the most any speculation could reach, from `none`'s runs: the "
        "same prefill, then every draft of --draft-max tokens accepted at the cost of one plain forward. "
        "Greedy outputs are compared with the first run of that plain decoding.",
        "",
        "",
    ]
    pics = ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(head) + report_tables(summary, records, outcomes) + "\n".join(pics) + "\n"


def write_outputs(out_dir: Path, records: list[dict], summary: dict, meta: dict, outcomes: Outcomes) -> None:
    """results.json, report.md, report.html and the plots; each file replaced whole, so a killed run leaves valid
    files."""
    plots = write_plots(out_dir, summary)
    write_atomic(
        out_dir / "results.json",
        json.dumps(
            {
                "runs": records,
                "summary": summary,
                "failed": outcomes.failed,
                "skipped": outcomes.skipped,
                "meta": {**meta, "notes": outcomes.notes},
            },
            indent=1,
        ),
    )
    write_report(out_dir, render_report(summary, records, meta, outcomes, plots))


def write_report(out_dir: Path, markdown: str) -> None:
    """report.md, and report.html: the same as one page a browser opens, its plots embedded."""
    write_atomic(out_dir / "report.md", markdown)
    write_atomic(out_dir / "report.html", html_page(markdown, out_dir))


_CSS = (
    "body{font:14px/1.5 system-ui,sans-serif;max-width:1200px;margin:24px auto;padding:0 16px;color:#1d1d1f}"
    "table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ccc;padding:3px 8px}"
    "th{background:#f0f0f3}td:not(:first-child){text-align:right;font-variant-numeric:tabular-nums}"
    "img{max-width:100%;margin:8px 0}code{background:#f0f0f3;padding:1px 4px;border-radius:3px}"
)


def html_page(markdown: str, base: Path) -> str:
    """The markdown that `render_report` writes (headings, paragraphs, lists, tables, images) as a self-contained
    HTML page; images found under `base` are embedded as base64."""
    blocks = [b.splitlines() for b in re.split(r"\n\s*\n", markdown.strip())]
    title = next((line[2:] for b in blocks for line in b if line.startswith("# ")), "report")
    body = "\n".join(_html_block(b, base) for b in blocks)
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def _html_block(lines: list[str], base: Path) -> str:
    if all(line.startswith("|") for line in lines):
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if not line.startswith("|---")]
        head = "".join(f"<th>{_inline(c)}</th>" for c in rows[0])
        cells = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>"
    if lines[0].startswith("#"):
        level = len(lines[0]) - len(lines[0].lstrip("#"))
        return f"<h{level}>{_inline(lines[0][level:].strip())}</h{level}>"
    if all(line.startswith("- ") for line in lines):
        return "<ul>" + "".join(f"<li>{_inline(line[2:])}</li>" for line in lines) + "</ul>"
    images = [re.fullmatch(r"!\[(.*)\]\((.*)\)", line) for line in lines]
    if all(images):
        return "".join(f'<img alt="{html.escape(m[1])}" src="{_image_src(base, m[2])}">' for m in images)
    return f"<p>{_inline(' '.join(lines))}</p>"


def _inline(text: str) -> str:
    """`code` and **bold** in escaped text."""
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text, quote=False))
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


def _image_src(base: Path, src: str) -> str:
    """A data: URI of the image file `src` under `base`, or `src` itself (a relative link) when it is not there."""
    path = base / src
    if not path.is_file():
        return html.escape(src)
    kind = {".svg": "svg+xml", ".jpg": "jpeg"}.get(path.suffix, path.suffix.lstrip(".") or "png")
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
