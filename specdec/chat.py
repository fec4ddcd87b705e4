"""`specdec chat` (and `specdec generate -cnv` without a prompt): a conversation on stdin and stdout, as
`llama-cli -cnv` and `ollama run` hold one. Earlier turns' K/V stay in the prompt cache, so a turn prefills only
what is new since the last one. A gpt-oss answer (harmony, `specdec/harmony.py`) is printed when it ends: its
reasoning on stderr, its final text on stdout."""

from __future__ import annotations

import sys
from typing import TextIO

from specdec.api import LLM, Result
from specdec.harmony import HarmonyStream

HELP = "/bye or Ctrl-D: leave · /clear: forget the conversation · /help: this line"


def footer(llm: LLM, r: Result) -> str:
    """One line of what an answer cost: tokens, tok/s, drafting, and the flags that make it not plain decoding."""
    s = r.stats
    return (
        f"[{llm.spec_type}] {s.new_tokens} tokens in {s.total_s:.2f} s = {s.tokens_per_s:.2f} tok/s | "
        f"target forwards {s.target_forwards} | drafted {s.drafted} accepted {s.accepted} "
        f"({s.acceptance_rate:.0%}) | mean accept len {s.mean_accept_len:.2f}"
        + (" | SYNTHETIC drafts: not the target's text" if r.synthetic else "")
        + (" | FAST PREFILL: tokens may differ with chunking" if llm.config.fast_prefill else "")
        + (f" | LOSSY: {s.relaxed} drafts accepted by --spec-accept-threshold" if llm.config.accept_threshold else "")
    )


def run(
    llm: LLM,
    system: str | None = None,
    stdin: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    **sampling,
) -> int:
    """Answer each line of `stdin` in turn until /bye or end of input; `sampling`: LLM.generate's keywords."""
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    interactive = stdin.isatty()
    if interactive:
        print(HELP, file=err)
    while True:
        if interactive:
            print("> ", end="", file=out, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/bye":
            return 0
        text = line.strip()
        if text == "/clear":
            messages = list(start)
            print("conversation cleared", file=err)
            continue
        if text == "/help":
            print(HELP, file=err)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        harmony = HarmonyStream.of(llm.tokenizer)
        stream = None if harmony else (lambda s: print(s, end="", file=out, flush=True))
        r = llm.generate(llm.encode_chat(messages), on_text=stream, **sampling)
        answer = r.text
        if harmony is not None:
            reasoning, answer, _ = harmony.feed(r.token_ids)
            if reasoning:
                print(f"[reasoning] {reasoning}", file=err, flush=True)
            print(answer, end="", file=out)
        print(file=out, flush=True)
        print(footer(llm, r), file=err, flush=True)
        messages.append({"role": "assistant", "content": answer})
