"""Constrained decoding: a grammar (JSON schema, Lark, regex, llama.cpp's GBNF) as a mask over each next token.

The grammar engine is llguidance (the one llama.cpp and vLLM also offer): its mask over a 49,152- or 151,936-token
vocabulary, unpacked to a bool tensor, takes 14-30 us a token (median; a logit row masked with it 0.04-0.11 ms) on an
AMD EPYC Zen 5, against 0.43-1.32 ms for outlines-core's allowed-token list in the same run
(`python scripts/grammar_cost.py`); xgrammar was not tried: it pulls triton.

Under speculation the target's logit rows are masked along the draft (row i: what the grammar allows after the
committed text + the draft's first i tokens), so verification picks what constrained plain decoding picks. The engine
cuts drafted tokens the grammar rejects before the forward where that leaves the distribution exact (greedy, seeded,
one-hot drafts); a sampled draft keeps them and verification rejects them (their target probability is 0).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer


class GrammarError(SpecdecError):
    """A grammar or schema the engine cannot compile (the server answers 400)."""


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (its JSON text), built from what a request gives."""

    text: str

    @staticmethod
    def json_schema(schema: dict | None = None) -> Grammar:
        """Any JSON object (schema None, OpenAI's `json_object`), else JSON valid under `schema`."""
        from llguidance import LLMatcher

        try:
            return Grammar(LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"}))
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None

    @staticmethod
    def lark(text: str) -> Grammar:
        from llguidance import LLMatcher

        return Grammar(LLMatcher.grammar_from_lark(text))

    @staticmethod
    def regex(pattern: str) -> Grammar:
        from llguidance import LLMatcher

        return Grammar(LLMatcher.grammar_from_regex(pattern))

    @staticmethod
    def gbnf(text: str) -> Grammar:
        """llama.cpp's grammar format (llama-server's `grammar` field)."""
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return Grammar.lark(gbnf_to_lark(text))
        except Exception as e:  # the converter raises bare exceptions on bad input
            raise GrammarError(f"invalid GBNF grammar: {e}") from None


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, vocab: int, stop: frozenset[int]):
    """llguidance's view of a tokenizer (building it reads every token: 0.2-0.9 s, so one per tokenizer)."""
    from llguidance import LLTokenizer

    try:
        return LLTokenizer(tokenizer.fast.to_str(), n_vocab=vocab, eos_token=sorted(stop) or None)
    except ValueError as e:  # a tokenizer whose bytes llguidance cannot tell (WordPiece)
        raise GrammarError(f"constrained output is not supported with this model's tokenizer: {e}") from None


def check(grammar: Grammar, tokenizer: Tokenizer, vocab: int, stop: set[int]) -> None:
    """Raise GrammarError where the grammar does not compile (before a request is admitted)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar.text, _ll_tokenizer(tokenizer, vocab, frozenset(stop)))
    if error:
        raise GrammarError(f"invalid grammar: {error}")


class Constraint:
    """One sequence's place in its grammar, advanced by the tokens it commits."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, vocab: int, stop: set[int]):
        from llguidance import LLMatcher

        self.vocab = vocab
        self.matcher = LLMatcher(_ll_tokenizer(tokenizer, vocab, frozenset(stop)), grammar.text, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar: {self.matcher.get_error()}")
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return torch.from_numpy(np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool))

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """The verify rows with what the grammar forbids at -inf: logits [N, V], row i after the committed text +
        paths[i] (`Draft.paths`). A row below a token the grammar rejects (kept in a sampled draft) is left as it
        is: verification stops at that token."""
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        for row, path in enumerate(paths[: logits.shape[0]]):
            if self.matcher.validate_tokens(path) < len(path):
                continue
            self.matcher.consume_tokens(path)
            allowed[row] = self.allowed()
            self.matcher.rollback(len(path))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def valid(self, paths: list[list[int]]) -> list[int]:
        """The indices of the paths the grammar takes whole after the committed text."""
        return [i for i, path in enumerate(paths) if self.matcher.validate_tokens(path) == len(path)]

    def commit(self, tokens: list[int]) -> None:
        """Advance past committed tokens (never a stop token: the engine ends a sequence there, uncommitted)."""
        if tokens and not self.matcher.consume_tokens(tokens):
            raise GrammarError(f"constrained output left its grammar: {self.matcher.get_error()}")


def schema_text(value: object) -> dict:
    """A schema given as an object or a JSON string (as llama-server and Ollama accept), as a dict."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if not isinstance(value, dict):
        raise GrammarError("a JSON schema must be an object")
    return value
