"""Who gets in and what they see: API keys (constant-time, from env or file, several), the OpenAPI schema
behind the key, the Host header check without a key (DNS rebinding), no internal exception text in error
bodies, and drafter memory scoped per API key."""

import contextlib
import json
import logging

import httpx
import pytest

import specdec
from specdec.drafters import Drafter
from specdec.engine.scheduler import Scheduler
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.server import handler as server_handler
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread, api_keys

PROMPT = "t5 t9 t13 t17 t21"


def _llm(tiny_dir, spec_type: str = "ngram-simple", **kw) -> specdec.LLM:
    """Fixed draft lengths (adaptive off), so acceptance statistics are repeatable."""
    return specdec.LLM(
        str(tiny_dir("llama")),
        spec_type=spec_type,
        dtype="fp32",
        context=128,
        parallel=2,
        progress=False,
        adaptive=False,
        **kw,
    )


@contextlib.contextmanager
def _serve(llm, **cfg):
    """A live server on 127.0.0.1 (no load controller: speculation at any load)."""
    scheduler = Scheduler(llm.engine, llm.parallel, 8)
    srv = ServerThread(create_app(llm, scheduler, ServerConfig("m", SamplingParams(max_tokens=16), **cfg)))
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return _llm(tiny_dir)


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys_are_compared_in_constant_time_and_any_configured_key_passes(llm, monkeypatch):
    calls = []

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    real = server_handler.hmac.compare_digest
    monkeypatch.setattr(server_handler.hmac, "compare_digest", spy)
    with _serve(llm, api_keys=("alpha", "b", "gamma-key")) as srv:
        for key in ("alpha", "b", "gamma-key"):
            calls.clear()
            assert httpx.get(srv.url + "/v1/models", headers=_bearer(key)).status_code == 200
            assert calls == [(32, 32)] * 3  # every key checked, digests of equal length: no early exit
        for headers in ({}, _bearer("alph"), _bearer("alpha2"), {"Authorization": "alpha"}):
            r = httpx.get(srv.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_keys_come_from_argv_env_and_a_file(tmp_path, monkeypatch):
    from specdec.cli import make_parser

    f = tmp_path / "keys"
    f.write_text("# team keys\nk-file-1\n\n  k-file-2  \nk-argv\n")
    a = make_parser().parse_args(["serve", "--api-key", "k-argv", "--api-key-file", str(f)])
    monkeypatch.setenv("SPECDEC_API_KEY", "k-env")
    assert api_keys(a) == ("k-argv", "k-env", "k-file-1", "k-file-2")
    monkeypatch.delenv("SPECDEC_API_KEY")
    assert api_keys(make_parser().parse_args(["serve"])) == ()
    f.write_text("# none\n\n")
    with pytest.raises(SpecdecError, match="holds no keys"):
        api_keys(a)
    with pytest.raises(SpecdecError, match="cannot read"):
        api_keys(make_parser().parse_args(["serve", "--api-key-file", str(tmp_path / "missing")]))


def test_help_names_the_security_flags(capsys):
    from specdec.cli import make_parser

    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--api-key-file", "SPECDEC_API_KEY", "--allow-host", "--spec-shared-memory"):
        assert flag in out


def test_openapi_schema_needs_the_key_and_docs_are_off(llm):
    with _serve(llm, api_keys=("k",)) as srv:
        r = httpx.get(srv.url + "/openapi.json")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        schema = httpx.get(srv.url + "/openapi.json", headers=_bearer("k")).json()
        assert "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert httpx.get(srv.url + path, headers=_bearer("k")).status_code == 404


def test_without_a_key_only_local_host_names_get_in(llm):
    from openai import OpenAI

    with _serve(llm) as srv:
        port = srv.url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LocalHost", "127.0.0.1"):
            assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
        for path in ("/v1/models", "/health", "/metrics", "/openapi.json"):
            r = httpx.get(srv.url + path, headers={"Host": f"rebind.example:{port}"})
            assert r.status_code == 403, path
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("permission_error", "host_not_allowed")
            assert "--allow-host rebind.example" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", headers={"Host": "rebind.example"}, json={"prompt": PROMPT})
        assert r.status_code == 403
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["m"]
    with _serve(llm, host="0.0.0.0", allowed_hosts=("Rebind.Example", "[fd00::5]")) as srv:
        for host in ("rebind.example:80", "[fd00::5]:8080", "0.0.0.0:1"):
            assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 200, host
        assert httpx.get(srv.url + "/health", headers={"Host": "other.example"}).status_code == 403
    with _serve(llm, allowed_hosts=("*",)) as srv:
        assert httpx.get(srv.url + "/health", headers={"Host": "any.example"}).status_code == 200
    with _serve(llm, api_keys=("k",)) as srv:  # a key protects the server: no Host check
        r = httpx.get(srv.url + "/v1/models", headers={"Host": "rebind.example", **_bearer("k")})
        assert r.status_code == 200


class _Boom(Drafter):
    name = "boom"

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        raise RuntimeError("secret-internal-detail /home/user/model.py")


def _broken_tokenizer(_text: str) -> list[int]:
    raise ValueError("tokenizer secret")


def _request_id(err: dict) -> str:
    return err["message"].split("request id ")[1].split(";")[0]


def test_internal_errors_are_logged_with_a_request_id_not_returned(llm, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="specdec.server.handler")
    with _serve(llm) as srv:
        monkeypatch.setattr(llm, "drafter_for", lambda spec_type, scope=None, options=None: _Boom())
        boom = {"type": "ngram-simple"}  # -> drafter_for -> _Boom
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "speculative": boom}, timeout=60
        )
        assert r.status_code == 500 and "secret" not in r.text and "RuntimeError" not in r.text
        err = r.json()["error"]
        assert err["code"] == "internal_error" and err["type"] == "server_error"
        rid = _request_id(err)
        assert rid.startswith("cmpl-") and any(rid in m and "secret-internal-detail" in m for m in caplog.messages)
        body = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 8, "stream": True, "speculative": boom}
        monkeypatch.setattr(llm, "encode_chat", lambda _messages, _tools=None: [5, 9, 13])
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        err = events[-1]["error"]
        assert err["code"] == "internal_error" and "secret" not in json.dumps(events)
        assert any(_request_id(err) in m and "secret-internal-detail" in m for m in caplog.messages)
        monkeypatch.setattr(llm, "encode", _broken_tokenizer)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error" and "secret" not in r.text


