"""The server's work behind the routes (`Handler`): auth and scopes, the plain endpoints, each request's
`RequestOptions` built once from its body, queueing it on the scheduler and answering it, whole or streamed, in
OpenAI's format (`_Formatter`) or another API's (`Wire`: ollama.py, llama_routes.py)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specdec import compat, tools
from specdec.constraint import Grammar, GrammarError, check, schema_text
from specdec.drafters import REGISTRY, Drafter, is_lossy
from specdec.engine.engine import PromptTooLong
from specdec.engine.scheduler import EngineStopped, QueueFull, Request, Scheduler
from specdec.errors import SpecdecError
from specdec.harmony import HarmonyStream, answer_parts
from specdec.sampling import SamplingParams
from specdec.sequence import RequestOptions, TokenTrace
from specdec.server.metrics import Metrics
from specdec.server.protocol import MAX_BODY, APIError, ChatRequest, CompletionRequest, Speculative, response_stats
from specdec.think import ThinkStream

log = logging.getLogger(__name__)
access = logging.getLogger("specdec.access")  # one line per request (`specdec serve` prints them on stderr)
_Body = CompletionRequest | ChatRequest


@dataclass
class ServerConfig:
    """Without `api_keys`, only requests whose Host header names `host`, a loopback name or one of
    `allowed_hosts` ('*': any) are answered; Starlette's TestClient sends `testserver` unless given a
    base_url such as http://localhost. Drafter memory is kept per key unless `shared_memory`."""

    model_id: str
    defaults: SamplingParams
    api_keys: tuple[str, ...] = ()
    graceful_s: float = 30.0
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    shared_memory: bool = False
    max_body: int = MAX_BODY
    allow_lossy: bool = False  # requests may ask for relaxed acceptance (speculative.accept_threshold)


class Wire(Protocol):
    """One API's answer format: OpenAI's (`_Formatter`), Ollama's (`ollama.py`), llama-server's (`llama_routes.py`)."""

    rid: str
    media_type: str  # of a stream

    def opening(self) -> list[str]:
        """Stream lines before any text."""

    def piece(self, delta: str, toks: list[int], lps: list, trace: list[TokenTrace] | None) -> str:
        """The stream line for a piece of new text."""

    def closing(self, req: Request, events: _Events, err: APIError | None) -> list[str]:
        """The stream's last lines: stats, or the request's error."""

    def response(self, req: Request) -> dict:
        """The whole answer (not streamed)."""


