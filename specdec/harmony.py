"""gpt-oss's output format (OpenAI's harmony): an answer is a run of messages, each `<|channel|>NAME<|message|>TEXT`
ended by `<|end|>` (then `<|start|>assistant` opens the next), `<|return|>` (the answer is done) or `<|call|>` (a
tool call). The `analysis` channel holds the model's reasoning, `final` what it says to the user; a message whose
header names a recipient (`<|channel|>commentary to=functions.NAME <|constrain|>json`) is a call of tool NAME with
its text as the JSON arguments. The markers are special tokens, so decoded text drops them and runs the channels
together ("analysis...assistantfinal..."); `HarmonyStream` reads the token ids instead and splits them, as they are
generated, into reasoning, content and calls, which the OpenAI routes send as `reasoning_content`, `content` and
`tool_calls` (llama-server's `--reasoning-format auto`).

    stream = HarmonyStream.of(tokenizer)  # None for a vocabulary without harmony's markers
    reasoning, content, calls = stream.feed(ids)  # each call: what these ids complete
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from specdec.models.tokenizer import Detokenizer, Tokenizer
from specdec.tools import ToolCall, parse

REASONING_CHANNELS = ("analysis",)
RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


class Split(NamedTuple):
    reasoning: str
    content: str
    calls: list[ToolCall]


@dataclass
class _Markers:
    start: int
    channel: int
    message: int
    ends: frozenset[int]  # <|end|>, <|return|>, <|call|>


@dataclass
class HarmonyStream:
    """One answer's ids -> reasoning, content and calls, fed in pieces. Ids between `<|start|>` and `<|message|>` are a
    message's header (`<|start|>assistant<|channel|>analysis`); ids after it its text, until an end marker. An answer
    that does not open with a marker is plain content throughout."""

    tokenizer: Tokenizer
    marks: _Markers
    plain: bool | None = None  # decided by the first id
    role: list[int] = field(default_factory=list)  # the current header's ids before <|channel|>
    channel_ids: list[int] | None = None  # and after it, once it came
    channel: str | None = None  # the current message's channel while in its text, else None
    tool: str | None = None  # the function the current message calls
    text: Detokenizer | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> HarmonyStream | None:
        ids = [tokenizer.token_id(t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")]
        if any(i is None for i in ids):
            return None
        call = tokenizer.token_id("<|call|>")
        ends = frozenset(i for i in (ids[3], ids[4], call) if i is not None)
        return cls(tokenizer, _Markers(ids[0], ids[1], ids[2], ends))

    def feed(self, ids: list[int]) -> Split:
        """The reasoning and content text and the calls these ids complete."""
        out = Split("", "", [])
        for i in ids:
            out = self._step(i, out)
        return out

    def _step(self, i: int, out: Split) -> Split:
        m = self.marks
        if self.plain is None:
            self.plain = i not in (m.start, m.channel)
            self.text = Detokenizer(self.tokenizer)
        if self.plain:
            return out._replace(content=out.content + self.text.push([i]))
        if i == m.message:
            self._open()
        elif i in m.ends or i == m.start:
            out = self._close(out)
        elif i == m.channel:
            self.channel_ids = []
        elif self.channel is None:
            (self.role if self.channel_ids is None else self.channel_ids).append(i)
        elif self.tool is None:
            text = self.text.push([i])
            if self.channel in REASONING_CHANNELS:
                return out._replace(reasoning=out.reasoning + text)
            return out._replace(content=out.content + text)
        else:
            self.text.push([i])
        return out

    def _open(self) -> None:
        """A message's text starts: its channel and recipient from the header."""
        decode = self.tokenizer.decode
        name = decode(self.channel_ids or []).split()
        self.channel = name[0] if name else "final"
        found = RECIPIENT.search(f"{decode(self.role)} {decode(self.channel_ids or [])}")
        self.tool = found.group(1) if found else None
        self.text, self.role, self.channel_ids = Detokenizer(self.tokenizer), [], None

    def _close(self, out: Split) -> Split:
        """A message ends (or the next one starts): a call's arguments are complete."""
        if self.tool is not None:
            try:
                arguments = json.loads(self.text.text)
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                out = out._replace(calls=[*out.calls, ToolCall(self.tool, arguments)])
            else:  # not a JSON object: the text as content
                out = out._replace(content=out.content + self.text.text)
        self.channel, self.tool, self.role, self.channel_ids = None, None, [], None
        return out


def answer_parts(
    ids: list[int], text: str, tool_names: list[str], stream: HarmonyStream | None
) -> tuple[str, list[ToolCall], str]:
    """A finished answer's (content, tool calls, reasoning): gpt-oss's from its ids through a fresh `stream`, else from
    its text; calls in the text parsed out where tools were offered."""
    reasoning, text, calls = stream.feed(ids) if stream else ("", text, [])
    content, parsed = parse(text, tool_names) if tool_names else (text, [])
    return content, calls + parsed, reasoning
