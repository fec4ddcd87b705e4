"""Soak `specdec serve` on loopback with mixed traffic: chat and completions, streaming or not, random
disconnects, random `speculative` objects, seeds, stop strings, two API keys and a few invalid requests, at a
given concurrency. It checks that no request hangs or gets an unexpected status, that the server's anonymous RSS
(`anon_mb`) stays bounded, that the server is idle and answers afterwards and exits 0 on SIGTERM, and that every
greedy or seeded output equals the plain output (`"speculative": false`) of the same request. With `--cache-mb` the
server keeps a prefix cache (repeated shapes hit it), and the server's anonymous RSS and the cache's bytes are
sampled over the run (checked against the budget; `--samples` writes them as CSV with a plot). Needs the dev extras
(httpx, psutil). `python scripts/soak.py --help`; tests/test_soak.py runs it at CI size."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import psutil

KEYS = ("soak-key-a", "soak-key-b")  # one from --api-key, one from SPECDEC_API_KEY: two drafter-memory scopes
PROMPTS = [
    (False, "def fib(n):"),
    (False, "The capital of France is"),
    (False, "import numpy as np\n\ndef"),
    (False, "1, 2, 3, 4,"),
    (False, "<html>\n<body>\n<ul>\n<li>"),
    (False, "Once upon a time"),
    (True, "Name three colors."),
    (True, "Write a Python function that reverses a string."),
    (True, "List the days of the week, one per line."),
]  # (chat, text)
SAMPLING = [
    {"temperature": 0},
    {"temperature": 1e-7},
    {"temperature": 0.8},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.2, "min_p": 0.05},
]  # the first two are greedy
STOPS = [None, "\n", ["(", " the"], ".", ["\n\n", "return", ","], ["x" * 256], [f"zz{i}" for i in range(16)]]
MAX_TOKENS = [1, 2, 4, 8, 16, 24]
SPEC_TYPES = [
    "none",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-map-k-tree",
    "ngram-mod",
    "suffix",
    "suffix-tree",
    "draft",
    "ngram-mod,draft",
    "suffix,ngram-simple",
    "ngram-map-k-tree,suffix-tree",
]
INVALID = [
    {"temperature": 5},
    {"speculative": {"type": "warp"}},
    {"speculative": {"type": "synthetic"}},
    {"stop": ["a"] * 17},
    {"seed": 2**64},
    {"max_tokens": 0},
    {"n": 2},
]  # each answered 400
DRAFT_MAX = 8  # the server's --draft-max (per-request draft_max is capped at it)
SHAPES = 64  # distinct (prompt, sampling, seed, max_tokens, stop) combinations


@dataclass(frozen=True)
class Shape:
    """What decides a request's text; greedy and seeded shapes must give one text whatever else differs."""

    prompt: int
    sampling: int
    seed: int | None
    max_tokens: int
    stop: int

    @property
    def compared(self) -> bool:
        return SAMPLING[self.sampling]["temperature"] < 1e-5 or self.seed is not None


@dataclass
class Planned:
    index: int
    shape: Shape
    path: str
    body: dict
    key: str
    stream: bool
    disconnect: float | None  # leave after this many seconds (streams: after the first event); None: stay
    expect: int  # 200, or 400 for a request made invalid on purpose


@dataclass
class Outcome:
    req: Planned
    status: int | None = None  # an error event inside a stream counts as its status (500, or 503 cancelled)
    text: str = ""
    finish: str | None = None
    error: str = ""
    disconnected: bool = False
    hung: bool = False


