"""Grammars as masks (specdec/constraint.py) and tool calls (specdec/tools.py), on SmolLM2's and a word tokenizer."""

import json

import pytest
import torch

from specdec import tools
from specdec.constraint import Constraint, Grammar, GrammarError, check, schema_text
from specdec.models.tokenizer import Tokenizer
from specdec.sequence import Draft

pytestmark = pytest.mark.real

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def tok(smollm_dir) -> Tokenizer:
    return Tokenizer(smollm_dir)


def _constraint(tok: Tokenizer, grammar: Grammar) -> tuple[Constraint, set[int]]:
    stop = {tok.token_id(tok.eos_token)}
    return Constraint(grammar, tok, tok.vocab_size, stop), stop


def test_mask_follows_the_schema_and_ends_with_eos_only(tok):
    c, stop = _constraint(tok, Grammar.json_schema(SCHEMA))
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    for t in ids:
        allowed = c.allowed()
        assert allowed[t] and 0 < int(allowed.sum()) < tok.vocab_size
        c.commit([t])
    assert c.allowed().nonzero().flatten().tolist() == sorted(stop)


def _cut(c: Constraint, draft: Draft) -> Draft:
    return draft.subset(c.valid(draft.paths()[1:]))  # as the engine cuts a draft


def test_cut_keeps_the_valid_prefix_of_a_chain_and_the_valid_nodes_of_a_tree(tok):
    c, _ = _constraint(tok, Grammar.json_schema(SCHEMA))
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)[0]
    resume = torch.rand(len(ids) + 2, 4)  # an early-exit draft's rows: k + 1
    chain = _cut(c, Draft(ids[:3] + [bad] + ids[3:], resume=resume))
    assert chain.tokens == ids[:3] and torch.equal(chain.resume, resume[:4])
    probs = torch.rand(4, tok.vocab_size)
    tree = _cut(c, Draft([ids[0], bad, ids[1], bad], probs, parents=[-1, -1, 0, 2]))
    assert tree.tokens == ids[:2] and tree.parents == [-1, 0] and torch.equal(tree.probs, probs[[0, 2]])


def test_mask_rows_follow_the_draft_and_leave_the_state(tok):
    c, _ = _constraint(tok, Grammar.json_schema(SCHEMA))
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    logits = torch.zeros(len(ids) + 1, tok.vocab_size)
    logits = c.mask(logits, Draft(ids).paths())
    for i, t in enumerate(ids):
        assert logits[i, t] == 0 and bool((logits[i] == float("-inf")).any())
    fresh, _ = _constraint(tok, Grammar.json_schema(SCHEMA))
    assert torch.equal(c.allowed(), fresh.allowed())  # the draft's tokens were rolled back


def test_bad_schemas_and_grammars_are_clear_errors(tok):
    with pytest.raises(GrammarError):
        schema_text("{not json")
    with pytest.raises(GrammarError):
        check(Grammar.lark("start: undefined_rule"), tok, tok.vocab_size, set())
    with pytest.raises(GrammarError):
        Grammar.gbnf("root ::= (")


def test_a_tokenizer_llguidance_cannot_read_is_a_clear_error(tiny_dir):
    word = Tokenizer(tiny_dir("llama"))  # WordPiece: llguidance cannot tell its tokens' bytes
    with pytest.raises(GrammarError, match="not supported with this model's tokenizer"):
        check(Grammar.json_schema({}), word, word.vocab_size, set())


def test_gbnf_and_regex_grammars(tok):
    for grammar, text in ((Grammar.gbnf('root ::= "yes" | "no"'), "no"), (Grammar.regex(r"[0-9]{3}"), "123")):
        c, _ = _constraint(tok, grammar)
        ids = tok.encode(text, add_special_tokens=False)
        assert _cut(c, Draft(ids)).tokens == ids
        c.commit(ids)
        assert c.matcher.is_accepting()


def test_tool_calls_are_parsed_in_every_format():
    call = tools.ToolCall("get_weather", {"city": "Paris"})
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tools.parse(hermes, ["get_weather"]) == (None, [call])
    assert tools.parse("Sure. " + hermes, ["get_weather"]) == ("Sure.", [call])
    assert tools.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}', ["get_weather"]) == (None, [call])
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'  # Qwen2.5-Coder's habit
    assert tools.parse(fenced, ["get_weather"]) == (None, [call])
    assert tools.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', ["get_weather"]) == (
        None,
        [call],
    )
    assert tools.parse('{"name": "other", "arguments": {}}', ["get_weather"]) == (
        '{"name": "other", "arguments": {}}',
        [],
    )
    entry = call.openai()
    assert entry["type"] == "function" and json.loads(entry["function"]["arguments"]) == {"city": "Paris"}


def _streamed(text: str, step: int) -> tuple[list[str], list[tools.ToolCall]]:
    """What a `CallStream` sends when `text` arrives `step` characters at a time: the content pieces and the calls."""
    stream, pieces, calls = tools.CallStream(["get_weather"]), [], []
    for i in range(0, len(text), step):
        piece, found = stream.feed(text[i : i + step])
        pieces, calls = pieces + [piece], calls + found
    piece, found = stream.finish()
    return pieces + [piece], calls + found


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_answer_sends_its_text_early_and_each_call_as_it_closes(step):
    call = tools.ToolCall("get_weather", {"city": "Paris"})
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces, calls = _streamed("Let me check. " + block + "\n" + block + " Done <tool", step)
    assert "".join(pieces) == "Let me check. \n Done <tool" and calls == [call, call]
    if step == 1:  # the text before the tag went out before the call closed
        assert pieces.index("L") < len("Let me check. ")
    bare = '  {"name": "get_weather", "arguments": {"city": "Paris"}}'  # held whole, parsed at the end
    assert ("".join(_streamed(bare, step)[0]), _streamed(bare, step)[1]) == ("", [call])
    broken = "<tool_call>\nnot json\n</tool_call> after"  # not a call: sent as text
    assert ("".join(_streamed(broken, step)[0]), _streamed(broken, step)[1]) == (broken, [])


def test_tools_reach_a_template_without_tool_support_and_earlier_calls_render(tok):
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    rendered, for_template = tools.render_messages(msgs, WEATHER, tok.chat_template)
    text = tok.apply_chat_template(rendered, tools=for_template)
    assert '"get_weather"' in text and "<tools>" in text and '{"city": "Paris"}' in text and "sunny" in text


def test_a_required_call_grammar_takes_only_a_call_of_the_named_tool(tok):
    c, _ = _constraint(tok, tools.grammar(WEATHER, "required", tok))
    good = tok.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', add_special_tokens=False
    )
    assert _cut(c, Draft(good)).tokens == good
    other = tok.encode('<tool_call>\n{"name": "get_time"', add_special_tokens=False)
    assert len(_cut(c, Draft(other)).tokens) < len(other)
    with pytest.raises(GrammarError):
        tools.grammar(WEATHER, {"type": "function", "function": {"name": "nope"}}, tok)
    assert tools.grammar(WEATHER, "auto", tok) is None
