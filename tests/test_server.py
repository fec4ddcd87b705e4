"""The OpenAI-compatible server, live on loopback: the `openai` client, lossless batching, errors,
disconnects, a load run and a schema fuzz run."""

import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

import specdec
from specdec.engine.load_control import LoadController
from specdec.engine.scheduler import Scheduler
from specdec.sampling import SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread

PROMPTS = [
    "def fib(n):",
    "The capital of France is",
    "import numpy as np\n\ndef",
    "Once upon a time",
    "# Sort a list\ndef sort(xs):",
    "1, 2, 3, 4,",
    "<html>\n<body>",
    "The sum of two and two is",
]
SPECS = ["none", "draft", "ngram-simple", "ngram-map-k", "ngram-mod", "suffix", "ngram-mod,draft", "draft"]


class LiveServer(ServerThread):
    def __init__(self, llm, api_key=None, max_queue=64, load_control=True):
        controller = LoadController(llm.engine.spec.draft_max) if load_control else None
        self.scheduler = Scheduler(llm.engine, llm.parallel, max_queue, controller)
        keys = (api_key,) if api_key else ()
        super().__init__(create_app(llm, self.scheduler, ServerConfig("m", SamplingParams(max_tokens=16), keys)))


@pytest.fixture(scope="module")
def smol(smollm_dir):
    """SmolLM2 in fp32 with 16 slots; greedy single-request outputs computed before the server starts."""
    llm = specdec.LLM(
        str(smollm_dir),
        draft=str(smollm_dir),
        spec_type="ngram-simple",
        dtype="fp32",
        context=512,
        parallel=16,
        progress=False,
    )
    bases = {p: llm.generate(p, max_tokens=24, spec_type="none").token_ids for p in PROMPTS}
    srv = LiveServer(llm, load_control=False)  # speculate at any load: the tests check accepted drafts
    srv.llm, srv.bases = llm, bases
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    llm = specdec.LLM(
        str(tiny_dir("llama")), spec_type="ngram-simple", dtype="fp32", context=64, parallel=4, progress=False
    )
    srv = LiveServer(llm, api_key="k", max_queue=4)
    yield srv
    srv.close()


