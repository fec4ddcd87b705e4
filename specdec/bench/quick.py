"""`specdec bench --quick`: three built-in prompts, our methods and `transformers` generate."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from specdec.errors import SpecdecError

PROMPT_DIR = Path(__file__).parent / "prompts"
QUICK_NAMES = ("code-question", "code-edit", "summary")  # a code question, an edit that mostly copies, a summary
QUICK_PROMPTS = [(n, (PROMPT_DIR / f"{n}.txt").read_text()) for n in QUICK_NAMES]
OURS = ("none", "draft", "ngram-simple")
PEERS = ("hf-plain",)


class HFPlain:
    """`transformers` generate on the same checkpoint directory, dtype and threads (greedy)."""

    def __init__(self, checkpoint: str, dtype, stop_ids: set[int]):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
        self.stop_ids = sorted(stop_ids)

    def generate(self, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        import torch

        inp = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0])
        dt = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        while new and new[-1] in self.stop_ids:
            new.pop()
        return new, dt


def run_quick(a: argparse.Namespace) -> dict:
    from specdec.cli import build_llm
    from specdec.models.loader import resolve_model

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in OURS + PEERS]
    if bad:
        raise SpecdecError(f"unknown bench method(s) {', '.join(bad)} (choose from {', '.join(OURS + PEERS)})")
    if a.spec_type is None and "draft" in methods:
        a.spec_type = "draft"
    llm = build_llm(a)
    prompts = [(name, llm.encode(text, chat=True)) for name, text in QUICK_PROMPTS]
    hf = None
    if "hf-plain" in methods:
        hf = HFPlain(str(resolve_model(a.model or _default_target())), llm.dtype, llm.engine.stop_ids)
    print(f"warming up ({', '.join(methods)})...", file=sys.stderr)
    for m in methods:
        _run(llm, hf, m, prompts[0][1], 8)
    rows: dict[tuple[str, str], list[dict]] = {}
    for name, ids in prompts:
        for _ in range(a.repeat):
            for m in methods:  # interleaved so drift hits every method alike
                rows.setdefault((name, m), []).append(_run(llm, hf, m, ids, a.max_tokens))
                r = rows[(name, m)][-1]
                print(f"  {name:14} {m:13} {r['tokens_per_s']:7.2f} tok/s", file=sys.stderr)
    summary = _summarize(rows, methods, [n for n, _ in QUICK_PROMPTS])
    _print_table(summary, methods, [n for n, _ in QUICK_PROMPTS], a)
    return summary


def _default_target() -> str:
    from specdec.models.packs import DEFAULT_TARGET
    return DEFAULT_TARGET


def _run(llm, hf, method: str, ids: list[int], max_tokens: int) -> dict:
    if method == "hf-plain":
        tokens, dt = hf.generate(ids, max_tokens)
        return {"tokens": tokens, "tokens_per_s": len(tokens) / dt, "acceptance_rate": None, "mean_accept_len": None}
    r = llm.generate(ids, max_tokens=max_tokens, spec_type=method)
    return {"tokens": r.token_ids, "tokens_per_s": r.stats.tokens_per_s, "acceptance_rate": r.stats.acceptance_rate,
            "mean_accept_len": r.stats.mean_accept_len}


def _summarize(rows: dict, methods: list[str], names: list[str]) -> dict:
    out = {}
    for name in names:
        base = rows.get((name, "none"))
        for m in methods:
            runs = rows[(name, m)]
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            out[(name, m)] = {
                "tokens_per_s": tps, "min": min(r["tokens_per_s"] for r in runs),
                "max": max(r["tokens_per_s"] for r in runs),
                "speedup": tps / statistics.median(r["tokens_per_s"] for r in base) if base else None,
                "acceptance_rate": runs[0]["acceptance_rate"], "mean_accept_len": runs[0]["mean_accept_len"],
                "identical": all(r["tokens"] == base[0]["tokens"] for r in runs) if base else None,
                "new_tokens": len(runs[0]["tokens"]),
            }
    return out


def _print_table(summary: dict, methods: list[str], names: list[str], a: argparse.Namespace) -> None:
    import torch

    print(f"\nspecdec bench --quick  (dtype {a.dtype}, threads {torch.get_num_threads()}, -n {a.max_tokens}, "
          f"repeat {a.repeat}, greedy)")
    print(f"| prompt | method | new tokens | tok/s (median) | speedup vs none | accept rate | mean accept len "
          f"| identical to none |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for name in names:
        for m in methods:
            s = summary[(name, m)]
            ident = "-" if s["identical"] is None else ("yes" if s["identical"] else "NO")
            print(f"| {name} | {m} | {s['new_tokens']} | {s['tokens_per_s']:.2f} | {fmt(s['speedup'], '.2f')}x | "
                  f"{fmt(s['acceptance_rate'], '.0%')} | {fmt(s['mean_accept_len'], '.2f')} | {ident} |")
