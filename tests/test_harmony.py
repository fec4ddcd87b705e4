"""gpt-oss's harmony format: its chat template (the one llama.cpp's source keeps for gpt-oss) renders through ours, and
an answer's ids split into reasoning and content however they are fed (specdec/harmony.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers

from specdec.harmony import HarmonyStream
from specdec.models.tokenizer import Tokenizer
from specdec.tools import ToolCall

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
WORDS = ["assistant", "analysis", "final", "commentary", "to=functions.add", "json", "The", "user", "says", "hi."]
WORDS += ["Hello!", "How", "can", "I", "help?", '{"a":1}']


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A word-level vocabulary with harmony's markers as special tokens (decoded words joined by spaces)."""
    fast = FastTokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]"))
    fast.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast.add_special_tokens(MARKERS)
    d = tmp_path_factory.mktemp("harmony")
    fast.save(str(d / "tokenizer.json"))
    return Tokenizer(d)


def ids(tok: Tokenizer, text: str) -> list[int]:
    """Markers and words of `text` (markers written without spaces around them are split out)."""
    for m in MARKERS:
        text = text.replace(m, f" {m} ")
    return [tok.token_id(w) for w in text.split()]


ANSWER = (
    "<|channel|>analysis<|message|>The user says hi.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
)


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_an_answer_splits_into_reasoning_and_content_however_it_streams(tok, step):
    stream, got = HarmonyStream.of(tok), ["", ""]
    answer = ids(tok, ANSWER)
    for i in range(0, len(answer), step):
        reasoning, content, calls = stream.feed(answer[i : i + step])
        got = [got[0] + reasoning, got[1] + content]
        assert calls == []
    assert got == ["The user says hi.", "Hello! How can I help?"]


CALL = "<|channel|>commentary to=functions.add <|constrain|>json<|message|>" + '{"a":1}' + "<|call|>"


def test_a_message_to_a_function_is_a_call_and_plain_text_passes_through(tok):
    assert HarmonyStream.of(tok).feed(ids(tok, CALL)) == ("", "", [ToolCall("add", {"a": 1})])
    text = "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>" + '{"a":1}' + "<|call|>"
    assert HarmonyStream.of(tok).feed(ids(tok, text)).calls == [ToolCall("add", {"a": 1})]  # recipient in the role
    broken = CALL.replace('{"a":1}', "Hello!")  # not JSON: the text as content
    assert HarmonyStream.of(tok).feed(ids(tok, broken)) == ("", "Hello!", [])
    assert HarmonyStream.of(tok).feed(ids(tok, "Hello! How can I help?")) == ("", "Hello! How can I help?", [])


def test_other_vocabularies_have_no_harmony_stream(tmp_path):
    fast = FastTokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    fast.save(str(tmp_path / "tokenizer.json"))
    assert HarmonyStream.of(Tokenizer(tmp_path)) is None


def test_gpt_oss_chat_template_renders(tok):
    """llama.cpp's copy of gpt-oss's template (its pinned source), rendered by our jinja2 environment: the system
    message as the developer's instructions, the prompt ending where the assistant's first message opens."""
    from families import source

    template = source() / "models" / "templates" / "openai-gpt-oss-120b.jinja"
    if not template.exists():
        pytest.skip(f"no {template.name} in the pinned llama.cpp source")
    tok.chat_template, tok.bos_token, tok.eos_token = template.read_text(), "<|startoftext|>", "<|return|>"
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: medium" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")


def test_openai_chat_answers_carry_reasoning_content(tok):
    """The OpenAI chat wire: streamed, the analysis channel as `reasoning_content` deltas and the final one as
    `content`; whole, both in the message."""
    import json
    from types import SimpleNamespace

    from specdec.server.handler import _Formatter

    fmt = _Formatter(SimpleNamespace(tokenizer=tok), "m", "r", chat=True)
    deltas = []
    for i in ids(tok, ANSWER):
        for line in fmt.piece("ignored", [i], [], None).splitlines():
            if line.startswith("data: "):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user says hi."
    assert "".join(d.get("content", "") for d in deltas) == "Hello! How can I help?"
    seq = SimpleNamespace(output_ids=ids(tok, ANSWER), text="ignored", finish_reason="stop")
    message, finish = fmt._answer(SimpleNamespace(seq=seq))
    assert message == {
        "role": "assistant",
        "content": "Hello! How can I help?",
        "reasoning_content": "The user says hi.",
    }


def test_ollama_chat_answers_carry_thinking(tok):
    """Ollama's chat wire, streamed: the analysis channel as the message's `thinking`."""
    import json

    from specdec.server.ollama import _Wire

    wire, parts = _Wire("m", chat=True, harmony=HarmonyStream.of(tok)), []
    for i in ids(tok, ANSWER):
        parts += [json.loads(line)["message"] for line in wire.piece("ignored", [i], [], None).splitlines()]
    assert "".join(p.get("thinking", "") for p in parts) == "The user says hi."
    assert "".join(p["content"] for p in parts) == "Hello! How can I help?"


def test_the_chat_loop_prints_the_final_channel_and_the_reasoning_apart(tok):
    import io
    from types import SimpleNamespace

    from specdec import chat
    from specdec.stats import Stats

    result = SimpleNamespace(text="raw", token_ids=ids(tok, ANSWER), stats=Stats(), synthetic=False)
    cfg = SimpleNamespace(fast_prefill=False, accept_threshold=0)
    llm = SimpleNamespace(
        tokenizer=tok, spec_type="none", config=cfg, encode_chat=lambda m: [1], generate=lambda ids, **k: result
    )
    out, err = io.StringIO(), io.StringIO()
    assert chat.run(llm, None, io.StringIO("Hi\n"), out, err) == 0
    assert out.getvalue() == "Hello! How can I help?\n" and "[reasoning] The user says hi." in err.getvalue()


def test_openai_chat_answers_carry_harmony_tool_calls(tok):
    """A call message comes back as a `tool_calls` entry, streamed and whole, and the answer ends with
    finish_reason "tool_calls"."""
    import json
    from types import SimpleNamespace

    from specdec.server.handler import _Formatter

    answer = ids(tok, "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant" + CALL)
    fmt, deltas = _Formatter(SimpleNamespace(tokenizer=tok), "m", "r", chat=True), []
    for i in answer:
        deltas += [json.loads(x[6:])["choices"][0]["delta"] for x in fmt.piece("", [i], [], None).splitlines() if x]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("add", {"a": 1})]
    assert fmt.sent_calls == 1
    seq = SimpleNamespace(output_ids=answer, text="ignored", finish_reason="stop")
    message, finish = fmt._answer(SimpleNamespace(seq=seq))
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "add"
    assert message["content"] == "" and message["reasoning_content"] == "The user says hi."


def test_constrained_chat_is_refused_for_harmony(tok):
    """A grammar would force the answer's first tokens, where gpt-oss opens a channel: a clear 400 instead."""
    from types import SimpleNamespace

    from specdec.server.handler import Handler
    from specdec.server.protocol import APIError, ChatRequest

    handler = Handler.__new__(Handler)
    handler.llm = SimpleNamespace(tokenizer=tok)
    body = ChatRequest(messages=[{"role": "user", "content": "Hi"}], response_format={"type": "json_object"})
    with pytest.raises(APIError, match="harmony") as e:
        handler._grammar(body)
    assert e.value.status == 400