class Handler:
    """The server's state and its work, one method per concern; the routes of `create_app` only call it."""

    def __init__(self, llm, scheduler: Scheduler, cfg: ServerConfig):
        self.llm, self.scheduler, self.cfg = llm, scheduler, cfg
        self.metrics = Metrics(scheduler)
        self.digests = [_digest(k.encode()) for k in cfg.api_keys]

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        """Run the engine thread while the app runs; on shutdown, finish in-flight work for `graceful_s`."""
        self.scheduler.start()
        yield
        await asyncio.to_thread(self.scheduler.stop, False, self.cfg.graceful_s)

    # -- auth and scope ---------------------------------------------------------------------
    async def auth(self, req: HTTPRequest) -> int | None:
        """Check the API key (when the server has keys); return the request's drafter-memory scope: the
        key's index, or None (one scope for all) without keys or with shared memory."""
        if not self.cfg.api_keys:
            return None
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        presented = _digest(token.encode("latin-1"))
        hits = [hmac.compare_digest(presented, d) for d in self.digests]  # every key, no early exit
        if scheme.lower() != "bearer" or not any(hits):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        return None if self.cfg.shared_memory else hits.index(True)

    # -- plain endpoints --------------------------------------------------------------------
    def health(self) -> dict | JSONResponse:
        if self.scheduler.fatal:
            return JSONResponse({"status": "error", "error": "the engine has stopped", **self.scheduler.load}, 503)
        return {"status": "ok", **self.scheduler.load}

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.cfg.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "specdec",
                    "max_model_len": self.llm.context,
                }
            ],
        }

    def drafters(self) -> dict:
        """The spec types a request may ask for (`speculative.type`), with their options, from the registry."""
        llm = self.llm
        types = [
            {
                "name": t.name,
                "help": t.help,
                "lossy": t.lossy,
                "draft_model": t.draft_model,
                "target_features": t.target_features,
                "options": [
                    {
                        "name": o.name,
                        "flag": o.flag,
                        "default": o.default,
                        "value": llm.config.drafter[o.name],
                        "help": o.help,
                        "rule": o.rule,
                        "per_request": o in t.request_options,
                    }
                    for o in t.options
                ],
            }
            for t in REGISTRY.types.values()
            if not t.lossy or t.name == llm.spec_type
        ]
        return {
            "server": {
                "type": llm.spec_type,
                "draft_max": llm.engine.spec.draft_max,
                "draft_model": llm.config.draft is not None,
            },
            "types": types,
        }

    def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # -- request parsing --------------------------------------------------------------------
    async def completions(
        self, body: CompletionRequest, http: HTTPRequest, scope: int | None, wire: Wire | None = None
    ) -> dict | StreamingResponse:
        """A completion, answered in OpenAI's format or `wire`'s (the other APIs' routes convert their bodies)."""
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        ids = await asyncio.to_thread(self._prompt_ids, body.prompt)  # off the event loop: prompts can be long
        return await self._serve(http, body, ids, chat=False, scope=scope, wire=wire)

    async def chat(
        self, body: ChatRequest, http: HTTPRequest, scope: int | None, wire: Wire | None = None
    ) -> dict | StreamingResponse:
        """A chat completion, answered in OpenAI's format or `wire`'s; `tools` rendered into the prompt."""
        try:
            names = tools.names(body.tools or [])
        except GrammarError as e:
            raise APIError(400, str(e), "tools") from None
        try:
            ids = await asyncio.to_thread(self.llm.encode_chat, body.chat_messages(), body.offered_tools())
        except SpecdecError as e:
            raise APIError(400, str(e), "messages") from None
        called = names if body.offered_tools() else []
        return await self._serve(http, body, ids, chat=True, scope=scope, wire=wire, tool_names=called)

    def _prompt_ids(self, prompt: str | list[int] | list[str]) -> list[int]:
        """A completion's prompt (text, a one-element list of text, or token ids) as token ids."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            return self.llm.encode(prompt)
        vocab = self.llm.runner.vocab_size
        if not prompt or not all(0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be a non-empty list in [0, {vocab})", "prompt")
        return list(prompt)

    # -- the request's options --------------------------------------------------------------
    async def _options(self, body: _Body, ids: list[int], chat: bool, scope: int | None) -> RequestOptions:
        """The request's options, built once from its body and checked: sampling (model, parameters and prompt length
        known good), speculation, logprobs, its trace and the prefix cache (scoped by `scope`, the API key's)."""
        params = self._params(body, ids, chat)
        spec = self._requested(body)
        drafter = await self._drafter(spec, scope)
        logprobs, top = body.logprobs_asked()
        return RequestOptions(
            params,
            drafter,
            draft_max=self._draft_max(spec),
            accept_threshold=spec.accept_threshold if isinstance(spec, Speculative) else None,
            logprobs=logprobs,
            top_logprobs=top,
            trace=body.specdec_trace,
            cache_prompt=body.cache_prompt,
            cache_salt=scope,
            grammar=self._grammar(body),
        )

    def _grammar(self, body: _Body) -> Grammar | None:
        """What the output must match: `response_format`, llama-server's `json_schema` or `grammar`, or a tool call
        (`tool_choice` "required" or a named function); at most one of them, compiled against the tokenizer."""
        asked: dict[str, Callable[[], Grammar | None]] = {}
        form = body.response_format
        if form is not None and form.type == "json_object":
            asked["response_format"] = Grammar.json_schema
        if form is not None and form.type == "json_schema":
            if form.json_schema is None:
                raise APIError(400, "response_format json_schema needs its json_schema.schema", "response_format")
            asked["response_format"] = lambda: Grammar.json_schema(form.json_schema.json_schema)
        if body.json_schema is not None:
            asked["json_schema"] = lambda: Grammar.json_schema(schema_text(body.json_schema))
        if body.grammar:
            asked["grammar"] = lambda: Grammar.gbnf(body.grammar)
        if isinstance(body, ChatRequest) and body.tools and body.tool_choice not in (None, "auto", "none"):
            asked["tool_choice"] = lambda: tools.grammar(body.tools, body.tool_choice, self.llm.tokenizer)
        if len(asked) > 1:
            raise APIError(400, f"give one of {', '.join(asked)}, not several", next(iter(asked)))
        if asked and isinstance(body, ChatRequest) and HarmonyStream.of(self.llm.tokenizer) is not None:
            field = next(iter(asked))
            raise APIError(400, f"{field}: this model answers in harmony channels; no constrained chat yet", field)
        for field, build in asked.items():
            try:
                grammar = build()
                check(grammar, self.llm.tokenizer, self.llm.runner.vocab_size, self.llm.engine.stop_ids)
            except GrammarError as e:
                raise APIError(400, str(e), field) from None
            return grammar
        return None

    def _params(self, body: _Body, ids: list[int], chat: bool) -> SamplingParams:
        """The request's sampling parameters, once its model, parameters and prompt length are known good."""
        if body.model is not None and body.model != self.cfg.model_id:
            raise APIError(
                404,
                f"the model `{body.model}` does not exist (this server has `{self.cfg.model_id}`)",
                "model",
                "model_not_found",
            )
        params = body.sampling(self.cfg.defaults)
        self._check(ids, params, chat)
        return params

    def _check(self, ids: list[int], params: SamplingParams, chat: bool) -> None:
        """What the engine refuses at admission, answered 400 before the request is queued (on the engine
        thread the same failure would be a 500)."""
        try:
            self.llm.engine.check(ids, params)
        except PromptTooLong as e:
            raise APIError(
                400,
                f"the prompt has {e.tokens} tokens but the context is {e.context} tokens per slot "
                "(at least one free position is needed)",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            ) from None
        except SpecdecError as e:
            raise APIError(400, str(e)) from None

    def _requested(self, body: _Body) -> bool | Speculative | None:
        """The `speculative` field, or one made from transformers' assisted-generation words in the body
        (compat.HF_WORDS): a request may change the spec type and draft_max; the rest must be the server's."""
        words = {k: v for k, v in (body.model_extra or {}).items() if k in compat.HF_WORDS}
        if not words:
            return body.speculative
        if body.speculative is not None:
            raise APIError(
                400, f"give either speculative or transformers' words ({', '.join(words)}), not both", "speculative"
            )
        try:
            got = compat.for_request(words, self.llm.config.settings())
        except SpecdecError as e:
            raise APIError(400, str(e), next(iter(words))) from None
        # checked by compat; built unvalidated since the words' draft_max may exceed the field's bound before the cap
        return Speculative.model_construct(type=got.get("spec_type"), draft_max=got.get("draft_max"))

    def _draft_max(self, spec: bool | Speculative | None) -> int | None:
        """The request's cap on drafted tokens per step, never above the server's --draft-max (None: the server's)."""
        asked = spec.draft_max if isinstance(spec, Speculative) else None
        return None if asked is None else min(asked, self.llm.engine.spec.draft_max)

    async def _drafter(self, spec: bool | Speculative | None, scope: int | None) -> Drafter | None:
        """The drafter the `speculative` field asks for (relaxed acceptance only with --allow-lossy, a lossy type only
        the server's own); drafters that learn across requests are per scope."""
        llm = self.llm
        if spec is None or spec is True:
            return await asyncio.to_thread(llm.drafter_for, llm.spec_type, scope)
        if spec is False:
            return None
        if spec.accept_threshold and not self.cfg.allow_lossy:
            raise APIError(
                400,
                "relaxed acceptance changes the output: the server takes speculative.accept_threshold "
                "only when started with --allow-lossy",
                "speculative.accept_threshold",
            )
        kind = spec.type or llm.spec_type
        try:
            lossy = is_lossy(kind)
        except SpecdecError as e:
            raise APIError(400, str(e), "speculative.type") from None
        if lossy and llm.spec_type != kind:
            raise APIError(400, f"lossy spec type {kind!r} only when the server is started with it", "speculative.type")
        try:
            return await asyncio.to_thread(llm.drafter_for, kind, scope, spec.options)
        except SpecdecError as e:
            raise APIError(400, str(e), "speculative.options" if spec.options else "speculative.type") from None

    # -- serving ----------------------------------------------------------------------------
    async def _serve(
        self,
        http: HTTPRequest,
        body: _Body,
        ids: list[int],
        chat: bool,
        scope: int | None,
        wire: Wire | None,
        tool_names: list[str] | None = None,
    ) -> dict | StreamingResponse:
        """Queue the request and answer it, streamed or whole, in `wire`'s format (None: OpenAI's); `tool_names`: the
        names of the functions its answer may call (parsed into `tool_calls`)."""
        req = Request(ids, await self._options(body, ids, chat, scope))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        events = _Events(req, lambda r: self._finished(r, rid, http.url.path))
        self._submit(req)
        usage = body.stream_options is not None and body.stream_options.include_usage
        fmt = wire or _Formatter(self.llm, self.cfg.model_id, rid, chat, usage, tool_names, ids)
        if body.stream:
            return StreamingResponse(self._stream(req, events, fmt), media_type=fmt.media_type)
        return await self._respond(http, req, events, fmt)

    def _finished(self, req: Request, rid: str, route: str) -> None:
        """Count a finished request (`/metrics`) and log its line: id, route, outcome, tokens, speed, speculation."""
        self.metrics.finished(req)
        seq = req.seq
        if seq is None:
            access.info("%s %s cancelled before it started", rid, route)
            return
        t = response_stats(req)["timings"]
        outcome = "error" if req.error else "cancelled" if req.cancelled else seq.finish_reason or "stop"
        access.info(
            "%s %s %s prompt %d (cached %d) generated %d %.1f tok/s drafted %d accepted %d",
            rid,
            route,
            outcome,
            seq.prompt_len,
            seq.cached_tokens,
            seq.stats.new_tokens,
            t["predicted_per_second"],
            seq.stats.drafted,
            seq.stats.accepted,
        )

    def _submit(self, req: Request) -> None:
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            self.metrics.rejected += 1
            raise APIError(429, str(e), code="queue_full") from None
        except EngineStopped as e:
            raise APIError(503, str(e), code="engine_stopped") from None

    async def _respond(self, http: HTTPRequest, req: Request, events: _Events, fmt: Wire) -> dict:
        """The whole completion, once the request is done; a client that leaves first cancels it."""
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, req))
        try:
            while await events.get() is not None:
                pass
        finally:
            watcher.cancel()
        if err := _failure(req, fmt.rid):
            raise err
        return fmt.response(req)

    async def _cancel_on_disconnect(self, http: HTTPRequest, req: Request) -> None:
        """The body is read: the next ASGI message is the client leaving."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self.scheduler.cancel(req)

    async def _stream(self, req: Request, events: _Events, fmt: Wire) -> AsyncIterator[str]:
        """The stream in `fmt`'s format: the text as it comes, then the stats or the error."""
        done = False
        try:
            for line in fmt.opening():
                yield line
            while (ev := await events.get()) is not None:
                yield fmt.piece(*ev)
            done = True
            for line in fmt.closing(req, events, _failure(req, fmt.rid)):
                yield line
        finally:
            if not done:  # the client went away: free the slot
                self.scheduler.cancel(req)


