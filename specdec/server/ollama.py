"""Ollama's API over the same handler as the OpenAI routes: `/api/chat` and `/api/generate` (NDJSON streaming
by default, `"stream": false` for one object), `/api/tags`, `/api/show`, `/api/version`. Bodies become OpenAI
ones; answers and errors (`{"error": "..."}`) are Ollama's (docs/compat.md)."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

import specdec
from specdec import tools
from specdec.constraint import GrammarError
from specdec.errors import SpecdecError
from specdec.harmony import HarmonyStream, answer_parts
from specdec.server.protocol import (
    EXTENSIONS,
    APIError,
    ChatRequest,
    CompletionRequest,
    openai_body,
    refuse_unsupported,
    response_stats,
    sampling_fields,
)

if TYPE_CHECKING:
    from specdec.engine.scheduler import Request
    from specdec.server.handler import Handler

# options that would change the output distribution, with their no-op values (others: the OpenAI rule)
NEUTRAL = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "mirostat": 0,
}
# what a request may not ask for (no-op values pass): name -> why
UNSUPPORTED = {
    "images": "images",
    "think": "thinking",
    "suffix": "fill-in-the-middle (suffix)",
    "template": "a custom template",
    "logprobs": "logprobs on /api/* (ask /v1/chat/completions)",
}
NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "prompt": "prompt",
}  # our field -> Ollama's, in errors


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None


class _OllamaBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    stream: StrictBool = True
    options: dict[str, Any] | None = None
    keep_alive: Any = None  # the model stays loaded: ignored


class OllamaChat(_OllamaBody):
    messages: list[OllamaMessage] = Field(default_factory=list)


class OllamaGenerate(_OllamaBody):
    prompt: str = ""
    system: str | None = None
    raw: StrictBool = False
    context: list[StrictInt] | None = None  # token ids a previous answer returned


def add_routes(app: FastAPI, h: Handler) -> None:
    """Ollama's routes and error format on `app`, served by `h` (specdec.server.handler.Handler)."""
    app.state.error_bodies["/api/"] = error_body

    @app.post("/api/chat")
    async def chat(body: OllamaChat, http: HTTPRequest, scope: int | None = Depends(h.auth)):
        if not body.messages:
            return _loaded(h, body)
        extra = {**(body.model_extra or {}), **(body.options or {})}
        offered, choice = extra.get("tools"), extra.get("tool_choice")  # tool_choice: OpenAI's, an extension here
        fields = {**_fields(h, body), "messages": [_message(m) for m in body.messages], "tools": offered}
        fields.update({"tool_choice": choice} if choice is not None else {})
        openai = openai_body(ChatRequest, fields, NAMES)
        try:
            names = tools.names(offered or [])
        except GrammarError as e:
            raise APIError(400, str(e), "tools") from None
        return await h.chat(
            openai,
            http,
            scope,
            _Wire(
                body.model or _tagged(h.cfg.model_id),
                chat=True,
                tool_names=names,
                harmony=HarmonyStream.of(h.llm.tokenizer),
            ),
        )

    @app.post("/api/generate")
    async def generate(body: OllamaGenerate, http: HTTPRequest, scope: int | None = Depends(h.auth)):
        if not body.prompt:
            return _loaded(h, body)
        fields = _fields(h, body)  # checks come before tokenizing
        ids = await asyncio.to_thread(_generate_ids, h.llm, body)
        openai = openai_body(CompletionRequest, {**fields, "prompt": ids}, NAMES)
        return await h.completions(openai, http, scope, _Wire(body.model or _tagged(h.cfg.model_id), chat=False))

    @app.get("/api/tags", dependencies=[Depends(h.auth)])
    async def tags():
        name = _tagged(h.cfg.model_id)
        return {
            "models": [
                {"name": name, "model": name, "modified_at": _now(), "size": 0, "digest": "", "details": _details(h)}
            ]
        }

    @app.get("/api/ps", dependencies=[Depends(h.auth)])
    async def ps():
        """The running model: this server's one, always loaded."""
        name = _tagged(h.cfg.model_id)
        return {
            "models": [
                {
                    "name": name,
                    "model": name,
                    "size": 0,
                    "digest": "",
                    "details": _details(h),
                    "expires_at": "9999-12-31T23:59:59Z",
                    "size_vram": 0,
                    "context_length": h.llm.context,
                }
            ]
        }

    @app.post("/api/show", dependencies=[Depends(h.auth)])
    async def show(body: _OllamaBody):
        """The model's details, chat template and context length (clients read `<arch>.context_length`)."""
        if _model(h, body) != h.cfg.model_id:
            raise APIError(
                404, f"model {body.model!r} not found (this server has {_tagged(h.cfg.model_id)!r})", "model"
            )
        arch = h.llm.runner.model.config.model_type
        return {
            "modified_at": _now(),
            "template": h.llm.tokenizer.chat_template or "",
            "modelfile": "",
            "parameters": "",
            "details": _details(h),
            "capabilities": ["completion"],
            "model_info": {"general.architecture": arch, f"{arch}.context_length": h.llm.context},
        }

    @app.get("/api/version")
    async def version():
        return {"version": specdec.__version__}