@dataclass
class Report:
    sent: int
    outcomes: Counter  # "200", "400", ..., "disconnected", "hung"
    compared: int  # greedy or seeded outputs checked against the plain output of the same request
    rss_before_mb: float  # the server's anonymous RSS (anon_mb)
    rss_after_mb: float
    wall_s: float
    problems: list[str] = field(default_factory=list)
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (s, anon_mb, prefix cache MB)

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_after_mb - self.rss_before_mb

    def ok(self, rss_limit_mb: float) -> bool:
        return not self.problems and self.rss_growth_mb < rss_limit_mb

    def summary(self) -> str:
        return (
            f"sent {self.sent} requests in {self.wall_s:.1f} s: {dict(sorted(self.outcomes.items()))}; "
            f"{self.compared} outputs equal to plain decoding; server anonymous RSS {self.rss_before_mb:.0f} -> "
            f"{self.rss_after_mb:.0f} MB ({self.rss_growth_mb:+.1f} MB); {len(self.problems)} problems"
        )


def _body(shape: Shape, rng: random.Random) -> tuple[str, dict]:
    """(path, body) of a valid request of `shape`."""
    chat, text = PROMPTS[shape.prompt]
    body: dict = {**SAMPLING[shape.sampling], "model": "soak"}
    if shape.seed is not None:
        body["seed"] = shape.seed
    if STOPS[shape.stop] is not None:
        body["stop"] = STOPS[shape.stop]
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        body[rng.choice(["max_tokens", "max_completion_tokens"])] = shape.max_tokens
        return "/v1/chat/completions", body
    return "/v1/completions", {**body, "prompt": text, "max_tokens": shape.max_tokens}


def _speculative(rng: random.Random) -> dict:
    """A random `speculative` field (or none): absent, true, false, a type, a draft_max or both."""
    kind = rng.randrange(6)
    if kind == 0:
        return {}
    if kind < 3:
        return {"speculative": kind == 1}
    spec: dict = {}
    if kind != 3:
        spec["draft_max"] = rng.randint(1, 256)  # the server caps it at its --draft-max
    if kind != 5:
        spec["type"] = rng.choice(SPEC_TYPES)
    return {"speculative": spec}


