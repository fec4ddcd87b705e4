"""Constrained output, tool calls and the chat loop on SmolLM2-135M (its GGUF through the kernels): a schema-constrained
answer with speculation equals the constrained plain one, drafts made and accepted (chains and trees, greedy and
seeded); both JSON modes and tool calls through the `openai` and `ollama` clients; what cannot be honoured is a 400;
`specdec chat` and `generate -cnv` driven through a pipe."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import httpx
import pytest

import specdec
from specdec import chat
from specdec.engine.scheduler import Scheduler
from specdec.sampling import SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread

pytestmark = pytest.mark.real

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
}
PEOPLE = {"type": "array", "minItems": 3, "maxItems": 3, "items": PERSON}
PROMPT = "List three people as JSON objects with a name, an age and a city."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(smollm_dir):
    # adaptive off: every step drafts what its drafter finds
    return specdec.LLM("smollm2-135m", spec_type="none", context=768, adaptive=False, draft_max=6, progress=False)


def _people(text: str) -> list[dict]:
    people = json.loads(text)
    assert len(people) == 3 and all(set(p) == {"name", "age", "city"} and isinstance(p["age"], int) for p in people)
    return people


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}], ids=["greedy", "seeded"])
def test_a_constrained_answer_with_speculation_equals_the_constrained_plain_one(llm, sampling):
    grammar = specdec.Grammar.json_schema(PEOPLE)
    plain = llm.generate(PROMPT, max_tokens=200, chat=True, grammar=grammar, **sampling)
    _people(plain.text)
    assert plain.finish_reason == "stop"
    for spec in ("ngram-simple", "suffix-tree"):
        r = llm.generate(PROMPT, max_tokens=200, chat=True, grammar=grammar, spec_type=spec, **sampling)
        assert r.token_ids == plain.token_ids, spec
        assert r.stats.drafted > 0 and r.stats.accepted > 0, (spec, r.stats.to_dict())


def test_unconstrained_text_is_not_json_so_the_constraint_did_the_work(llm):
    free = llm.generate(PROMPT, max_tokens=40, chat=True)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)


@pytest.fixture(scope="module")
def server(smollm_dir):
    model = specdec.LLM("smollm2-135m", spec_type="suffix-tree", context=768, parallel=2, progress=False)
    srv = ServerThread(create_app(model, Scheduler(model.engine, 2), ServerConfig("smollm2-135m", SamplingParams())))
    yield srv
    srv.close()


def test_json_modes_and_tool_calls_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ask = dict(model="smollm2-135m", max_tokens=200)
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": PROMPT}], response_format={"type": "json_object"}, **ask
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}
    r = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], response_format=schema, **ask)
    _people(r.choices[0].message.content)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice=choice, **ask)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)
    stream = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required", stream=True, **ask)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [c for choice in chunks for c in choice.delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and chunks[-1].finish_reason == "tool_calls"
    # the call and its result go back in: the conversation renders and is answered
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(messages=history, tools=[WEATHER], max_tokens=16, model="smollm2-135m")
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_modes_and_tool_calls_through_the_ollama_client(server):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url)
    opts = {"num_predict": 200}
    r = client.chat("smollm2-135m", messages=[{"role": "user", "content": PROMPT}], format="json", options=opts)
    assert isinstance(json.loads(r.message.content), dict)
    r = client.chat("smollm2-135m", messages=[{"role": "user", "content": PROMPT}], format=PEOPLE, options=opts)
    _people(r.message.content)
    r = client.generate("smollm2-135m", PROMPT, format=PERSON, options=opts)
    assert set(json.loads(r.response)) == {"name", "age", "city"}
    r = client.chat("smollm2-135m", messages=ASK, tools=[WEATHER], options={**opts, "tool_choice": "required"})
    assert r.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(r.message.tool_calls[0].function.arguments["city"], str)
    parts = list(
        client.chat(
            "smollm2-135m", messages=ASK, tools=[WEATHER], stream=True, options={**opts, "tool_choice": "required"}
        )
    )
    streamed = [c for part in parts for c in part.message.tool_calls or []]
    assert streamed[0].function.name == "get_weather" and parts[-1].done


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, None),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/completions", {"json_schema": "{not json"}, "json_schema"),
        ("/completion", {"grammar": "root ::= ("}, None),
        ("/api/chat", {"format": 3}, None),
    ],
)
def test_what_cannot_be_honoured_is_a_400(server, path, body, field):
    base = {"messages": ASK} if "chat" in path else {"prompt": "hello"}
    r = httpx.post(server.url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    if field and path.startswith("/v1"):
        assert r.json()["error"]["param"] == field


def test_the_chat_loop_keeps_the_conversation_and_its_kv(llm):
    cached = specdec.LLM("smollm2-135m", spec_type="ngram-simple", context=768, cache_mb=64, progress=False)
    seqs = []
    generate = cached.engine.generate
    cached.engine.generate = lambda *a, **k: seqs.append(generate(*a, **k)) or seqs[-1]
    out, err = io.StringIO(), io.StringIO()
    assert (
        chat.run(
            cached, None, io.StringIO("Hello!\nAnd who are you?\n/clear\nHi\n/bye\nignored\n"), out, err, max_tokens=8
        )
        == 0
    )
    assert len(seqs) == 3 and err.getvalue().count("[ngram-simple]") == 3 and "conversation cleared" in err.getvalue()
    first, second, fresh = seqs
    assert second.tokens[: len(first.tokens) - 1] == first.tokens[:-1]  # the second turn carries the first
    assert second.cached_tokens >= first.prompt_len  # and prefills only what is new
    assert fresh.prompt_len < second.prompt_len  # /clear started over


@pytest.mark.parametrize("command", [["chat"], ["generate", "-cnv"]])
def test_the_chat_loop_through_a_pipe(smollm_dir, command):
    run = subprocess.run(
        [sys.executable, "-m", "specdec.cli", *command, "-m", "smollm2-135m", "-n", "6", "--spec-type", "ngram-simple"],
        input="Hello!\nWhat is two plus two?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("[ngram-simple]") == 2 and run.stdout.strip()