def _details(h: Handler) -> dict:
    return {
        "format": "specdec",
        "family": h.llm.runner.model.config.model_type,
        "parameter_size": "",
        "quantization_level": h.llm.quant,
    }


def error_body(e: APIError) -> dict:
    """Ollama's error format."""
    return {"error": e.message}


def _fields(h: Handler, body: _OllamaBody) -> dict[str, Any]:
    """The OpenAI body's fields from an Ollama body: sampling from `options`, speculation (`speculative`,
    transformers' words) from the body or its options; what we cannot honour is a 400."""
    options = body.options or {}
    extra = {**(body.model_extra or {}), **options}
    for key, why in UNSUPPORTED.items():
        if extra.get(key):
            raise APIError(400, f"{why} is not supported by specdec", key)
    refuse_unsupported(options, NEUTRAL, "options.")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or num_ctx > h.llm.context):
        raise APIError(
            400,
            f"options.num_ctx={num_ctx!r}: this server's context is {h.llm.context} tokens per slot "
            "(specdec serve -c); ask for at most that",
            "options.num_ctx",
        )
    return {
        **sampling_fields(options, "num_predict", h.llm.context),
        **_format(extra.get("format")),
        "model": _model(h, body),
        "stream": body.stream,
        **{k: extra[k] for k in EXTENSIONS if k in extra},
    }


def _format(value: Any) -> dict[str, Any]:
    """Ollama's `format` ("json", or a JSON schema) as OpenAI's `response_format`."""
    if not value:
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise APIError(400, 'format must be "json" or a JSON schema', "format")


def _model(h: Handler, body: _OllamaBody) -> str | None:
    """The model asked for, with Ollama's default tag `:latest` on our id taken as our id."""
    return h.cfg.model_id if body.model == _tagged(h.cfg.model_id) else body.model


def _tagged(model_id: str) -> str:
    return model_id if ":" in model_id else model_id + ":latest"


def _message(m: OllamaMessage) -> dict[str, Any]:
    """An Ollama message as OpenAI's: its tool calls' arguments (objects) as JSON strings."""
    if m.images:
        raise APIError(400, "images are not supported by specdec", "messages")
    calls = [
        {
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments") or {})},
        }
        for c in m.tool_calls or []
        if isinstance(c, dict) and isinstance(c.get("function"), dict) and "name" in c["function"]
    ]
    if len(calls) != len(m.tool_calls or []):
        raise APIError(400, 'each tool call must be {"function": {"name": ..., "arguments": {...}}}', "messages")
    return {"role": m.role, "content": m.content} | ({"tool_calls": calls} if calls else {})


def _generate_ids(llm, body: OllamaGenerate) -> list[int]:
    """/api/generate's prompt: in the chat template with `system` (as Ollama), as is with `raw` or when the model has
    none (Ollama's default template is the prompt alone); after the `context` a previous answer returned."""
    if body.raw or not llm.tokenizer.chat_template:
        ids = llm.encode(body.prompt)
    else:
        try:
            ids = llm.encode(body.prompt, chat=True, system=body.system)
        except SpecdecError as e:
            raise APIError(400, str(e), "prompt") from None
    return list(body.context or []) + ids