def _extras(path: str, stream: bool, rng: random.Random) -> dict:
    """Optional fields that must not change the text: logprobs, usage in a stream, a user."""
    extra: dict = {}
    if rng.random() < 0.2:
        extra.update(
            {"logprobs": rng.randint(0, 5)}
            if path == "/v1/completions"
            else {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
        )
    if stream and rng.random() < 0.5:
        extra["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        extra["user"] = "soak"
    return extra


def _request(index: int, shape: Shape, rng: random.Random, reference: bool) -> Planned:
    """A random request of `shape`; a reference is plain, stays to the end and is valid."""
    path, body = _body(shape, rng)
    stream = rng.random() < 0.5
    body.update(stream=stream, **_extras(path, stream, rng))
    key = rng.choice(KEYS)
    if reference:
        return Planned(index, shape, path, {**body, "speculative": False}, key, stream, None, 200)
    body.update(_speculative(rng))
    if rng.random() < 0.04:
        return Planned(index, shape, path, {**body, **rng.choice(INVALID)}, key, stream, None, 400)
    disconnect = (0.0 if stream else rng.uniform(0.05, 1.0)) if rng.random() < 0.1 else None
    return Planned(index, shape, path, body, key, stream, disconnect, 200)


def _seed(rng: random.Random) -> int | None:
    """None (unseeded) a quarter of the time, else 0, the largest seed or a random one."""
    return None if rng.random() < 0.25 else rng.choice([0, 2**63 - 1, rng.randrange(2**63)])


def plan(n: int, seed: int) -> list[Planned]:
    """`n` random requests over SHAPES shapes; the first request of each compared shape is its plain reference."""
    rng = random.Random(seed)
    shapes = [
        Shape(
            rng.randrange(len(PROMPTS)),
            rng.randrange(len(SAMPLING)),
            _seed(rng),
            rng.choice(MAX_TOKENS),
            rng.randrange(len(STOPS)),
        )
        for _ in range(SHAPES)
    ]
    seen: set[Shape] = set()
    out = []
    for i in range(n):
        shape = rng.choice(shapes)
        out.append(_request(i, shape, rng, reference=shape.compared and shape not in seen))
        seen.add(shape)
    return out


def warmup(concurrency: int, seed: int) -> list[Planned]:
    """Before RSS is taken: one short request per spec type and key (every drafter and the draft model are made),
    then `concurrency` mixed requests (batches of every size have run)."""
    shape = Shape(0, 0, None, 4, 0)
    firsts = [
        Planned(
            -1,
            shape,
            "/v1/completions",
            {"prompt": "def fib(n):", "max_tokens": 4, "speculative": spec},
            key,
            False,
            None,
            200,
        )
        for spec in [True, *({"type": t} for t in SPEC_TYPES)]
        for key in KEYS
    ]
    return firsts + plan(concurrency, seed + 1)


async def _exchange(client: httpx.AsyncClient, url: str, req: Planned) -> Outcome:
    headers = {"Authorization": f"Bearer {req.key}"}
    if req.stream:
        return await _stream(client, url, req, headers)
    try:
        r = await asyncio.wait_for(client.post(url + req.path, json=req.body, headers=headers), req.disconnect)
    except asyncio.TimeoutError:
        return Outcome(req, disconnected=True)
    if r.status_code != 200:
        return Outcome(req, r.status_code, error=r.text[:300])
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Outcome(req, 200, text, choice["finish_reason"])


async def _stream(client: httpx.AsyncClient, url: str, req: Planned, headers: dict) -> Outcome:
    """Read an SSE stream to [DONE] (or leave after its first event when the request is to disconnect)."""
    out = Outcome(req)
    parts: list[str] = []
    async with client.stream("POST", url + req.path, json=req.body, headers=headers) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode()[:300]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if req.disconnect is not None:
                out.disconnected = True
                return out
            event = json.loads(line[6:])
            if "error" in event:
                out.status = 503 if event["error"]["code"] == "cancelled" else 500
                out.error = event["error"]["message"]
            for ch in event.get("choices", []):
                parts.append((ch["delta"].get("content") if "delta" in ch else ch["text"]) or "")
                out.finish = ch["finish_reason"] or out.finish
    out.text = "".join(parts)
    return out


async def _send(client: httpx.AsyncClient, url: str, req: Planned, hang_s: float) -> Outcome:
    try:
        return await asyncio.wait_for(_exchange(client, url, req), hang_s)
    except asyncio.TimeoutError:
        return Outcome(req, hung=True)
    except httpx.HTTPError as e:
        return Outcome(req, error=f"{type(e).__name__}: {e}")


async def _drive(
    url: str, reqs: list[Planned], concurrency: int, hang_s: float, deadline: float | None
) -> list[Outcome]:
    """Send `reqs` from `concurrency` clients at once, each starting its next request when one ends; no new
    request starts after `deadline` (time.monotonic())."""
    pending = iter(reqs)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=hang_s, limits=limits) as client:

        async def worker() -> None:
            for req in pending:
                if deadline is not None and time.monotonic() > deadline:
                    return
                outcomes.append(await _send(client, url, req, hang_s))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.req.index)


def _label(o: Outcome) -> str:
    return "hung" if o.hung else "disconnected" if o.disconnected else str(o.status)


def problems(outcomes: list[Outcome]) -> tuple[list[str], int]:
    """(what went wrong, how many greedy or seeded outputs were compared with their plain reference)."""
    found: list[str] = []
    texts: dict[Shape, list[Outcome]] = {}
    for o in outcomes:
        if o.disconnected:
            continue
        if o.hung or o.status != o.req.expect:
            found.append(
                f"request {o.req.index} ({o.req.path} {json.dumps(o.req.body)[:300]}): {_label(o)}, "
                f"expected {o.req.expect} {o.error}"
            )
        elif o.status == 200 and o.req.shape.compared:
            texts.setdefault(o.req.shape, []).append(o)
    compared = 0
    for group in texts.values():
        plain = [o for o in group if o.req.body.get("speculative") is False]
        if not plain:
            continue
        ref = plain[0]
        for o in group:
            if o is not ref:
                compared += 1
                if (o.text, o.finish) != (ref.text, ref.finish):
                    found.append(
                        f"request {o.req.index} ({json.dumps(o.req.body)[:300]}) gave {o.text!r} "
                        f"({o.finish}), its plain reference {ref.req.index} gave {ref.text!r} ({ref.finish})"
                    )
    return found, compared


