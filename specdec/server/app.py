"""The HTTP app (FastAPI): OpenAI's routes (completions, chat completions, plain and SSE streaming), models,
health, Prometheus metrics, the playground page, and Ollama's and llama-server's routes (ollama.py,
llama_routes.py), all served by one `Handler` (handler.py); the middleware guarding hosts and body sizes, and the
error answers in each API's format."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from specdec.engine.scheduler import Scheduler
from specdec.server import llama_routes, ollama
from specdec.server.handler import Handler, ServerConfig, internal_error
from specdec.server.protocol import APIError, ChatRequest, CompletionRequest

__all__ = ["ServerConfig", "create_app"]

access = logging.getLogger("specdec.access")  # one line per request (`specdec serve` prints them on stderr)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
STATIC = Path(__file__).parent / "static"  # the playground page, served at /


def create_app(llm, scheduler: Scheduler, cfg: ServerConfig) -> FastAPI:
    """`llm` is a specdec.LLM with `parallel` slots; `scheduler` drives its engine."""
    h = Handler(llm, scheduler, cfg)
    app = FastAPI(
        title="specdec", version="0.1.0", lifespan=h.lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    if not cfg.api_keys and "*" not in cfg.allowed_hosts:
        app.add_middleware(_HostGuard, allowed={_host_name(n) for n in (cfg.host, *LOOPBACK_HOSTS, *cfg.allowed_hosts)})
    app.add_middleware(_BodyLimit, limit=cfg.max_body)
    app.add_middleware(_JsonBodies)
    app.state.error_bodies = {}  # path (or prefix ending in /) -> its API's error body; OpenAI's elsewhere
    for exc, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)

    @app.get("/openapi.json", dependencies=[Depends(h.auth)], include_in_schema=False)
    async def openapi():
        return app.openapi()

    @app.get("/health")
    async def health():
        return h.health()

    @app.get("/v1/models", dependencies=[Depends(h.auth)])
    async def models():
        return h.models()

    @app.get("/metrics", dependencies=[Depends(h.auth)])
    async def prometheus():
        return h.prometheus()

    @app.get("/v1/drafters", dependencies=[Depends(h.auth)])
    async def drafters():
        return h.drafters()

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest, scope: int | None = Depends(h.auth)):
        return await h.completions(body, http, scope)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest, scope: int | None = Depends(h.auth)):
        return await h.chat(body, http, scope)

    ollama.add_routes(app, h)
    llama_routes.add_routes(app, h)
    return app


def _error(req: HTTPRequest, e: APIError) -> JSONResponse:
    """`e` in the error format of the API `req`'s path belongs to (`app.state.error_bodies`; else OpenAI's)."""
    path = req.url.path
    access.info("%s %s %d %s", req.method, path, e.status, e.message)
    body = next(
        (
            fn
            for key, fn in req.app.state.error_bodies.items()
            if path == key or (key.endswith("/") and path.startswith(key))
        ),
        APIError.body,
    )
    return JSONResponse(body(e), status_code=e.status)


async def _api_error(req: HTTPRequest, e: APIError) -> JSONResponse:
    return _error(req, e)


async def _invalid(req: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """A body that does not fit the schema: 400, naming the first bad field."""
    err = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
    msg = f"{loc}: {err.get('msg')}" if loc else str(err.get("msg", "invalid request"))
    return _error(req, APIError(400, msg, loc))


async def _http(req: HTTPRequest, e: HTTPException) -> JSONResponse:
    return _error(req, APIError(e.status_code, str(e.detail)))


async def _unexpected(req: HTTPRequest, e: Exception) -> JSONResponse:
    return _error(req, internal_error("req-" + uuid.uuid4().hex[:24], f"{type(e).__name__}: {e}"))


_ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _invalid, HTTPException: _http, Exception: _unexpected}


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
        err = APIError(
            403,
            f"Host {host!r} is not allowed: without an API key the server answers only its own "
            f"address and localhost (start it with --allow-host {host or 'HOST'} or an API key)",
            code="host_not_allowed",
        )
        await JSONResponse(err.body(), status_code=403)(scope, receive, send)


class _JsonBodies:
    """ASGI middleware: a POST body is JSON whatever its Content-Type says (curl -d sends form-urlencoded, as Ollama's
    own examples do; Ollama and llama-server parse it as JSON all the same)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and "json" not in Headers(scope=scope).get("content-type", "")
        ):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


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
