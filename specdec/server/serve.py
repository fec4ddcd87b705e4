"""`specdec serve`: flags, vLLM-style --speculative-config, and running uvicorn."""
from __future__ import annotations

import argparse
import json
import sys

from specdec.errors import SpecdecError

# vLLM `--speculative-config` methods -> our spec types
VLLM_METHODS = {"ngram": "ngram-simple", "draft_model": "draft", "suffix": "suffix"}


def add_serve_args(p: argparse.ArgumentParser, positive_int) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("-np", "--parallel", type=positive_int, default=4,
                   help="slots: requests decoded together in one batch (default 4); -c is per slot")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond it the server answers 429 (default 64)")
    g.add_argument("--alias", help="model id clients use (default: the model's name)")
    g.add_argument("--spec-load-control", choices=["on", "off"], default="on",
                   help="on: measure goodput with and without speculation at each batch size and use the better "
                   "(turns speculation down or off under load); off: speculate at any load (default on)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='vLLM style, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'; methods: '
                   f"{', '.join(VLLM_METHODS)} or any --spec-type; overrides --spec-type / --draft-max / -md")


def apply_speculative_config(a: argparse.Namespace) -> None:
    """Fold --speculative-config into the generate-style flags (spec_type, draft_max, draft, ngram sizes)."""
    if not a.speculative_config:
        return
    try:
        cfg = json.loads(a.speculative_config)
    except json.JSONDecodeError as e:
        raise SpecdecError(f"--speculative-config is not valid JSON: {e.msg}") from None
    if not isinstance(cfg, dict) or "method" not in cfg:
        raise SpecdecError('--speculative-config needs a JSON object with "method"')
    known = {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise SpecdecError(f"--speculative-config: unsupported keys {', '.join(unknown)}")
    method = str(cfg["method"])
    from specdec.drafters import parse_spec_type
    a.spec_type = ",".join(parse_spec_type(VLLM_METHODS.get(method, method)))
    if "num_speculative_tokens" in cfg:
        k = cfg["num_speculative_tokens"]
        if not isinstance(k, int) or k < 1:
            raise SpecdecError("--speculative-config: num_speculative_tokens must be an integer >= 1")
        a.draft_max = k
    if "model" in cfg:
        a.draft = cfg["model"]
    if "prompt_lookup_min" in cfg:  # vLLM matches n-grams of min..max tokens; we match exactly n
        a.ngram_n = int(cfg["prompt_lookup_min"])
    if "prompt_lookup_max" in cfg:
        a.ngram_n = int(cfg["prompt_lookup_max"])


def run_server(a: argparse.Namespace, build_llm) -> int:
    """Load the models, then serve until Ctrl-C / SIGTERM (in-flight requests finish or are cancelled)."""
    import uvicorn

    from specdec.engine.load_control import LoadController
    from specdec.engine.scheduler import Scheduler
    from specdec.sampling import SamplingParams
    from specdec.server.app import ServerConfig, create_app

    apply_speculative_config(a)
    if a.max_queue < 0:
        raise SpecdecError("--max-queue must be >= 0")
    defaults = SamplingParams(a.temp, a.top_k, a.top_p, a.min_p, None, a.max_tokens, []).validate()
    llm = build_llm(a)
    name = a.alias or _model_id(a.model)
    controller = LoadController(a.draft_max) if a.spec_load_control == "on" else None
    scheduler = Scheduler(llm.engine, llm.parallel, a.max_queue, controller)
    app = create_app(llm, scheduler, ServerConfig(name, defaults, a.api_key))
    print(f"specdec: serving {name} [{llm.spec_type}] on http://{a.host}:{a.port}/v1 with {llm.parallel} slots "
          f"of {llm.context} tokens", file=sys.stderr)
    server = _server_class()(uvicorn.Config(app, host=a.host, port=a.port, log_level="warning", timeout_graceful_shutdown=30))
    server.run()
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