def _settle(url: str, timeout_s: float = 30.0) -> list[str]:
    """After the soak: every slot frees and the queue empties, and a normal request is answered."""
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    health: dict = {}
    for _ in range(int(timeout_s / 0.1)):
        health = httpx.get(url + "/health", timeout=10).json()
        if health.get("status") == "ok" and health["running"] == health["waiting"] == 0:
            break
        time.sleep(0.1)
    else:
        return [f"the server is not idle {timeout_s:.0f} s after the soak: {health}"]
    r = httpx.post(
        url + "/v1/completions",
        headers=headers,
        timeout=60,
        json={"prompt": "The capital of France is", "max_tokens": 8},
    )
    return [] if r.status_code == 200 else [f"a normal request after the soak got {r.status_code}: {r.text[:300]}"]


def soak(
    url: str,
    pid: int,
    requests: int,
    concurrency: int,
    minutes: float = 0.0,
    seed: int = 0,
    hang_s: float = 120.0,
    sample_s: float = 60.0,
) -> Report:
    """Warm up, then send `requests` planned requests (stopping early after `minutes`, if given) and check;
    the server's anonymous RSS and prefix-cache bytes are sampled every `sample_s` seconds meanwhile."""
    warm = asyncio.run(_drive(url, warmup(concurrency, seed), concurrency, hang_s, None))
    proc = psutil.Process(pid)
    before = anon_mb(proc)
    start = time.monotonic()
    deadline = start + 60 * minutes if minutes else None
    with _Sampler(url, proc, sample_s) as sampler:
        outcomes = asyncio.run(_drive(url, plan(requests, seed), concurrency, hang_s, deadline))
    wall = time.monotonic() - start
    found, compared = problems(outcomes)
    found += [f"warm-up {p}" for p in problems(warm)[0]] + _settle(url) + sampler.over_budget()
    return Report(
        len(outcomes),
        Counter(_label(o) for o in outcomes),
        compared,
        before,
        anon_mb(proc),
        wall,
        found,
        sampler.samples,
    )


def anon_mb(proc: psutil.Process) -> float:
    """Resident MB not backed by a file (RSS less file and shared pages): what a leak grows. The weights' pages,
    mapped from their safetensors file, count in RSS only while the kernel keeps them, so RSS also moves with the
    machine's memory pressure."""
    info = proc.memory_info()
    return (info.rss - info.shared) / 2**20


class _Sampler:
    """From a thread, every `every` seconds (and at the end): (seconds since start, anon_mb, prefix cache MB)."""

    def __init__(self, url: str, proc: psutil.Process, every: float):
        self.url, self.proc, self.every = url, proc, every
        self.samples: list[tuple[float, float, float]] = []
        self.budget_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.every):
                self._sample()
                return

    def _sample(self) -> None:
        metrics = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30).text
        values = dict(ln.rsplit(" ", 1) for ln in metrics.splitlines() if ln.startswith("specdec_prefix_cache_b"))
        self.budget_mb = float(values.get("specdec_prefix_cache_budget_bytes", 0)) / 2**20
        self.samples.append(
            (
                round(time.monotonic() - self._start, 1),
                anon_mb(self.proc),
                float(values.get("specdec_prefix_cache_bytes", 0)) / 2**20,
            )
        )

    def over_budget(self) -> list[str]:
        return [
            f"prefix cache at {c:.1f} MB > its {self.budget_mb:.0f} MB budget ({t:.0f} s in)"
            for t, _, c in self.samples
            if c > self.budget_mb
        ]


