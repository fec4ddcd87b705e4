"""Constrained output with and without speculation: JSON answers under a schema, per spec type, against the same
prompts unconstrained (what the grammar's masks cost) and constrained plain decoding (what speculation gains).

    python scripts/bench_constrained.py -m qwen2.5-coder-1.5b --out docs/bench/zen5/constrained -t 2

(scripts/bench_constrained.py runs `main`.)

Each prompt asks for a JSON answer and carries its schema; every method runs every prompt `--repeats` times (the
median tok/s kept, decode only: prefill left out, as Spec-Bench's decode speedup). Writes results.json (per prompt and
method: tokens, tok/s, drafted, accepted, whether the tokens equal constrained plain decoding's) and report.md (the
mean over prompts and its ratio to constrained plain decoding). Every run starts with fresh drafters, so the suffix
tree learns only from the prompt and the answer so far (a server's would also know earlier requests).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from datetime import datetime
from pathlib import Path

import specdec
from specdec.bench.report import cpu_model

ITEM = {"type": "object", "additionalProperties": False}
TASKS = [
    (
        "List four classic novels with their title, author and year.",
        {"title": "string", "author": "string", "year": "integer"},
    ),
    (
        "Give five countries with their capital and population in millions.",
        {"country": "string", "capital": "string", "population_millions": "number"},
    ),
    (
        "Describe three Python web frameworks: name, first release year and a one-line summary.",
        {"name": "string", "first_release": "integer", "summary": "string"},
    ),
    (
        "List the planets of the solar system with their order from the sun and whether they have rings.",
        {"name": "string", "order": "integer", "has_rings": "boolean"},
    ),
    (
        "Write four unit test cases for a function add(a, b): inputs a and b and the expected result.",
        {"a": "integer", "b": "integer", "expected": "integer"},
    ),
    (
        "List five HTTP status codes with their number, name and meaning.",
        {"code": "integer", "name": "string", "meaning": "string"},
    ),
]


def schema(fields: dict[str, str]) -> dict:
    """An array of objects with exactly these fields (strings capped at 80 characters)."""
    props = {k: {"type": t, **({"maxLength": 80} if t == "string" else {})} for k, t in fields.items()}
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": 8,
        "items": {**ITEM, "required": list(fields), "properties": props},
    }


def run(llm: specdec.LLM, prompt: str, grammar, spec: str, max_tokens: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        llm.reset_drafters()  # fresh drafters: the suffix tree would otherwise draft the previous repeat's answer
        runs.append(llm.generate(prompt, max_tokens=max_tokens, chat=True, grammar=grammar, spec_type=spec))
    r = runs[0]
    decode = [x.stats.total_s - x.stats.prefill_s for x in runs]
    return {
        "tokens": r.token_ids,
        "new_tokens": r.stats.new_tokens,
        "decode_tok_s": round(max(r.stats.new_tokens - 1, 0) / statistics.median(decode), 2),
        "drafted": r.stats.drafted,
        "accepted": r.stats.accepted,
        "valid_json": _valid(r.text),
        "finish_reason": r.finish_reason,
    }


def _valid(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def report_table(results: dict) -> list[str]:
    """The Markdown table: per method, the mean decode tok/s over prompts and its ratio to constrained plain."""
    results = results["constrained"]
    rows = [
        "| method | constrained | mean decode tok/s | vs constrained plain | drafted | accepted | "
        "same tokens as constrained plain | valid JSON |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = statistics.mean(p["runs"]["none+json"]["decode_tok_s"] for p in results["prompts"])
    for key in results["methods"]:
        runs = [p["runs"][key] for p in results["prompts"]]
        tok_s = statistics.mean(r["decode_tok_s"] for r in runs)
        same = f"{sum(r['same_as_plain'] for r in runs)}/{len(runs)}" if "same_as_plain" in runs[0] else "-"
        rows.append(
            f"| {key.split('+')[0]} | {'yes' if key.endswith('+json') else 'no'} | {tok_s:.2f} | "
            f"{tok_s / base:.2f}x | {sum(r['drafted'] for r in runs)} | {sum(r['accepted'] for r in runs)} | "
            f"{same} | {sum(r['valid_json'] for r in runs)}/{len(runs)} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--specs", default="none,ngram-simple,suffix-tree", help="spec types, comma-separated (none first)")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="folder for results.json and report.md")
    args = ap.parse_args()
    llm = specdec.LLM(args.model, spec_type="none", threads=args.threads, progress=False)
    specs = args.specs.split(",")
    for spec in specs:  # warm-up: kernels, llguidance's tokenizer, drafters
        llm.generate("Hi", max_tokens=8, chat=True, grammar=specdec.Grammar.json_schema(), spec_type=spec)
    methods = [f"{s}+json" for s in specs] + ["none"]
    prompts = []
    for text, fields in TASKS:
        prompt = f"{text} Answer with a JSON array of objects with the fields {', '.join(fields)}."
        grammar = specdec.Grammar.json_schema(schema(fields))
        runs = {}
        for key in methods:
            spec, constrained = key.split("+")[0], key.endswith("+json")
            runs[key] = run(llm, prompt, grammar if constrained else None, spec, args.max_tokens, args.repeats)
        for key in methods[:-1]:
            runs[key]["same_as_plain"] = runs[key]["tokens"] == runs["none+json"]["tokens"]
        prompts.append({"prompt": prompt, "runs": runs})
        print(prompt[:60], {k: v["decode_tok_s"] for k, v in runs.items()}, flush=True)
    meta = {
        "command": shlex.join(["python", "scripts/bench_constrained.py", *sys.argv[1:]]),
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "threads": args.threads,
        "dtype": "float32",
        "models": {"target": args.model},
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeat": args.repeats,
        "temperature": 0.0,
    }
    results = {"meta": meta, "constrained": {"methods": methods, "prompts": prompts}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(
        f"{meta['date']} · `{meta['command']}`\n\n" + "\n".join(report_table(results)) + "\n"
    )
    print("\n".join(report_table(results)))