def _loaded(h: Handler, body: _OllamaBody) -> dict:
    """Ollama answers an empty prompt or conversation by loading the model: here it is loaded already."""
    model = _model(h, body)
    if model is not None and model != h.cfg.model_id:
        raise APIError(404, f"model {body.model!r} not found (this server has {_tagged(h.cfg.model_id)!r})", "model")
    text = {"message": {"role": "assistant", "content": ""}} if isinstance(body, OllamaChat) else {"response": ""}
    return {"model": body.model, "created_at": _now(), **text, "done": True, "done_reason": "load"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(ms: float) -> int:
    return int(ms * 1_000_000)


class _Wire:
    """Ollama's answer: NDJSON lines {"model", "created_at", "message" | "response", "done": false}, then one
    with done true, done_reason and the durations (ns); the same fields in one object when not streamed."""

    media_type = "application/x-ndjson"

    def __init__(
        self, model: str, chat: bool, tool_names: list[str] | None = None, harmony: HarmonyStream | None = None
    ):
        self.model, self.chat = model, chat
        self.tools = tool_names or []  # functions the answer may call: parsed into `tool_calls`
        self.harmony = harmony  # gpt-oss: its analysis channel goes out as the message's `thinking`
        self.calls = tools.CallStream(self.tools)  # a streamed answer's calls, each sent as it closes
        self.rid = "ollama-" + uuid.uuid4().hex[:24]

    def _part(self, text: str, done: bool, calls: list[tools.ToolCall] | None = None, thinking: str = "") -> dict:
        body = {"message": self._assistant(text, calls or [], thinking)} if self.chat else {"response": text}
        return {"model": self.model, "created_at": _now(), **body, "done": done}

    @staticmethod
    def _assistant(content: str, calls: list[tools.ToolCall], thinking: str = "") -> dict:
        """The assistant message with its reasoning and its tool calls (arguments as objects)."""
        message = {"role": "assistant", "content": content} | ({"thinking": thinking} if thinking else {})
        if calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message

    def opening(self) -> list[str]:
        return []

    def piece(self, delta: str, toks: list[int], lps: list, trace: Any) -> str:
        if self.harmony is not None:  # gpt-oss: from its ids; header ids make nothing
            thinking, text, calls = self.harmony.feed(toks)
            return _line(self._part(text, False, calls, thinking)) if thinking or text or calls else ""
        if not self.tools:
            return _line(self._part(delta, False))
        text, calls = self.calls.feed(delta)  # content once it cannot be a call; each call as it closes
        return _line(self._part(text, False, calls)) if text or calls else ""

    def closing(self, req: Request, events: Any, err: APIError | None) -> list[str]:
        if err:
            return [_line(error_body(err))]
        return [_line(self._final(req, *self.calls.finish()) if self.tools else self._final(req, ""))]

    def response(self, req: Request) -> dict:
        content, calls, thinking = answer_parts(req.seq.output_ids, req.seq.text, self.tools, self.harmony)
        return self._final(req, content or "", calls, thinking)

    def _final(self, req: Request, text: str, calls: list[tools.ToolCall] | None = None, thinking: str = "") -> dict:
        """The last part: why it ended, the counts and durations; /api/generate's `context`; specdec's stats."""
        stats = response_stats(req)
        t = stats["timings"]
        out = {
            **self._part(text, True, calls, thinking),
            "done_reason": req.seq.finish_reason,
            "total_duration": _ns(t["prompt_ms"] + t["predicted_ms"]),
            "load_duration": 0,
            "prompt_eval_count": t["prompt_n"],
            "prompt_eval_duration": _ns(t["prompt_ms"]),
            "eval_count": t["predicted_n"],
            "eval_duration": _ns(t["predicted_ms"]),
        }
        if not self.chat:
            out["context"] = req.seq.tokens
        return {**out, **stats}


def _line(obj: dict) -> str:
    return json.dumps(obj) + "\n"
