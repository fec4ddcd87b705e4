"""`specdec generate | models | bench` with llama.cpp-style flags."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.errors import SpecdecError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def _unit_float(s: str) -> float:
    v = float(s)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {s}")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads models."""
    from specdec.drafters import SPEC_TYPES

    g = p.add_argument_group("models")
    g.add_argument("-m", "--model", help="target: model pack name, GGUF file or checkpoint directory "
                   "(default: qwen2.5-coder-1.5b with draft qwen2.5-coder-0.5b)")
    g.add_argument("-md", "--model-draft", dest="draft", help="draft model (same tokenizer as the target)")
    g.add_argument("-c", "--ctx-size", dest="context", type=_positive_int, default=4096, help="context length (default 4096)")
    g.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="compute dtype; auto = bf16 on CPUs with native bf16, else fp32")
    g.add_argument("-t", "--threads", type=_positive_int, help="CPU threads (default: torch's choice)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--spec-type", choices=SPEC_TYPES, help="drafter (default: draft with -md or no -m, else none)")
    s.add_argument("--draft-max", type=_positive_int, default=16, help="max drafted tokens per step (default 16)")
    s.add_argument("--draft-min", type=int, default=0, help="skip drafts shorter than this (default 0)")
    s.add_argument("--draft-p-min", type=_unit_float, default=0.0,
                   help="stop drafting when the draft's token probability falls below this (default 0)")
    s.add_argument("--draft-quant", choices=["int8", "none"], default="int8",
                   help="weights of the draft model: int8 (weight-only, faster on CPU; the output stays the "
                   "target's) or none (default int8)")
    s.add_argument("--spec-ngram-size-n", dest="ngram_n", type=_positive_int, default=3,
                   help="ngram-simple: tokens to match (default 3)")
    s.add_argument("--spec-ngram-size-m", dest="ngram_m", type=_positive_int, default=16,
                   help="ngram-simple: tokens to propose after a match (default 16)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", dest="max_tokens", type=_positive_int, default=128, help="max new tokens (default 128)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="seed for sampling (reproducible runs)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_llm(a: argparse.Namespace, progress: bool = True):
    from specdec.api import LLM

    return LLM(a.model, draft=a.draft, spec_type=a.spec_type, context=a.context, dtype=a.dtype, threads=a.threads,
               draft_max=a.draft_max, draft_min=a.draft_min, draft_p_min=a.draft_p_min, ngram_n=a.ngram_n,
               ngram_m=a.ngram_m, draft_quant=a.draft_quant, progress=progress)


def cmd_generate(a: argparse.Namespace) -> int:
    if (a.prompt is None) == (a.file is None):
        raise SpecdecError("give exactly one of -p PROMPT or -f FILE")
    if a.file is not None:
        try:
            prompt = Path(a.file).read_text()
        except OSError as e:
            raise SpecdecError(f"cannot read prompt file {a.file}: {e.strerror}") from None
    else:
        prompt = a.prompt
    llm = build_llm(a, progress=not a.json)
    stream = None if a.json else lambda s: print(s, end="", flush=True)
    r = llm.generate(prompt, max_tokens=a.max_tokens, temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                     min_p=a.min_p, seed=a.seed, stop=a.stop, chat=a.chat, system=a.system, on_text=stream)
    if a.json:
        keys = ("new_tokens", "target_forwards", "drafted", "accepted", "acceptance_rate", "mean_accept_len",
                "tokens_per_s")
        d = r.stats.to_dict()
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "stats": {k: d[k] for k in keys},
                          "timings": {k: d[k] for k in ("prefill_s", "draft_s", "verify_s", "total_s")},
                          "per_position_acceptance": d["per_position_acceptance"], "spec_type": llm.spec_type,
                          "finish_reason": r.finish_reason}))
    else:
        s = r.stats
        print(f"\n\n[{llm.spec_type}] {s.new_tokens} tokens in {s.total_s:.2f} s = {s.tokens_per_s:.2f} tok/s | "
              f"target forwards {s.target_forwards} | drafted {s.drafted} accepted {s.accepted} "
              f"({s.acceptance_rate:.0%}) | mean accept len {s.mean_accept_len:.2f}", file=sys.stderr)
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from specdec.models import packs

    if a.action == "list":
        for p in packs.PACKS.values():
            state = "pulled" if packs.is_pulled(p.name) else "not pulled"
            print(f"{p.name:22} {state:11} {p.description}")
        return 0
    for name in a.names or []:
        print(f"{name}: {packs.pull(name)}")
    if not a.names:
        raise SpecdecError("models pull needs at least one NAME")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from specdec.bench.quick import run_quick

    if not a.quick:
        raise SpecdecError("only `specdec bench --quick` is available in this version")
    run_quick(a)
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specdec", description="Lossless speculative decoding for local LLMs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("-p", "--prompt", help="prompt text")
    g.add_argument("-f", "--file", help="read the prompt from a file")
    g.add_argument("-cnv", "--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list or pull model packs")
    m.add_argument("action", choices=["list", "pull"])
    m.add_argument("names", nargs="*", help="pack names for pull")
    m.set_defaults(func=cmd_models)

    b = sub.add_parser("bench", help="measure tokens/s of speculative methods")
    b.add_argument("--quick", action="store_true", help="three built-in prompts on the default pair")
    b.add_argument("--methods", default="none,draft,ngram-simple,hf-plain",
                   help="comma-separated: none, draft, ngram-simple, hf-plain (default: all)")
    b.add_argument("--repeat", type=_positive_int, default=1, help="runs per prompt and method (median reported)")
    add_model_args(b)
    b.add_argument("-n", "--n-predict", dest="max_tokens", type=_positive_int, default=128)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
