"""`specdec chat` (and `specdec generate -cnv` without a prompt): a conversation on stdin and stdout, as
`llama-cli -cnv` and `ollama run` hold one. Earlier turns' K/V stay in the prompt cache, so a turn prefills only
what is new since the last one. An answer's reasoning goes to stderr and its content to stdout: `<think>` blocks
(`specdec/think.py`) as they stream, a gpt-oss answer (harmony, `specdec/harmony.py`) when it ends."""

from __future__ import annotations

import sys
from typing import TextIO

from specdec.api import LLM, Result
from specdec.harmony import HarmonyStream
from specdec.think import ThinkStream

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


class _Shown:
    """An answer as it comes: its reasoning on stderr (after a "[reasoning]" mark), its content on stdout."""

    def __init__(self, out: TextIO, err: TextIO):
        self.out, self.err, self.reasoning = out, err, None  # None: none shown; True: its line is open

    def __call__(self, reasoning: str, content: str) -> None:
        if reasoning:
            print(reasoning if self.reasoning else f"[reasoning] {reasoning}", end="", file=self.err, flush=True)
            self.reasoning = True
        if content:
            self.close()
            print(content, end="", file=self.out, flush=True)

    def close(self) -> None:
        """End the reasoning's line on stderr."""
        if self.reasoning:
            print(file=self.err, flush=True)
            self.reasoning = False


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
        ids = llm.encode_chat(messages)
        harmony = HarmonyStream.of(llm.tokenizer)
        think = None if harmony else ThinkStream.of(llm.tokenizer, ids)
        show = _Shown(out, err)
        stream = None if harmony else lambda s: show(*(think.feed(s) if think else ("", s)))
        r = llm.generate(ids, on_text=stream, **sampling)
        answer = r.text
        if harmony is not None:
            reasoning, answer, _ = harmony.feed(r.token_ids)
            show(reasoning, answer)
        elif think is not None:
            show(*think.finish())
            answer = think.split(r.text)[1]
        show.close()
        print(file=out, flush=True)
        print(footer(llm, r), file=err, flush=True)
        messages.append({"role": "assistant", "content": answer})
