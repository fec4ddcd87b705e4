"""gpt-oss's output format (OpenAI's harmony): an answer is a run of messages, each `<|channel|>NAME<|message|>TEXT`
ended by `<|end|>` (then `<|start|>assistant` opens the next), `<|return|>` (the answer is done) or `<|call|>` (a
tool call). The `analysis` channel holds the model's reasoning, `final` (and `commentary`) what it says to the user.
The markers are special tokens, so decoded text drops them and runs the channels together ("analysis...assistantfinal
..."); `HarmonyStream` reads the token ids instead and splits them, as they are generated, into reasoning and content
text, which the OpenAI routes send as `reasoning_content` and `content` (llama-server's `--reasoning-format auto`).

    stream = HarmonyStream.of(tokenizer)  # None for a vocabulary without harmony's markers
    reasoning, content = stream.feed(ids)  # each call: the text completed by these ids
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.models.tokenizer import Detokenizer, Tokenizer

REASONING_CHANNELS = ("analysis",)


@dataclass
class _Markers:
    start: int
    channel: int
    message: int
    ends: frozenset[int]  # <|end|>, <|return|>, <|call|>


@dataclass
class HarmonyStream:
    """One answer's ids -> (reasoning, content) text, fed in pieces. Ids before a message's `<|message|>` are its header
    (`<|start|>assistant<|channel|>analysis`); ids after it its text, until an end marker. An answer that does not open
    with a marker is plain content throughout."""

    tokenizer: Tokenizer
    marks: _Markers
    plain: bool | None = None  # decided by the first id
    header: list[int] = field(default_factory=list)  # the current message's header ids since <|start|> / <|channel|>
    channel: str | None = None  # the current message's channel while in its text, else None
    text: Detokenizer | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> HarmonyStream | None:
        ids = [tokenizer.token_id(t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")]
        if any(i is None for i in ids):
            return None
        call = tokenizer.token_id("<|call|>")
        ends = frozenset(i for i in (ids[3], ids[4], call) if i is not None)
        return cls(tokenizer, _Markers(ids[0], ids[1], ids[2], ends))

    def feed(self, ids: list[int]) -> tuple[str, str]:
        """The reasoning and content text these ids complete."""
        out = {True: "", False: ""}  # keyed by "is reasoning"
        m = self.marks
        for i in ids:
            if self.plain is None:
                self.plain = i not in (m.start, m.channel)
                self.text = Detokenizer(self.tokenizer) if self.plain else None
            if self.plain:
                out[False] += self.text.push([i])
            elif i == m.message:
                name = self.tokenizer.decode(self.header).split()
                self.channel, self.text = (name[0] if name else "final"), Detokenizer(self.tokenizer)
                self.header = []
            elif i in m.ends or i in (m.start, m.channel):
                self.channel, self.header = None, []
            elif self.channel is not None:
                out[self.channel in REASONING_CHANNELS] += self.text.push([i])
            else:
                self.header.append(i)
        return out[True], out[False]