def test_user_errors_keep_their_message(llm):
    with _serve(llm) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "t1 " * 200}, timeout=60)
        assert r.status_code == 400 and "context is 128 tokens" in r.json()["error"]["message"]


def _stats(srv, key: str | None, speculative) -> tuple[int, int]:
    body = {"prompt": PROMPT, "max_tokens": 40, "speculative": speculative}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=_bearer(key) if key else {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["speculative"]["drafted"], r.json()["speculative"]["accepted"]


SPECULATIVE = [None, {"type": "ngram-mod"}, {"type": "ngram-mod,ngram-simple"}, {"type": "suffix-tree"}]


@pytest.mark.parametrize("speculative", SPECULATIVE, ids=lambda s: s["type"] if s else "server")
def test_drafter_memory_is_per_api_key(tiny_dir, speculative):
    """Key b's request sees none of key a's text: its drafts and acceptances equal a first request's,
    while key a's own repeat is drafted from memory."""
    with _serve(_llm(tiny_dir, "suffix"), api_keys=("ka", "kb")) as srv:
        first = _stats(srv, "ka", speculative)
        assert _stats(srv, "kb", speculative) == first
        assert _stats(srv, "ka", speculative)[1] > first[1]


@pytest.mark.parametrize("cfg", [dict(api_keys=("ka", "kb"), shared_memory=True), dict()], ids=["shared", "no-key"])
def test_drafter_memory_is_shared_with_the_flag_or_without_keys(tiny_dir, cfg):
    keys = cfg.get("api_keys", (None, None))
    with _serve(_llm(tiny_dir, "suffix"), **cfg) as srv:
        first = _stats(srv, keys[0], None)
        assert _stats(srv, keys[1], None)[1] > first[1]


def test_scoped_drafters_share_the_draft_model(tiny_dir):
    llm = _llm(tiny_dir, "ngram-mod,draft", draft=str(tiny_dir("llama")))
    a, b = llm.drafter_for("ngram-mod,draft", 0), llm.drafter_for("ngram-mod,draft", 1)
    assert a is not b and a is not llm.drafter and a is llm.drafter_for("ngram-mod, draft", 0)
    assert a.members[0] is llm.drafter_for("ngram-mod", 0) is not b.members[0]
    assert a.members[1] is b.members[1] is llm.drafter_for("draft", 0) is llm.drafter_for("draft")
    assert llm.drafter_for("none", 0) is None