def _client(url, key="x"):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.mark.real
def test_openai_client_chat_completions_streaming_stop_and_seed(smol):
    c = _client(smol.url)
    r = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=20,
        logprobs=True,
        top_logprobs=2,
    )
    assert r.choices[0].message.content and r.usage.completion_tokens <= 20
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and len(lp[0].top_logprobs) == 2
    assert r.model_extra["timings"]["draft_n"] >= r.model_extra["timings"]["draft_n_accepted"] >= 0
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=20, stream=True
        )
    ]
    assert "".join(parts) == r.choices[0].message.content  # greedy: streaming gives the same text
    full = c.completions.create(model="m", prompt="def fib(n):", max_tokens=40).choices[0].text
    cut = c.completions.create(model="m", prompt="def fib(n):", max_tokens=40, stop=["return"])
    assert "return" in full and cut.choices[0].text == full[: full.index("return")]
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(
        c.completions.create(
            model="m",
            prompt="def fib(n):",
            max_tokens=40,
            stop=["return"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut.choices[0].text
    assert chunks[-1].usage.completion_tokens > 0
    sampled = [
        c.completions.create(
            model="m",
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0.9,
            seed=5,
            extra_body={"speculative": {"type": t}},
        )
        .choices[0]
        .text
        for t in ("none", "none", "ngram-simple", "ngram-simple")
    ]
    assert sampled[0] == sampled[1] and sampled[2] == sampled[3]
    assert [m.id for m in c.models.list().data] == ["m"]


@pytest.mark.real
def test_batched_requests_return_plain_decoding_tokens(smol):
    """8 concurrent greedy requests with different spec types (fp32) = plain single-request decoding."""

    def one(i):
        body = {
            "model": "m",
            "prompt": PROMPTS[i],
            "max_tokens": 24,
            "logprobs": 0,
            "speculative": {"type": SPECS[i]} if SPECS[i] != "none" else False,
        }
        return httpx.post(smol.url + "/v1/completions", json=body, timeout=300).json()

    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(8)))
    tok = smol.llm.tokenizer
    for i, out in enumerate(outs):
        text = out["choices"][0]["text"]
        assert text == tok.decode(smol.bases[PROMPTS[i]]), SPECS[i]
        assert out["usage"]["completion_tokens"] == len(smol.bases[PROMPTS[i]])
    assert sum(o["speculative"]["accepted"] for o in outs) > 0


def _cancelled(url: str) -> int:
    """specdec_requests_total{reason="cancelled"} on the server's /metrics (0 before the first)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return next((int(ln.split()[-1]) for ln in lines if ln.startswith('specdec_requests_total{reason="cancelled"}')), 0)


@pytest.mark.real
def test_disconnect_mid_stream_frees_the_slot(smol):
    """A stream whose client leaves frees its slot and is counted in /metrics as cancelled."""
    before = _cancelled(smol.url)
    with httpx.stream(
        "POST",
        smol.url + "/v1/completions",
        timeout=60,
        json={"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    for _ in range(100):
        if httpx.get(smol.url + "/health").json()["running"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(smol.url + "/health").json() == {"status": "ok", "waiting": 0, "running": 0, "free_slots": 16}
    assert _cancelled(smol.url) == before + 1


@pytest.mark.real
def test_disconnect_while_waiting_for_a_plain_response_frees_the_slot(smol):
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
        httpx.post(
            smol.url + "/v1/completions",
            timeout=1.0,
            json={"model": "m", "prompt": "Once upon a time", "max_tokens": 400},
        )
    for _ in range(30):  # well before 400 tokens could be done: the request was cancelled
        if httpx.get(smol.url + "/health").json()["running"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(smol.url + "/health").json()["running"] == 0


@pytest.mark.real
def test_100_requests_at_concurrency_16_no_errors_bounded_memory(smol):
    proc = psutil.Process()

    def one(i):
        return httpx.post(
            smol.url + "/v1/completions",
            timeout=300,
            json={"prompt": PROMPTS[i % 8] + " " * (i % 3), "max_tokens": 6, "temperature": 0.7, "seed": i},
        ).status_code

    with ThreadPoolExecutor(16) as ex:
        assert set(ex.map(one, range(32))) == {200}  # warm-up
        rss = proc.memory_info().rss
        codes = list(ex.map(one, range(100)))
    assert codes.count(200) == 100
    growth_mb = (proc.memory_info().rss - rss) / 2**20
    assert growth_mb < 64, growth_mb  # stated bound: 64 MB over 100 requests
    metrics = httpx.get(smol.url + "/metrics").text
    assert "specdec_requests_total" in metrics and "specdec_engine_spec_steps_total" in metrics
    seconds = {
        k: float(v)
        for k, v in (
            line.split()
            for line in metrics.splitlines()
            if line.startswith(("specdec_engine_prefill_seconds_total", "specdec_engine_step_seconds_total"))
        )
    }
    assert len(seconds) == 2 and all(v > 0 for v in seconds.values())


def test_errors_are_openai_style_with_the_right_codes(tiny):
    h = {"Authorization": "Bearer k"}
    post = lambda path, **kw: httpx.post(tiny.url + path, timeout=60, **kw)  # noqa: E731
    assert post("/v1/completions", json={"prompt": "t1"}).status_code == 401
    r = post("/v1/completions", headers={**h, "content-type": "application/json"}, content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    cases = [
        ({"prompt": "t1", "temperature": "hot"}, 400),
        ({"prompt": "t1", "max_tokens": 0}, 400),
        ({"prompt": "t1", "top_p": 1.5}, 400),
        ({"prompt": "t1", "n": 2}, 400),
        ({"prompt": 5}, 400),
        ({"prompt": "t1 " * 80}, 400),
        ({"prompt": "t1", "model": "gpt-9"}, 404),
        ({"prompt": "t1", "speculative": {"type": "warp"}}, 400),
        ({"prompt": "t1", "speculative": {"type": "draft"}}, 400),
        ({"prompt": "t1", "speculative": {"type": "synthetic"}}, 400),
        ({"prompt": [10**9]}, 400),
    ]
    for body, code in cases:
        r = post("/v1/completions", headers=h, json=body)
        assert r.status_code == code, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = post("/v1/chat/completions", headers=h, json={"messages": [{"role": "user", "content": "t1"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = post("/v1/completions", headers=h, json={"prompt": "t5 t9", "max_tokens": 5, "ignored_field": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    assert httpx.get(tiny.url + "/nope").status_code == 404


def test_full_queue_answers_429_at_once(tiny):
    h = {"Authorization": "Bearer k"}
    body = {"prompt": "t5 t9", "max_tokens": 60, "speculative": False}
    with ThreadPoolExecutor(12) as ex:
        codes = list(
            ex.map(
                lambda _: httpx.post(tiny.url + "/v1/completions", headers=h, json=body, timeout=120).status_code,
                range(12),
            )
        )
    assert set(codes) <= {200, 429} and codes.count(200) >= 4


def test_fuzz_500_requests_against_the_openapi_schema_get_no_5xx(tiny):
    """Schemathesis sends >= 500 generated requests (valid and invalid bodies, 140 of each per POST route) to
    every route of the server's own schema: none gets a 5xx, none streams an internal error, and the server is
    idle and answers after. The tiny model's 64-token context keeps every generation short."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    auth = {"Authorization": "Bearer k"}
    schema = schemathesis.openapi.from_url(tiny.url + "/openapi.json", headers=auth)
    sent: Counter = Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE] if op.method.upper() == "GET" else list(GenerationMode)  # GET: no input
        for mode in modes:

            @settings(max_examples=140, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def check(case):
                r = case.call(base_url=tiny.url, headers=auth, timeout=60)
                sent[op.label] += 1
                assert r.status_code < 500 and "internal_error" not in r.text, (op.label, case.body, r.text)

            check()
    assert sum(sent.values()) >= 500, sent
    assert all(sent[label] for label in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models")), sent
    assert httpx.get(tiny.url + "/health").json() == {"status": "ok", "waiting": 0, "running": 0, "free_slots": 4}
    r = httpx.post(tiny.url + "/v1/completions", headers=auth, json={"prompt": "t5 t9", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5


def test_sigterm_finishes_in_flight_work_and_exits_0(tiny_dir):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "serve",
            "-m",
            str(tiny_dir("llama")),
            "--dtype",
            "fp32",
            "-c",
            "64",
            "--port",
            str(port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(url)
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(httpx.post, url + "/v1/completions", json={"prompt": "t5 t9", "max_tokens": 50}, timeout=60)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            assert fut.result().status_code == 200
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()


def test_metrics_show_the_load_controllers_goodput(tiny):
    h = {"Authorization": "Bearer k"}
    for _ in range(3):
        assert (
            httpx.post(
                tiny.url + "/v1/completions",
                headers=h,
                timeout=60,
                json={"prompt": "t5 t9 t12 t5 t9 t12 t5", "max_tokens": 8},
            ).status_code
            == 200
        )
    lines = [
        ln
        for ln in httpx.get(tiny.url + "/metrics", headers=h).text.splitlines()
        if ln.startswith("specdec_goodput_tokens_per_second{")
    ]
    assert lines and all(float(ln.rsplit(" ", 1)[1]) >= 0 for ln in lines)  # numbers (an arm due to run: left out)


def wait_healthy(url: str, tries: int = 600) -> None:
    """Poll /health until the server (a subprocess still loading) answers 200."""
    for _ in range(tries):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)


def test_bodies_are_json_whatever_their_content_type(tiny):
    """curl -d sends application/x-www-form-urlencoded (Ollama's own examples do): parsed as JSON, as Ollama and
    llama-server parse it, on every API's routes."""
    import json

    auth = {"Authorization": "Bearer k"}
    for path, body in (
        ("/v1/completions", {"prompt": "t1 t2", "max_tokens": 2}),
        ("/completion", {"prompt": "t1 t2", "n_predict": 2}),
        ("/api/generate", {"model": "m", "prompt": "t1 t2", "stream": False, "options": {"num_predict": 2}}),
    ):
        for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
            headers = {**auth, **({"Content-Type": ctype} if ctype else {})}
            r = httpx.post(tiny.url + path, content=json.dumps(body), headers=headers, timeout=60)
            assert r.status_code == 200, (path, ctype, r.text)


def test_one_log_line_per_request(tiny, caplog):
    """A finished request logs its id, route, outcome, tokens, speed and speculation; a refused one its status."""
    import logging

    auth = {"Authorization": "Bearer k"}
    with caplog.at_level(logging.INFO, logger="specdec.access"):
        ok = httpx.post(
            tiny.url + "/v1/completions", json={"prompt": "t1 t2", "max_tokens": 3}, headers=auth, timeout=60
        )
        bad = httpx.post(
            tiny.url + "/v1/completions", json={"prompt": "t1", "temperature": 5}, headers=auth, timeout=60
        )
        for _ in range(100):  # the finished line is written on the server's loop, after the response
            if any(ok.json()["id"] in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.access"]
    assert ok.status_code == 200 and bad.status_code == 400
    done = next(line for line in lines if line.startswith(ok.json()["id"]))
    assert "/v1/completions" in done and "generated" in done and "tok/s" in done and "drafted" in done
    assert any(line.startswith("POST /v1/completions 400 ") for line in lines)


def test_llama_server_and_ollama_info_routes(tiny):
    """llama-server's /tokenize, /detokenize, /props, /slots and Ollama's /api/ps answer as theirs do."""
    auth = {"Authorization": "Bearer k"}

    def post(path, body):
        r = httpx.post(tiny.url + path, json=body, headers=auth, timeout=60)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    ids = post("/tokenize", {"content": "t1 t2 t3"})["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert post("/detokenize", {"tokens": ids})["content"].strip() == "t1 t2 t3"
    pieces = post("/tokenize", {"content": "t1 t2", "with_pieces": True})["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    bad = httpx.post(tiny.url + "/detokenize", json={"tokens": [10**9]}, headers=auth, timeout=60)
    assert bad.status_code == 400
    props = httpx.get(tiny.url + "/props", headers=auth, timeout=60).json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 64
    slots = httpx.get(tiny.url + "/slots", headers=auth, timeout=60).json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and not any(s["is_processing"] for s in slots)
    models = httpx.get(tiny.url + "/api/ps", headers=auth, timeout=60).json()["models"]
    assert len(models) == 1 and models[0]["context_length"] == 64
