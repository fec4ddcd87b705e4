"""Tool calls (OpenAI `tools` / `tool_choice`, Ollama `tools`): tools rendered through the model's chat template,
the answer's calls parsed back, and a grammar where a call is required.

The call format is Hermes' (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), which the Qwen2/2.5/3
and SmolLM3 templates ask for; a bare JSON object with `name` and `arguments` or `parameters` (Llama 3.x) and
Mistral's `[TOOL_CALLS] [...]` are parsed too. A template that does not take `tools` gets them in a system message
that asks for the Hermes format, as llama-server does for templates without tool support.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specdec.constraint import Grammar, GrammarError
from specdec.models.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)  # a call in a Markdown code block (coder models)


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def openai(self) -> dict:
        """As an OpenAI `tool_calls` entry (arguments as a JSON string)."""
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def names(tools: list[dict]) -> list[str]:
    """The function names of OpenAI-style tools ({"type": "function", "function": {"name": ...}})."""
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise GrammarError('each tool must be {"type": "function", "function": {"name": ..., ...}}')
        out.append(fn["name"])
    return out


def render_messages(messages: list[dict], tools: list[dict] | None, template: str) -> tuple[list[dict], list | None]:
    """Messages and tools as the chat template takes them: call arguments as objects (templates apply `tojson`);
    where the template does not read `tools`, the tools in a system message and earlier calls as Hermes text."""
    takes_tools = "tools" in template
    out = [_message(m, as_text=not takes_tools) for m in messages]
    if not tools or takes_tools:
        return out, tools or None
    prompt = system_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _message(m: dict, as_text: bool) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        return {**m, "content": m.get("content") or ""}
    parsed = [_call(c) for c in calls]
    if not as_text:
        return {**m, "content": m.get("content") or "", "tool_calls": parsed}
    text = "\n".join(
        f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n{CLOSE}"
        for c in parsed
    )
    return {"role": m["role"], "content": ((m.get("content") or "") + "\n" + text).strip()}


def _call(call: object) -> dict:
    """An earlier tool call as templates take it: its arguments as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise GrammarError('each tool call must be {"type": "function", "function": {"name": ..., "arguments": ...}}')
    return {**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}}


def _arguments(value: object) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError:
            raise GrammarError("tool call arguments must be a JSON object") from None
    return value if isinstance(value, dict) else {}


def system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions, within <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a JSON object with the function name and "
        f'arguments within {OPEN}{CLOSE} tags:\n{OPEN}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CLOSE}"
    )


def parse(text: str, known: list[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an answer: Hermes blocks, Mistral's list, or the whole answer as one call object (also in a
    ```json block)."""
    if OPEN in text:
        calls = [c for body in _BLOCK.findall(text) for c in _calls(body, known)]
        if calls:
            rest = _BLOCK.sub("", text).strip()
            return rest or None, calls
    body = (text.split(_MISTRAL, 1)[1] if _MISTRAL in text else text).strip()
    fenced = _FENCE.match(body)
    calls = _calls(fenced.group(1) if fenced else body, known)
    return (None, calls) if calls else (text, [])


class CallStream:
    """An answer as it streams, split into content to send now and tool calls as each one closes. Text that may still
    become a call is held: a partial `<tool_call>` tag, an open block, or an answer that opens like a bare call
    object (`{`, `[`, a code fence), which `parse` reads whole at the end."""

    def __init__(self, known: list[str]):
        self.known = known
        self.held = ""  # text not sent yet
        self.whole: bool | None = None  # the answer opens like a bare call; None until its first visible character

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send, calls completed) after `text`."""
        self.held += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) of what is still held when the answer ends."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[ToolCall]]:
        head = self.held.lstrip()
        if self.whole is None and head:
            self.whole = head[0] in "{[`"
        if self.whole or (self.whole is None and not final):
            if not final:
                return "", []
            content, calls = parse(self.held, self.known) if head else (self.held, [])
            return content or "", calls
        out, calls = "", []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = 0 if final else tag_prefix(self.held, OPEN)
                out, self.held = out + self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return out, calls
            stop = self.held.find(CLOSE, start)
            if stop < 0 and not final:
                out, self.held = out + self.held[:start], self.held[start:]
                return out, calls
            end = len(self.held) if stop < 0 else stop + len(CLOSE)
            found = _calls(self.held[start + len(OPEN) : end - (0 if stop < 0 else len(CLOSE))].strip(), self.known)
            out += self.held[:start] + ("" if found else self.held[start:end])
            calls += found
            self.held = self.held[end:]


def tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag still arriving)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def _calls(body: str, known: list[str]) -> list[ToolCall]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return []
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(item["name"], args if isinstance(args, dict) else {}))
    return calls


def grammar(tools: list[dict], choice: object, tokenizer: Tokenizer) -> Grammar | None:
    """The grammar of a required call (`tool_choice` "required" or a named function); None for "auto"/"none"."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        want = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == want]
        if not chosen:
            raise GrammarError(f"tool_choice names {want!r}, which is not among the tools")
    else:
        raise GrammarError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    schema = {
        "anyOf": [
            {
                "type": "object",
                "required": ["name", "arguments"],
                "additionalProperties": False,
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters") or {"type": "object"},
                },
            }
            for t in chosen
        ]
    }
    return Grammar.lark(
        f'start: {_marker(OPEN, tokenizer)} "\\n" call "\\n" {_marker(CLOSE, tokenizer)}\n'
        f"call: %json {json.dumps(schema)}"
    )


def _marker(text: str, tokenizer: Tokenizer) -> str:
    """A tag as the grammar matches it: the tokenizer's own token where it has one (Qwen's <tool_call>), else text."""
    token = tokenizer.token_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)
