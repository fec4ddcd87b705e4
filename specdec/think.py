"""Reasoning between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills): `ThinkStream` splits an
answer's text as it streams into reasoning and content, holding back a tag that is still arriving, which the OpenAI
chat route sends as `reasoning_content` and `content` (llama-server's `--reasoning-format auto`). An answer that opens
with `<think>` (after whitespace), or whose prompt ends inside one (a template that opens the block itself), reasons
until `</think>`, and its content starts at the next visible character; any other answer is content throughout.

    stream = ThinkStream.of(tokenizer, prompt_ids)  # None for a vocabulary without the two tags
    reasoning, content = stream.feed(text)  # each piece of text; then stream.finish() for what is held
"""

from __future__ import annotations

from specdec.models.tokenizer import Tokenizer
from specdec.tools import tag_prefix

OPEN, CLOSE = "<think>", "</think>"


class ThinkStream:
    def __init__(self, open_in_prompt: bool = False):
        self.open_in_prompt = open_in_prompt
        self.mode = "think" if open_in_prompt else "start"  # start -> think -> trim -> answer, or start -> answer
        self.held = ""

    @classmethod
    def of(cls, tokenizer: Tokenizer, prompt_ids: list[int]) -> ThinkStream | None:
        if tokenizer.token_id(OPEN) is None or tokenizer.token_id(CLOSE) is None:
            return None
        tail = tokenizer.fast.decode(prompt_ids[-8:], skip_special_tokens=False)
        return cls(open_in_prompt=tail.rstrip().endswith(OPEN))

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send after `text`."""
        self.held += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held when the answer ends."""
        return self._drain(final=True)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, content), read by a fresh stream that starts as this one did."""
        stream = ThinkStream(self.open_in_prompt)
        (r1, c1), (r2, c2) = stream.feed(text), stream.finish()
        return r1 + r2, c1 + c2

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self.mode == "start":  # before the first visible character: does the answer open a block?
                head = self.held.lstrip()
                if head.startswith(OPEN):
                    self.mode, self.held = "think", head[len(OPEN) :]
                elif not final and (not head or OPEN.startswith(head)):
                    return reasoning, content
                else:
                    self.mode = "answer"
            elif self.mode == "think":
                end = self.held.find(CLOSE)
                if end < 0:
                    keep = 0 if final else tag_prefix(self.held, CLOSE)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    return reasoning, content
                reasoning, self.held, self.mode = reasoning + self.held[:end], self.held[end + len(CLOSE) :], "trim"
            elif self.mode == "trim":  # the whitespace between the block and the content
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, content
                self.mode = "answer"
            else:
                content, self.held = content + self.held, ""
                return reasoning, content
