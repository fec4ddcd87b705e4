"""The OpenAI-compatible HTTP API over the scheduler (FastAPI): completions, chat completions (plain and
SSE streaming), models, health and Prometheus metrics."""
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
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from specdec.drafters import LOSSY_TYPES, parse_spec_type
from specdec.engine.scheduler import EngineStopped, QueueFull, Request, Scheduler
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.server.metrics import Metrics
from specdec.server.protocol import APIError, ChatRequest, CompletionRequest
from specdec.server.serve import MAX_BODY

log = logging.getLogger(__name__)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


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


def create_app(llm, scheduler: Scheduler, cfg: ServerConfig) -> FastAPI:
    """`llm` is a specdec.LLM with `parallel` slots; `scheduler` drives its engine."""
    metrics = Metrics(scheduler)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, False, cfg.graceful_s)

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    if not cfg.api_keys and "*" not in cfg.allowed_hosts:
        app.add_middleware(_HostGuard, allowed={_host_name(h) for h in (cfg.host, *LOOPBACK_HOSTS, *cfg.allowed_hosts)})
    app.add_middleware(_BodyLimit, limit=cfg.max_body)
    digests = [_digest(k.encode()) for k in cfg.api_keys]

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        msg = f"{loc}: {err.get('msg')}" if loc else str(err.get("msg", "invalid request"))
        return JSONResponse(APIError(400, msg, loc).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_req, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_req, e: Exception):
        err = _internal("req-" + uuid.uuid4().hex[:24], f"{type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=err.status)

    async def auth(req: HTTPRequest) -> int | None:
        """Check the API key (when the server has keys); return the request's drafter-memory scope: the
        key's index, or None (one scope for all) without keys or with shared memory."""
        if not cfg.api_keys:
            return None
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        hits = [hmac.compare_digest(_digest(token.encode("latin-1")), d) for d in digests]  # every key, no early exit
        if scheme.lower() != "bearer" or not any(hits):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        return None if cfg.shared_memory else hits.index(True)

    @app.get("/openapi.json", dependencies=[Depends(auth)], include_in_schema=False)
    async def openapi():
        return app.openapi()

    @app.get("/health")
    async def health():
        if scheduler.fatal:
            return JSONResponse({"status": "error", "error": "the engine has stopped", **scheduler.load}, 503)
        return {"status": "ok", **scheduler.load}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": llm.context}]}

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest, scope: int | None = Depends(auth)):
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        ids = await asyncio.to_thread(_prompt_ids, llm, body.prompt)  # off the event loop: prompts can be long
        return await _serve(http, body, ids, chat=False, top=body.logprobs or 0, want_lp=body.logprobs is not None,
                            max_tokens=body.max_tokens, scope=scope)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest, scope: int | None = Depends(auth)):
        try:
            ids = await asyncio.to_thread(llm.encode_chat, body.chat_messages())
        except SpecdecError as e:
            raise APIError(400, str(e), "messages") from None
        return await _serve(http, body, ids, chat=True, top=body.top_logprobs or 0, want_lp=body.logprobs,
                            max_tokens=body.max_completion_tokens or body.max_tokens, scope=scope)

    async def _serve(http: HTTPRequest, body, ids: list[int], chat: bool, top: int, want_lp: bool,
                     max_tokens: int | None, scope: int | None):
        if body.model is not None and body.model != cfg.model_id:
            raise APIError(404, f"the model `{body.model}` does not exist (this server has `{cfg.model_id}`)",
                           "model", "model_not_found")
        params = body.sampling(cfg.defaults, max_tokens)
        try:
            params.validate()
        except SpecdecError as e:
            raise APIError(400, str(e)) from None
        if len(ids) >= llm.context:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context is {llm.context} tokens per "
                           "slot (at least one free position is needed)", "messages" if chat else "prompt",
                           "context_length_exceeded")
        drafter, draft_max = await _speculation(body.speculative, scope)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sent = [0]  # logprobs entries already sent

        def on_text(delta: str) -> None:  # engine thread: snapshot the new tokens' logprobs with the text
            seq, i = req.seq, sent[0]
            lps = seq.logprobs[i:] if seq.logprobs is not None else []
            sent[0] += len(lps)
            loop.call_soon_threadsafe(events.put_nowait, (delta, seq.output_ids[i:i + len(lps)], lps))

        req = Request(ids, params, drafter, draft_max, want_lp, top, on_text,
                      on_done=lambda _r: loop.call_soon_threadsafe(events.put_nowait, None))
        try:
            scheduler.submit(req)
        except QueueFull as e:
            metrics.rejected += 1
            raise APIError(429, str(e), code="queue_full") from None
        except EngineStopped as e:
            raise APIError(503, str(e), code="engine_stopped") from None
        fmt = _Formatter(llm, cfg.model_id, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], chat)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(req, events, fmt, usage), media_type="text/event-stream")
        return await _wait(http, req, events, fmt)

    async def _speculation(spec, scope: int | None) -> tuple[object | None, int | None]:
        """(drafter, draft_max) for the `speculative` field; drafters that learn across requests are per scope."""
        if spec is None or spec is True:
            return await asyncio.to_thread(llm.drafter_for, llm.spec_type, scope), None
        if spec is False:
            return None, None
        draft_max = None if spec.draft_max is None else min(spec.draft_max, llm.engine.spec.draft_max)  # <= --draft-max
        if spec.type is None:
            return await asyncio.to_thread(llm.drafter_for, llm.spec_type, scope), draft_max
        try:
            parts = parse_spec_type(spec.type)
        except SpecdecError as e:
            raise APIError(400, str(e), "speculative.type") from None
        if any(p in LOSSY_TYPES for p in parts) and llm.spec_type != spec.type:
            raise APIError(400, f"lossy spec type {spec.type!r} only when the server is started with it",
                           "speculative.type")
        try:
            return await asyncio.to_thread(llm.drafter_for, spec.type, scope), draft_max
        except SpecdecError as e:
            raise APIError(400, str(e), "speculative.type") from None

    async def _wait(http: HTTPRequest, req: Request, events: asyncio.Queue, fmt: "_Formatter"):
        async def watch() -> None:  # the body is read: the next ASGI message is the client leaving
            while (await http.receive())["type"] != "http.disconnect":
                pass
            scheduler.cancel(req)

        watcher = asyncio.create_task(watch())
        try:
            while await events.get() is not None:
                pass
        finally:
            watcher.cancel()
        metrics.finished(req)
        if err := _failure(req, fmt.rid):
            raise err
        return fmt.response(req)

    async def _sse(req: Request, events: asyncio.Queue, fmt: "_Formatter", usage: bool) -> AsyncIterator[str]:
        done = False
        try:
            if fmt.chat:
                yield _data(fmt.chunk({"role": "assistant", "content": ""}, [], [], None))
            while True:
                ev = await events.get()
                if ev is None:
                    done = True
                    break
                delta, toks, lps = ev
                yield _data(fmt.chunk({"content": delta} if fmt.chat else delta, toks, lps, None))
            metrics.finished(req)
            if err := _failure(req, fmt.rid):
                yield _data(err.body())
            else:
                yield _data({**fmt.chunk({} if fmt.chat else "", [], [], req.seq.finish_reason), **fmt.stats(req)})
                if usage:
                    yield _data({**fmt.head(), "choices": [], "usage": fmt.usage(req)})
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away: free the slot
                scheduler.cancel(req)

    return app


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _failure(req: Request, rid: str) -> APIError | None:
    """Why a finished request has no completion to answer with (None: it has one)."""
    if req.error:
        return _internal(rid, req.error)
    if req.seq is None:
        return APIError(503, "the request was cancelled before it started", code="cancelled")
    return None


