"""Prompt time of a long prompt: a fresh prefill (cache miss) against the same prefix reused from the prefix cache
(a hit: only the question after it is prefilled), through `LLM.generate` as a server request runs it.

    python scripts/prefill_cache.py -m qwen2.5-coder-1.5b --tokens 800 --runs 5 --out prefill.json
    python scripts/prefill_cache.py --fast-prefill ...   # the opt-in prefill arithmetic (`--fast-prefill`) instead

The prompt is a document of --tokens tokens (numbered facts) and then a question; a miss asks with the cache
emptied, a hit asks another question after the same document. Prints and writes the per-run prefill seconds, their
medians and whether the hit's tokens equal a fresh prefill's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import specdec
from specdec.runtime import kernels


def document(llm: specdec.LLM, tokens: int) -> str:
    """Numbered facts, cut to `tokens` tokens of this tokenizer."""
    facts = " ".join(f"Fact {i}: the river number {i} flows {10 + i} miles past village {i % 7}." for i in range(400))
    return llm.tokenizer.decode(llm.encode(facts)[:tokens])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=800, help="document tokens (the shared prefix)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--fast-prefill", action="store_true", help="the opt-in fast prefill arithmetic")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    llm = specdec.LLM(
        args.model, spec_type="none", cache_mb=512, threads=args.threads, fast_prefill=args.fast_prefill, progress=False
    )
    doc = document(llm, args.tokens)
    miss, hit, same = [], [], []
    for i in range(args.runs + 1):  # the first round warms up
        first, second = (f"{doc}\nQuestion {i}: {q}?\nAnswer:" for q in ("which river is longest", "which is first"))
        llm.prefix_cache.clear()
        llm.generate(first, max_tokens=8)  # a miss; keeps the document's blocks
        cached = llm.generate(second, max_tokens=8)  # a hit: the document reused
        llm.prefix_cache.clear()
        fresh = llm.generate(second, max_tokens=8)  # a miss
        same.append(cached.token_ids == fresh.token_ids)
        if i:
            miss.append(fresh.stats.prefill_s)
            hit.append(cached.stats.prefill_s)
    out = {
        "model": args.model,
        "prompt_tokens": len(llm.encode(doc)),
        "threads": args.threads,
        "fast_prefill": args.fast_prefill,
        "kernels": kernels.describe(),
        "miss_s": [round(x, 4) for x in miss],
        "hit_s": [round(x, 4) for x in hit],
        "miss_median_s": round(statistics.median(miss), 4),
        "hit_median_s": round(statistics.median(hit), 4),
        "hit_speedup": round(statistics.median(miss) / statistics.median(hit), 2),
        "hit_tokens_equal_fresh": all(same),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