class _Events:
    """Carries one request's progress from the engine thread to the event loop: (text, token ids, logprobs)
    for each piece of new text, with the trace entries committed since the last piece (None unless asked for),
    then None when it is done, after `finished(req)` ran on the loop (the metrics: every request, its client
    gone or not). Hooks itself into `req`'s callbacks."""

    def __init__(self, req: Request, finished: Callable[[Request], None]):
        self.req, self.finished, self.sent, self.traced = req, finished, 0, 0  # logprobs, trace entries passed on
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        req.on_text, req.on_done = self._on_text, self._on_done

    async def get(self) -> tuple[str, list[int], list, list[TokenTrace] | None] | None:
        return await self.queue.get()

    def rest_of_trace(self) -> list[TokenTrace] | None:
        """Trace entries not passed on yet (tokens that added no text), once the request is done."""
        trace = self.req.seq.trace
        return None if trace is None else trace[self.traced :]

    def _on_text(self, delta: str) -> None:
        """Engine thread: snapshot the new tokens' logprobs and trace entries with the text."""
        seq, i = self.req.seq, self.sent
        lps = seq.logprobs[i:] if seq.logprobs is not None else []
        self.sent += len(lps)
        trace = None if seq.trace is None else seq.trace[self.traced :]
        self.traced += len(trace or ())
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (delta, seq.output_ids[i : i + len(lps)], lps, trace))

    def _on_done(self, req: Request) -> None:
        self.loop.call_soon_threadsafe(self.finished, req)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _failure(req: Request, rid: str) -> APIError | None:
    """Why a finished request has no completion to answer with (None: it has one)."""
    if req.error:
        return internal_error(rid, req.error)
    if req.seq is None:
        return APIError(503, "the request was cancelled before it started", code="cancelled")
    return None