def _internal(rid: str, detail: str) -> APIError:
    """A 500 naming the request id; the detail (internal exception text) goes to the server log only."""
    log.error("request %s failed: %s", rid, detail)
    return APIError(500, f"internal server error (request id {rid}; details in the server log)",
                    code="internal_error")


def _digest(secret: bytes) -> bytes:
    """SHA-256, so that key comparisons take the same time whatever the lengths."""
    return hashlib.sha256(secret).digest()


def _host_name(host: str) -> str:
    """A Host header (or --host / --allow-host value) without port or brackets: '[::1]:8080' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class _HostGuard:
    """ASGI middleware for a server without API keys: requests whose Host header names none of the `allowed`
    hosts get 403, so a web page cannot reach the server through a rebound DNS name (DNS rebinding)."""

    def __init__(self, app, allowed: set[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        host = _host_name(Headers(scope=scope).get("host", "")) if scope["type"] == "http" else None
        if host is None or host in self.allowed:
            return await self.app(scope, receive, send)
        err = APIError(403, f"Host {host!r} is not allowed: without an API key the server answers only its own "
                       f"address and localhost (start it with --allow-host {host or 'HOST'} or an API key)",
                       code="host_not_allowed")
        await JSONResponse(err.body(), status_code=403)(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 as soon as its Content-Length, or
    the bytes received so far, say so; the rest is not read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        seen = 0

        async def limited():
            nonlocal seen
            if declared.isdigit() and int(declared) > self.limit:
                raise self._too_large()
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise self._too_large()
            return msg
        await self.app(scope, limited, send)

    def _too_large(self) -> HTTPException:
        """Raised from `receive`: FastAPI passes it to the app's handler, which answers in OpenAI's format."""
        return HTTPException(413, f"the request body is larger than {self.limit} bytes (the server's --max-body)")


def _prompt_ids(llm, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return llm.encode(prompt)
    if not prompt or not all(0 <= t < llm.runner.vocab_size for t in prompt):
        raise APIError(400, f"prompt token ids must be a non-empty list in [0, {llm.runner.vocab_size})", "prompt")
    return list(prompt)


class _Formatter:
    """Builds OpenAI response objects (chat or text completion) for one request."""

    def __init__(self, llm, model_id: str, rid: str, chat: bool):
        self.llm, self.model_id, self.rid, self.chat = llm, model_id, rid, chat
        self.created = int(time.time())

    def head(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_id}

    def _logprobs(self, toks: list[int], lps: list) -> dict | None:
        if not lps:
            return None
        dec = self.llm.tokenizer.decode
        if self.chat:
            return {"content": [{"token": dec([t]), "logprob": lp, "bytes": list(dec([t]).encode()),
                                 "top_logprobs": [{"token": dec([a]), "logprob": alp, "bytes": list(dec([a]).encode())}
                                                  for a, alp in top]}
                                for t, (lp, top) in zip(toks, lps)]}
        return {"tokens": [dec([t]) for t in toks], "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{dec([a]): alp for a, alp in top} for _, top in lps]}

    def chunk(self, delta, toks: list[int], lps: list, finish: str | None) -> dict:
        choice = {"index": 0, "logprobs": self._logprobs(toks, lps), "finish_reason": finish}
        choice.update({"delta": delta} if self.chat else {"text": delta})
        return {**self.head(), "choices": [choice]}

    def usage(self, req: Request) -> dict:
        s = req.seq.stats
        return {"prompt_tokens": req.seq.prompt_len, "completion_tokens": s.new_tokens,
                "total_tokens": req.seq.prompt_len + s.new_tokens}

    def response(self, req: Request) -> dict:
        seq = req.seq
        lps = seq.logprobs or []
        choice = {"index": 0, "logprobs": self._logprobs(seq.output_ids[:len(lps)], lps),
                  "finish_reason": seq.finish_reason}
        choice.update({"message": {"role": "assistant", "content": seq.text}} if self.chat else {"text": seq.text})
        head = {**self.head(), "object": "chat.completion" if self.chat else "text_completion"}
        return {**head, "choices": [choice], "usage": self.usage(req), **self.stats(req)}

    @staticmethod
    def stats(req: Request) -> dict:
        """Speculative stats and llama-server-style `timings` (draft_n, draft_n_accepted)."""
        seq, s = req.seq, req.seq.stats
        first = req.first_token_s or 0.0
        decode_s = max((req.finished_s or first) - first, 1e-9)
        return {"speculative": {"type": seq.drafter.name if seq.drafter else "none", "drafted": s.drafted,
                                "accepted": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4),
                                "mean_accept_len": round(s.mean_accept_len, 4)},
                "timings": {"prompt_n": seq.prompt_len, "prompt_ms": round(1000 * (req.first_token_s or 0.0), 2),
                            "predicted_n": s.new_tokens, "predicted_ms": round(1000 * decode_s, 2),
                            "predicted_per_second": round(max(s.new_tokens - 1, 0) / decode_s, 3),
                            "draft_n": s.drafted, "draft_n_accepted": s.accepted}}
