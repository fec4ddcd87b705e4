"""Other engines' server APIs on a live server: Ollama's /api/chat, /api/generate, /api/tags, /api/version (the
`ollama` client), llama-server's /completion (plain and SSE, `timings`), transformers' assisted-generation words per
request, and each API's error format (docs/compat.md)."""

import json
import shutil
import time

import httpx
import pytest

import specdec
from specdec import compat
from specdec.drafters import Drafter
from specdec.engine.scheduler import QueueFull, Scheduler
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread

ollama = pytest.importorskip("ollama")

KEY = {"Authorization": "Bearer k"}
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}t2 {{ m['content'] }} t3 "
    "{% else %}{{ m['content'] }} t0 {% endif %}{% endfor %}{% if add_generation_prompt %}t4{% endif %}"
)
USER = [{"role": "user", "content": "t5 t6 t7 t5 t6"}]


@pytest.fixture(scope="module")
def tiny(tiny_dir, tmp_path_factory):
    """A tiny llama with a chat template behind an API key; ngram-mod speculation, n-gram matches of 2 then 1 (so
    transformers' prompt_lookup_num_tokens fits the server)."""
    d = tmp_path_factory.mktemp("compat") / "llama"
    shutil.copytree(tiny_dir("llama"), d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    llm = specdec.LLM(
        str(d), spec_type="ngram-mod", ngram_n=2, ngram_min=1, dtype="fp32", context=64, parallel=2, progress=False
    )
    scheduler = Scheduler(llm.engine, 2)
    srv = ServerThread(create_app(llm, scheduler, ServerConfig("m", SamplingParams(max_tokens=16), ("k",))))
    srv.llm, srv.scheduler = llm, scheduler
    yield srv
    srv.close()


def _post(srv, path, body, headers=KEY) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def _openai(srv, **body) -> dict:
    r = _post(srv, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_ollama_client_chat_and_generate(tiny):
    c = ollama.Client(host=tiny.url, headers=KEY)
    opts = {"temperature": 0, "num_predict": 8}
    r = c.chat(model="m", messages=USER, options=opts)
    want = _openai(tiny, messages=USER, max_tokens=8)
    assert r.message.content == _text(want) and r.message.role == "assistant"
    assert r.done and r.done_reason == want["choices"][0]["finish_reason"]
    assert r.eval_count == want["usage"]["completion_tokens"] and r.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration - 1 and r.eval_duration > 0
    parts = list(c.chat(model="m:latest", messages=USER, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == r.eval_count

    g = c.generate(model="m", prompt="t5 t6 t7", system="t9", options=opts)  # in the template, with the system
    assert g.response == _text(
        _openai(
            tiny, messages=[{"role": "system", "content": "t9"}, {"role": "user", "content": "t5 t6 t7"}], max_tokens=8
        )
    )
    raw = c.generate(model="m", prompt="t5 t6 t7", raw=True, options=opts)
    assert raw.response == _text(_openai(tiny, prompt="t5 t6 t7", max_tokens=8))
    assert raw.context == tiny.llm.encode("t5 t6 t7") + tiny.llm.encode(raw.response)
    more = c.generate(model="m", prompt="t8", raw=True, context=raw.context, options=opts)  # a conversation goes on
    assert more.response == _text(_openai(tiny, prompt=raw.context + tiny.llm.encode("t8"), max_tokens=8))
    streamed = list(c.generate(model="m", prompt="t5 t6 t7", raw=True, options=opts, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].context == raw.context

    assert c.chat(model="m", messages=[]).done_reason == "load"  # Ollama's way to load a model
    assert c.generate(model="m", prompt="").done_reason == "load"
    assert [m.model for m in c.list().models] == ["m:latest"]
    shown = c.show("m:latest")
    assert shown.modelinfo["llama.context_length"] == 64 and shown.template == TEMPLATE
    assert httpx.get(tiny.url + "/api/version").json() == {"version": specdec.__version__}


def test_ollama_without_stream_field_streams_ndjson_with_specdecs_stats(tiny):
    with httpx.stream(
        "POST",
        tiny.url + "/api/chat",
        headers=KEY,
        timeout=60,
        json={"model": "m", "messages": USER, "options": {"num_predict": 6, "seed": -1}},
    ) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    last = lines[-1]
    assert last["done"] and last["eval_count"] == last["timings"]["predicted_n"] <= 6
    assert last["speculative"]["type"] == "ngram-mod" and last["lossless"] is True


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"options": {"num_ctx": 65}}, 400, "context is 64"),
        ({"model": "nope"}, 404, "nope"),
        ({"options": {"repeat_penalty": 1.3}}, 400, "repeat_penalty"),
        ({"think": True}, 400, "think"),
        ({"options": {"temperature": "hot"}}, 400, "options.temperature"),
        ({"options": {"num_predict": 0}}, 400, "options.num_predict"),
        ({"options": {"seed": 2**63}}, 400, "options.seed"),
        ({"messages": [{"role": "user", "content": "t5", "images": ["aGk="]}]}, 400, "images"),
    ],
)
def test_ollama_errors_in_ollamas_format(tiny, body, status, words):
    c = ollama.Client(host=tiny.url, headers=KEY)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(**{"model": "m", "messages": USER, **body})
    assert e.value.status_code == status and words in e.value.error, e.value.error


def test_ollama_no_key_bad_json_and_neutral_options(tiny):
    r = _post(tiny, "/api/chat", {"model": "m", "messages": USER}, headers={})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = httpx.post(tiny.url + "/api/generate", content=b"{not json", headers=KEY, timeout=60)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    ok = {
        "model": "m",
        "messages": USER,
        "stream": False,
        "options": {"num_ctx": 64, "repeat_penalty": 1.0, "num_thread": 2, "num_predict": 4},
    }
    assert _post(tiny, "/api/chat", ok).status_code == 200


def test_llama_server_completion_plain_and_streamed(tiny):
    want = _openai(tiny, prompt="t5 t6 t7", max_tokens=10)
    r = _post(tiny, "/completion", {"prompt": "t5 t6 t7", "n_predict": 10, "temperature": 0, "cache_prompt": True})
    got = r.json()
    assert r.status_code == 200 and got["content"] == _text(want) and got["stop"] is True
    assert got["tokens_predicted"] == want["usage"]["completion_tokens"]
    assert got["tokens_evaluated"] == want["usage"]["prompt_tokens"]
    assert got["stop_type"] == {"length": "limit", "stop": "eos"}[want["choices"][0]["finish_reason"]]
    assert set(got["timings"]) >= {
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "draft_n",
        "draft_n_accepted",
    }
    with httpx.stream(
        "POST",
        tiny.url + "/completion",
        headers=KEY,
        timeout=60,
        json={"prompt": "t5 t6 t7", "n_predict": 10, "stream": True},
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == got["content"] and events[-1]["timings"]["predicted_n"] > 0

    words = got["content"].split()
    if len(words) >= 3:  # a stop string: cut there, stop_type word
        cut = _post(tiny, "/completions", {"prompt": "t5 t6 t7", "n_predict": 10, "stop": [words[2]]}).json()
        assert cut["stop_type"] == "word" and cut["stopping_word"] == words[2]
        assert cut["content"] == got["content"][: got["content"].index(words[2])]
    whole = _post(tiny, "/completion", {"prompt": "t5 t6 t7", "n_predict": -1}).json()  # to the end of the context
    assert whole["stop_type"] == "eos" or whole["tokens_evaluated"] + whole["tokens_predicted"] == 64


@pytest.mark.parametrize(
    "body, status, kind, words",
    [
        ({"prompt": "t5 " * 80}, 400, "exceed_context_size_error", "context"),
        ({"prompt": "t5", "repeat_penalty": 1.2}, 400, "invalid_request_error", "repeat_penalty"),
        ({"prompt": "t5", "n_predict": 0}, 400, "invalid_request_error", "n_predict"),
        ({"prompt": 5}, 400, "invalid_request_error", "prompt"),
    ],
)
def test_llama_server_errors_in_its_format(tiny, body, status, kind, words):
    r = _post(tiny, "/completion", body)
    err = r.json()["error"]
    assert r.status_code == status and err["code"] == status and err["type"] == kind and words in err["message"]
    r = _post(tiny, "/completion", {"prompt": "t5"}, headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_full_queue_is_429_in_each_apis_format(tiny, monkeypatch):
    def full(_req):
        raise QueueFull("every slot is busy and the queue is full (0 waiting requests)")

    monkeypatch.setattr(tiny.scheduler, "submit", full)
    r = _post(tiny, "/api/chat", {"model": "m", "messages": USER, "stream": False})
    assert r.status_code == 429 and "queue is full" in r.json()["error"]
    r = _post(tiny, "/completion", {"prompt": "t5"})
    assert r.status_code == 429 and r.json()["error"]["code"] == 429
    r = _post(tiny, "/v1/completions", {"prompt": "t5"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


class _Boom(Drafter):
    name = "boom"

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        raise RuntimeError("secret-internal-detail")


def test_a_failing_request_is_a_500_in_each_apis_format_whole_and_streamed(tiny, monkeypatch):
    monkeypatch.setattr(tiny.llm, "drafter_for", lambda spec_type, scope=None, options=None: _Boom())
    # fixed draft lengths: the drafter is asked at every step (an adaptive length that the costs measured by
    # earlier tests judge not to pay would draft nothing, and nothing would fail)
    monkeypatch.setattr(tiny.llm.engine.spec, "adaptive", False)
    boom = {"speculative": {"type": "ngram-simple"}}
    c = ollama.Client(host=tiny.url, headers=KEY)
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            list(c.chat(model="m", messages=USER, options=boom, stream=True)) if stream else c.chat(
                model="m", messages=USER, options=boom
            )
        assert "internal server error (request id ollama-" in e.value.error and "secret" not in e.value.error
    r = _post(tiny, "/completion", {"prompt": "t5 t6", **boom})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "secret" not in r.text
    with httpx.stream(
        "POST", tiny.url + "/completion", headers=KEY, timeout=60, json={"prompt": "t5 t6", "stream": True, **boom}
    ) as s:
        last = json.loads([line for line in s.iter_lines() if line][-1][6:])
    assert last["error"]["code"] == 500 and "secret" not in json.dumps(last)


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate", "/completion"])
def test_transformers_words_per_request(tiny, path):
    def ask(**words):
        body = {"prompt": "t5 t6 t7 t5 t6", "stream": False}
        if path == "/api/generate":
            body.update(model="m", raw=True, options={"num_predict": 8, **words})
        else:
            body.update(words, **({"n_predict": 8} if path == "/completion" else {"max_tokens": 8}))
        return _post(tiny, path, body)

    r = ask(prompt_lookup_num_tokens=4)
    assert r.status_code == 200 and r.json()["speculative"]["type"] == "ngram-simple", r.text
    r = ask(num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic")
    assert r.status_code == 200 and r.json()["speculative"]["type"] == "ngram-mod"
    for bad in (
        {"assistant_model": "other-model"},
        {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3},
        {"num_assistant_tokens_schedule": "constant"},
    ):
        r = ask(**bad)
        msg = json.dumps(r.json())
        assert r.status_code == 400 and "per request only the spec type" in msg, msg
    r = ask(prompt_lookup_num_tokens=4, speculative=False)
    assert r.status_code == 400 and "not both" in json.dumps(r.json())


def test_for_request_keeps_the_servers_other_settings():
    server = {
        "draft": "/packs/smollm2-135m.gguf",
        "draft_max": 8,
        "ngram_n": 2,
        "ngram_min": 1,
        "ngram_m": 16,
        "adaptive": True,
        "draft_p_min": 0.0,
        "spec_exit_layer": 0,
    }
    assert compat.for_request({"assistant_model": "smollm2-135m", "num_assistant_tokens": 5}, server) == {
        "spec_type": "draft",
        "draft_max": 5,
    }  # the server's -md, named by its stem
    assert compat.for_request({"prompt_lookup_num_tokens": 10, "assistant_confidence_threshold": 0}, server) == {
        "spec_type": "ngram-simple",
        "draft_max": 10,
    }
    with pytest.raises(SpecdecError, match="ngram_m=20, but this server or LLM runs ngram_m=16"):
        compat.for_request({"prompt_lookup_num_tokens": 20}, {**server, "draft_max": 32})
    with pytest.raises(SpecdecError, match="draft_p_min=0.5"):
        compat.for_request({"assistant_confidence_threshold": 0.5}, server)
    with pytest.raises(SpecdecError, match="unknown transformers argument"):
        compat.for_request({"assistant_tokenizer": "x"}, server)


@pytest.mark.real
def test_smollm_greedy_text_equals_plain_decoding(smollm_dir):
    """SmolLM2-135M in fp32 with n-gram speculation: /api/chat (whole and streamed) and /completion give the text of
    plain greedy decoding; a client leaving an Ollama stream cancels its request."""
    llm = specdec.LLM(
        str(smollm_dir), spec_type="ngram-simple", dtype="fp32", context=256, parallel=2, progress=False, adaptive=False
    )  # fixed draft lengths: an adaptive one may draft nothing
    chat = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    plain_chat = llm.generate(llm.encode_chat(chat), max_tokens=24, spec_type="none").text
    # code that goes on with lines of its own: n-gram drafts are accepted
    code = (
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fact(n):\n"
        "    if n < 2:\n        return 1\n"
    )
    plain = llm.generate(code, max_tokens=24, spec_type="none").text
    scheduler = Scheduler(llm.engine, 2)
    srv = ServerThread(create_app(llm, scheduler, ServerConfig("smol", SamplingParams(max_tokens=16))))
    try:
        c = ollama.Client(host=srv.url)
        opts = {"temperature": 0, "num_predict": 24}
        assert c.chat(model="smol", messages=chat, options=opts).message.content == plain_chat
        assert (
            "".join(p.message.content for p in c.chat(model="smol", messages=chat, options=opts, stream=True))
            == plain_chat
        )
        r = _post(srv, "/completion", {"prompt": code, "n_predict": 24, "temperature": 0}, headers={})
        timings = r.json()["timings"]
        assert r.json()["content"] == plain and timings["draft_n"] >= timings["draft_n_accepted"] > 0, timings
        cancelled = []
        cancel = scheduler.cancel
        scheduler.cancel = lambda req: (cancelled.append(req), cancel(req))
        with httpx.stream(
            "POST",
            srv.url + "/api/chat",
            timeout=60,
            json={"model": "smol", "messages": chat, "options": {"num_predict": -1}},
        ) as s:
            next(s.iter_lines())
        for _ in range(100):
            if cancelled and httpx.get(srv.url + "/health").json()["running"] == 0:
                break
            time.sleep(0.1)
        assert cancelled and httpx.get(srv.url + "/health").json()["running"] == 0
    finally:
        srv.close()