def internal_error(rid: str, detail: str) -> APIError:
    """A 500 naming the request id; the detail (internal exception text) goes to the server log only."""
    log.error("request %s failed: %s", rid, detail)
    return APIError(500, f"internal server error (request id {rid}; details in the server log)", code="internal_error")


def _digest(secret: bytes) -> bytes:
    """SHA-256, so that key comparisons take the same time whatever the lengths."""
    return hashlib.sha256(secret).digest()


class _Formatter:
    """Builds OpenAI response objects (chat or text completion) for one request: a `Wire` (SSE, then [DONE])."""

    media_type = "text/event-stream"

    def __init__(
        self,
        llm,
        model_id: str,
        rid: str,
        chat: bool,
        usage: bool = False,
        tool_names: list[str] | None = None,
        prompt_ids: list[int] | None = None,
    ):
        self.llm, self.model_id, self.rid, self.chat = llm, model_id, rid, chat
        self.usage_chunk = usage  # stream_options.include_usage
        self.tools = tool_names or []  # functions the answer may call: parsed into `tool_calls`
        self.calls = tools.CallStream(self.tools)  # a streamed answer's calls, each sent as it closes
        self.sent_calls = 0
        self.created = int(time.time())
        # gpt-oss: the answer's analysis channel goes out as `reasoning_content`, its final channel as `content`
        self.harmony = HarmonyStream.of(llm.tokenizer) if chat else None
        # Qwen3, QwQ, DeepSeek-R1: what is between <think> and </think> goes out as `reasoning_content`
        self.think = ThinkStream.of(llm.tokenizer, prompt_ids or []) if chat and not self.harmony else None

    def opening(self) -> list[str]:
        return [_data(self.chunk({"role": "assistant", "content": ""}, [], [], None))] if self.chat else []

    def piece(self, delta: str, toks: list[int], lps: list, trace: list[TokenTrace] | None) -> str:
        if self.harmony is not None:  # gpt-oss: from its ids, calls parsed there (header ids make nothing)
            return self._split_piece(*self.harmony.feed(toks), toks, lps, trace)
        if self.think is not None:
            return self._split_piece(*self.think.feed(delta), None, toks, lps, trace)
        if self.tools:
            return self._tool_piece(*self.calls.feed(delta), toks, lps)
        return _data(self.chunk({"content": delta} if self.chat else delta, toks, lps, None, trace))

    def _split_piece(
        self, reasoning: str, content: str, calls: list[tools.ToolCall] | None, toks: list[int], lps: list, trace
    ) -> str:
        """An answer split into reasoning (its own chunk, carrying the tokens' logprobs) and content, sent as `piece`
        sends it; `calls`: those harmony parsed already, None where the content may still hold some."""
        out = ""
        if reasoning:
            out = _data(self.chunk({"reasoning_content": reasoning}, toks, lps, None, trace))
            toks, lps, trace = [], [], None  # the tokens' logprobs ride on one chunk
        if calls is None and self.tools:
            content, calls = self.calls.feed(content)
        if calls is not None:  # harmony, or tools offered
            return out + self._tool_piece(content, calls, toks, lps)
        return out + (_data(self.chunk({"content": content}, toks, lps, None, trace)) if content else "")

    def _held(self) -> str:
        """What the think stream still holds when the answer ends, sent as it would have been."""
        return self._split_piece(*self.think.finish(), None, [], [], None) if self.think is not None else ""

    def _tool_piece(self, text: str, calls: list[tools.ToolCall], toks: list[int], lps: list) -> str:
        """Content as it is known not to be a call, and each call once it closes (OpenAI's streamed `tool_calls`)."""
        out = _data(self.chunk({"content": text}, toks, lps, None)) if text else ""
        for call in calls:
            entry = {"index": self.sent_calls, **call.openai()}
            self.sent_calls += 1
            out += _data(self.chunk({"tool_calls": [entry]}, [], [], None))
        return out

    def closing(self, req: Request, events: _Events, err: APIError | None) -> list[str]:
        """The last chunk with the stats (and a usage chunk), or the error; then [DONE]. With tools, the answer
        first: its text or its calls."""
        if err:
            return [_data(err.body()), "data: [DONE]\n\n"]
        lines = [self._held()]
        lines += [self._tool_piece(*self.calls.finish(), [], [])] if self.tools else []
        finish = req.seq.finish_reason
        finish = "tool_calls" if self.sent_calls and finish == "stop" else finish
        last = self.chunk({} if self.chat else "", [], [], finish, events.rest_of_trace())
        lines.append(_data({**last, **self.stats(req)}))
        if self.usage_chunk:
            lines.append(_data({**self.head(), "choices": [], "usage": self.usage(req)}))
        return lines + ["data: [DONE]\n\n"]

    def head(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_id}

    def _logprobs(self, toks: list[int], lps: list) -> dict | None:
        if not lps:
            return None
        dec = self.llm.tokenizer.decode
        if self.chat:
            return {
                "content": [
                    {
                        "token": dec([t]),
                        "logprob": lp,
                        "bytes": list(dec([t]).encode()),
                        "top_logprobs": [
                            {"token": dec([a]), "logprob": alp, "bytes": list(dec([a]).encode())} for a, alp in top
                        ],
                    }
                    for t, (lp, top) in zip(toks, lps)
                ]
            }
        return {
            "tokens": [dec([t]) for t in toks],
            "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{dec([a]): alp for a, alp in top} for _, top in lps],
        }

    def chunk(
        self, delta, toks: list[int], lps: list, finish: str | None, trace: list[TokenTrace] | None = None
    ) -> dict:
        choice = {"index": 0, "logprobs": self._logprobs(toks, lps), "finish_reason": finish}
        choice.update({"delta": delta} if self.chat else {"text": delta})
        return {**self.head(), "choices": [choice], **self._trace(trace)}

    def _trace(self, trace: list[TokenTrace] | None) -> dict:
        """The `specdec_trace` extension field (docs/server.md), only for requests that asked for it."""
        if trace is None:
            return {}
        dec = self.llm.tokenizer.decode
        return {
            "specdec_trace": [
                {
                    "token": t.token,
                    "text": t.text,
                    "origin": t.origin,
                    "drafter": t.drafter,
                    "step": t.step,
                    "pos": t.pos,
                    "p": round(t.p, 5),
                    "gap": round(t.gap, 4),
                    "drafted": t.drafted,
                    "rejected": [{"token": r, "text": dec([r])} for r in t.rejected],
                }
                for t in trace
            ]
        }

    def usage(self, req: Request) -> dict:
        s = req.seq.stats
        return {
            "prompt_tokens": req.seq.prompt_len,
            "completion_tokens": s.new_tokens,
            "total_tokens": req.seq.prompt_len + s.new_tokens,
            "prompt_tokens_details": {"cached_tokens": req.seq.cached_tokens},
        }

    def response(self, req: Request) -> dict:
        seq = req.seq
        lps = seq.logprobs or []
        message, finish = self._answer(req)
        choice = {"index": 0, "logprobs": self._logprobs(seq.output_ids[: len(lps)], lps), "finish_reason": finish}
        choice.update({"message": message} if self.chat else {"text": seq.text})
        head = {**self.head(), "object": "chat.completion" if self.chat else "text_completion"}
        return {**head, "choices": [choice], "usage": self.usage(req), **self.stats(req), **self._trace(seq.trace)}

    def _answer(self, req: Request) -> tuple[dict, str | None]:
        """The assistant message, its tool calls parsed out where tools were offered, and why it ended
        ("tool_calls" where a finished answer is calls)."""
        seq = req.seq
        thought, text = self.think.split(seq.text) if self.think else ("", seq.text)
        content, calls, reasoning = answer_parts(seq.output_ids, text, self.tools, self.harmony)  # not streamed: unfed
        reasoning = reasoning or thought
        message = {"role": "assistant", "content": content} | ({"reasoning_content": reasoning} if reasoning else {})
        if not calls:
            return message, seq.finish_reason
        reason = "tool_calls" if seq.finish_reason == "stop" else seq.finish_reason
        return message | {"tool_calls": [c.openai() for c in calls]}, reason

    stats = staticmethod(response_stats)
