"""What speculation costs in a batch: B copies of one prompt stepped together by the engine (as the server's
continuous batching does), plain and with a spec type, the step counts and seconds summed over the steps.

    python scripts/batch_step.py                                    # the code-edit prompt, 2 sequences, none + draft
    python scripts/batch_step.py --batch 4 --spec-types none,suffix

Prints one line per spec type: prefill, decode seconds, steps, forward / draft / setup seconds (setup: a drafter's
catch-up on a new prompt), drafted tokens and the tokens of all forwards."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec.api import LLM
from specdec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def run(llm: LLM, spec_type: str, ids: list[int], batch: int, max_tokens: int) -> str:
    eng, drafter = llm.engine, None if spec_type == "none" else llm.drafter_for(spec_type)
    params = SamplingParams(max_tokens=max_tokens)
    seqs = [eng.new_sequence(ids, params, slot=i, drafter=drafter) for i in range(batch)]
    t = time.perf_counter()
    for s in seqs:
        eng.prefill(s)
    prefill, t = time.perf_counter() - t, time.perf_counter()
    steps = []
    while live := [s for s in seqs if s.finish_reason is None]:
        steps.append(eng.step(live))
    decode = time.perf_counter() - t
    for s in seqs:
        eng.finish(s)
    total = {
        k: sum(getattr(i, k) for i in steps) for k in ("forward_s", "draft_s", "setup_s", "drafted", "forward_tokens")
    }
    return (
        f"{spec_type}: prefill {prefill:.2f} s, decode {decode:.2f} s, {len(steps)} steps, forward "
        f"{total['forward_s']:.2f} s, draft {total['draft_s']:.2f} s, setup {total['setup_s']:.2f} s, drafted "
        f"{total['drafted']}, forward tokens {total['forward_tokens']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-file", default=str(ROOT / "docs/bench/code-edit.jsonl"), help="JSONL: its first prompt")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--spec-types", default="none,draft")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    prompt = json.loads(Path(args.prompt_file).read_text().splitlines()[0])["prompt"]
    llm = LLM(model="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", threads=args.threads, parallel=args.batch)
    ids = llm.encode(prompt, True, None)
    for spec_type in args.spec_types.split(","):
        print(run(llm, spec_type, ids, args.batch, args.max_tokens), flush=True)


if __name__ == "__main__":
    main()