def write_samples(report: Report, path: Path) -> None:
    """The samples as CSV at `path` and, beside it, a plot of anonymous RSS and cache bytes over time (.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.write_text(
        "seconds,anon_rss_mb,prefix_cache_mb\n" + "".join(f"{t},{r:.1f},{c:.1f}\n" for t, r, c in report.samples)
    )
    fig, ax = plt.subplots(figsize=(7, 4))
    minutes = [t / 60 for t, _, _ in report.samples]
    ax.plot(minutes, [r for _, r, _ in report.samples], marker="o", label="server anonymous RSS")
    ax.plot(minutes, [c for _, _, c in report.samples], marker="o", label="prefix cache")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MB")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def spawned_server(
    model: str, draft: str, parallel: int, context: int, log: Path, cache_mb: int = 0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`specdec serve` on loopback in fp32 (batching cannot change tokens) with a draft model, suffix by default,
    --draft-max 8, both API keys, load control off (every request speculates as asked, at any load) and a prefix
    cache of `cache_mb`; yields (url, process)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        "-m",
        model,
        "-md",
        draft,
        "--dtype",
        "fp32",
        "-np",
        str(parallel),
        "-c",
        str(context),
        "--spec-type",
        "suffix",
        "--draft-max",
        str(DRAFT_MAX),
        "--spec-load-control",
        "off",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEYS[0],
        "--alias",
        "soak",
        "--cache-mb",
        str(cache_mb),
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "SPECDEC_API_KEY": KEYS[1]})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc, 300.0, log)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not start (exit code {proc.poll()}): {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen, log: Path) -> list[str]:
    """SIGTERM: the server must exit 0 within 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        return ["the server did not exit within 60 s of SIGTERM"]
    return [] if rc == 0 else [f"the server exited {rc} on SIGTERM: {log.read_text()[-2000:]}"]


def run(
    model: str,
    draft: str | None = None,
    requests: int = 500,
    concurrency: int = 32,
    parallel: int = 8,
    context: int = 256,
    minutes: float = 0.0,
    seed: int = 0,
    cache_mb: int = 0,
    sample_s: float = 60.0,
) -> Report:
    """Spawn a server, soak it, stop it with SIGTERM; the report includes the server's exit."""
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as tmp:
        log = Path(tmp) / "server.log"
        with spawned_server(model, draft or model, parallel, context, log, cache_mb) as (url, proc):
            report = soak(url, proc.pid, requests, concurrency, minutes, seed, sample_s=sample_s)
            report.problems += _stop(proc, log)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m", help="target: pack name or path (default smollm2-135m)")
    p.add_argument("-md", "--draft", help="draft model (default: the target itself, weight-quantized)")
    p.add_argument("--requests", type=int, default=500, help="requests to send (default 500)")
    p.add_argument("--concurrency", type=int, default=32, help="clients at once (default 32)")
    p.add_argument("-np", "--parallel", type=int, default=8, help="server slots (default 8)")
    p.add_argument("-c", "--context", type=int, default=256, help="context per slot (default 256)")
    p.add_argument("--minutes", type=float, default=0.0, help="start no request after this long (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    p.add_argument(
        "--rss-limit-mb", type=float, default=64.0, help="allowed growth of the server's anonymous RSS (default 64)"
    )
    p.add_argument("--cache-mb", type=int, default=0, help="the server's prefix cache (serve --cache-mb; default 0)")
    p.add_argument(
        "--sample-every",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds between samples of the server's anonymous RSS and prefix-cache bytes (default 60)",
    )
    p.add_argument("--samples", type=Path, metavar="CSV", help="write the samples here, and a plot beside it (.png)")
    args = p.parse_args(argv)
    report = run(
        args.model,
        args.draft,
        args.requests,
        args.concurrency,
        args.parallel,
        args.context,
        args.minutes,
        args.seed,
        args.cache_mb,
        args.sample_every,
    )
    if args.samples:
        write_samples(report, args.samples)
    print(report.summary())
    for line in report.problems:
        print("problem:", line)
    return 0 if report.ok(args.rss_limit_mb) else 1


if __name__ == "__main__":
    sys.exit(main())
