"""`specdec serve`: flags and running uvicorn (the other engines' flags: specdec.compat)."""

from __future__ import annotations

import argparse
import logging
import sys

from specdec.errors import SpecdecError
from specdec.runtime.prefix_cache import SERVE_BUDGET_MB
from specdec.server.protocol import MAX_BODY


def add_serve_args(p: argparse.ArgumentParser, positive_int) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument(
        "-np",
        "--parallel",
        type=positive_int,
        default=4,
        help="slots: requests decoded together in one batch (default 4); -c is per slot",
    )
    g.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/*, /metrics and /openapi.json "
        "(visible in the process list: prefer SPECDEC_API_KEY or --api-key-file)",
    )
    g.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="API keys, one per line (blank lines and # comments skipped); each key is a separate "
        "scope for drafter memory. Adds to --api-key and SPECDEC_API_KEY",
    )
    g.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="without an API key, also answer requests whose Host header names HOST (repeatable; '*' "
        "for any); by default only the --host address and localhost (DNS rebinding guard)",
    )
    g.add_argument(
        "--spec-shared-memory",
        action="store_true",
        help="share cross-request drafter memory (suffix, ngram-mod pool) between API keys; by default "
        "each key has its own, so one client's text cannot show in another's acceptance or timing",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait when every slot is busy; beyond them the server answers 429 at once; "
        "0: none wait, a request needs a free slot (default 64)",
    )
    g.add_argument(
        "--max-body",
        type=positive_int,
        default=MAX_BODY,
        metavar="BYTES",
        help=f"largest request body; a larger one is answered 413 (default {MAX_BODY}, 4 MiB)",
    )
    g.add_argument("--alias", help="model id clients use (default: the model's name)")
    g.add_argument(
        "--cache-mb",
        type=int,
        default=SERVE_BUDGET_MB,
        metavar="MIB",
        help="prefix cache: keep the K/V of recent prompts (target and draft model, 16-token blocks, "
        "least recently used evicted) within MIB and reuse the longest cached prefix of a new prompt "
        '(the same tokens as a fresh prefill); a request opts out with "cache_prompt": false; 0 = off '
        f"(default {SERVE_BUDGET_MB})",
    )
    g.add_argument(
        "--allow-lossy",
        action="store_true",
        help="let requests ask for relaxed acceptance (speculative.accept_threshold), which changes the "
        'output; their responses say "lossless": false (default: refused with 400)',
    )
    g.add_argument(
        "--spec-load-control",
        choices=["on", "off"],
        default="on",
        help="on: measure goodput with and without speculation at each batch size and use the best of "
        "off, a cap of 4, adaptive lengths and light (only model-free drafters, e.g. a chain's suffix tree "
        "without its draft model) (turns speculation down or off under load); off: speculate at any load "
        "(default on)",
    )


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The accepted API keys: --api-key, $SPECDEC_API_KEY and the lines of --api-key-file (empty: no key needed)."""
    import os
    from pathlib import Path

    keys = [args.api_key, os.environ.get("SPECDEC_API_KEY")]
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecdecError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from None
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not file_keys:
            raise SpecdecError(f"--api-key-file {args.api_key_file} holds no keys")
        keys += file_keys
    return tuple(dict.fromkeys(k for k in keys if k))


def _log_requests() -> None:
    """One line per request on stderr (`server.app.access`), as llama-server and Ollama log them."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("specdec: %(message)s"))
    access = logging.getLogger("specdec.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def run_server(args: argparse.Namespace) -> int:
    """Load the models, then serve until Ctrl-C / SIGTERM (in-flight requests finish or are cancelled)."""
    import uvicorn

    from specdec.api import build_llm
    from specdec.engine.load_control import LoadController
    from specdec.engine.scheduler import Scheduler
    from specdec.sampling import SamplingParams
    from specdec.server.app import ServerConfig, create_app

    if args.max_queue < 0:
        raise SpecdecError("--max-queue must be >= 0")
    keys = api_keys(args)
    defaults = SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, None, args.max_tokens, []).validate()
    llm = build_llm(args)
    name = args.alias or _model_id(args.model)
    controller = LoadController(args.draft_max) if args.spec_load_control == "on" else None
    scheduler = Scheduler(llm.engine, llm.parallel, args.max_queue, controller)
    cfg = ServerConfig(
        name,
        defaults,
        keys,
        host=args.host,
        allowed_hosts=tuple(args.allow_host),
        shared_memory=args.spec_shared_memory,
        max_body=args.max_body,
        allow_lossy=args.allow_lossy,
    )
    app = create_app(llm, scheduler, cfg)
    print(
        f"specdec: serving {name} [{llm.spec_type}] on http://{args.host}:{args.port}/v1 with {llm.parallel} slots "
        f"of {llm.context} tokens; playground at http://{args.host}:{args.port}/",
        file=sys.stderr,
    )
    _log_requests()
    server = _server_class()(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    )
    scheduler.on_fatal = lambda: setattr(server, "should_exit", True)  # the engine thread died: stop serving
    server.run()
    if scheduler.fatal:
        print(f"specdec: error: the engine stopped ({scheduler.fatal})", file=sys.stderr)
        return 1
    print("specdec: server stopped", file=sys.stderr)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a caught SIGINT/SIGTERM after its graceful shutdown; a clean stop here exits 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


class ServerThread:
    """uvicorn serving `app` on loopback from a background thread (benchmarks and tests)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        import socket
        import threading
        import time

        import uvicorn

        if port is None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return
            time.sleep(0.05)
        raise SpecdecError("the server did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _model_id(model: str | None) -> str:
    from pathlib import Path

    from specdec.models import packs

    return Path(model).stem if model else packs.DEFAULT_TARGET
