"""Reasoning between <think> and </think> (specdec/think.py): split from an answer's text however it streams, through
the OpenAI chat wire and the chat loop."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers

from specdec.models.tokenizer import Tokenizer
from specdec.think import ThinkStream

ANSWER = "<think>\nThe user says hi.\n</think>\n\nHello! How can I help?"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A word-level vocabulary with the two tags as added (not special) tokens, as Qwen3's are."""
    words = ["[UNK]", "Hi", "user", "assistant"]
    fast = FastTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    fast.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast.add_tokens(["<think>", "</think>"])
    d = tmp_path_factory.mktemp("think")
    fast.save(str(d / "tokenizer.json"))
    return Tokenizer(d)


def split(stream: ThinkStream, text: str, step: int) -> tuple[str, str]:
    parts = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_splits_from_the_answer_however_it_streams(step):
    assert split(ThinkStream(), ANSWER, step) == ("\nThe user says hi.\n", "Hello! How can I help?")
    assert split(ThinkStream(), "  " + ANSWER, step)[1] == "Hello! How can I help?"
    assert split(ThinkStream(), "Hello! <think> is a tag.", step) == ("", "Hello! <think> is a tag.")
    opened = ANSWER.removeprefix("<think>")  # the template opened the block: only </think> comes
    assert split(ThinkStream(open_in_prompt=True), opened, step) == ("\nThe user says hi.\n", "Hello! How can I help?")
    assert split(ThinkStream(), "<think>unfinished", step) == ("unfinished", "")
    assert split(ThinkStream(), "<thi", step) == ("", "<thi")


def test_a_stream_knows_the_tags_and_a_prompt_that_opened_the_block(tok, tmp_path):
    assert ThinkStream.of(tok, tok.encode("user Hi assistant")).open_in_prompt is False
    assert ThinkStream.of(tok, tok.encode("user Hi assistant <think>")).open_in_prompt is True
    FastTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert ThinkStream.of(Tokenizer(tmp_path), [0]) is None


def test_openai_chat_answers_carry_reasoning_content(tok):
    from specdec.server.handler import _Formatter

    fmt = _Formatter(SimpleNamespace(tokenizer=tok), "m", "r", chat=True, prompt_ids=tok.encode("user Hi assistant"))
    lines = [fmt.piece(ANSWER[i : i + 4], [], [], None) for i in range(0, len(ANSWER), 4)]
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in "".join(lines).splitlines() if x]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nThe user says hi.\n"
    assert "".join(d.get("content", "") for d in deltas) == "Hello! How can I help?"
    seq = SimpleNamespace(output_ids=[], text=ANSWER, finish_reason="stop")
    message, _ = fmt._answer(SimpleNamespace(seq=seq))
    assert message["content"] == "Hello! How can I help?" and message["reasoning_content"] == "\nThe user says hi.\n"


def test_the_chat_loop_prints_reasoning_on_stderr(tok):
    from specdec import chat
    from specdec.stats import Stats

    def generate(ids, on_text=None, **_):
        for i in range(0, len(ANSWER), 5):
            on_text(ANSWER[i : i + 5])
        return SimpleNamespace(text=ANSWER, token_ids=[], stats=Stats(), synthetic=False)

    cfg = SimpleNamespace(fast_prefill=False, accept_threshold=0)
    llm = SimpleNamespace(tokenizer=tok, spec_type="none", config=cfg, encode_chat=lambda m: [1], generate=generate)
    out, err = io.StringIO(), io.StringIO()
    assert chat.run(llm, None, io.StringIO("Hi\n"), out, err) == 0
    assert out.getvalue() == "Hello! How can I help?\n"
    assert err.getvalue().startswith("[reasoning] \nThe user says hi.\n\n")
