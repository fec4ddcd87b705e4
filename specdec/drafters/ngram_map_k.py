"""`ngram-map-k` / `ngram-map-k4v` / `ngram-map-k-tree`: per sequence, the last n tokens -> up to k next
tokens with hit counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.drafters.base import Draft
from specdec.drafters.ngram_index import (
    NGRAM_M,
    NGRAM_N,
    ContinuationCounts,
    IncrementalDrafter,
    SeqIndex,
    chain_lookups,
    ranked,
    suffix_hashes,
    top,
    tree_lookups,
    window_hashes,
)
from specdec.drafters.registry import DrafterType, Option
from specdec.sequence import Sequence

MIN_HITS = Option(
    "ngram_min_hits",
    "--spec-ngram-min-hits",
    1,
    "ngram-map-k/k4v/k-tree: hits a continuation needs before it is drafted (default 1)",
    int,
    ">= 1",
)


@dataclass
class _MapState(SeqIndex):
    table: ContinuationCounts = field(default_factory=ContinuationCounts)


class NgramMapKDrafter(IncrementalDrafter):
    """Updated incrementally from the prompt and output; drafts by chaining the most frequent continuation
    (ties: the most recent) while it has at least `min_hits` hits."""

    name = "ngram-map-k"

    def __init__(self, n: int = 3, m: int = 16, k: int = 4, min_hits: int = 1):
        super().__init__()
        self.n, self.m, self.k, self.min_hits = n, m, k, min_hits

    def _new_state(self, seq: Sequence) -> _MapState:
        return _MapState(seq, table=ContinuationCounts(self.k))

    def _index(self, state: _MapState, tokens: list[int], start: int, stop: int) -> None:
        start = max(start, self.n)
        if start >= stop:
            return
        keys = window_hashes(tokens, start, stop, self.n)[:, -1].tolist()  # [W] hash of tokens[p-n:p]
        for h, tok in zip(keys, tokens[start:stop]):
            state.table.add(h, tok)

    def _pick(self, counts: dict[int, int]) -> int | None:
        tok, hits, _, _ = top(counts)
        return tok if hits >= self.min_hits else None

    def _counts(self, table: ContinuationCounts, ctx: list[int]) -> dict[int, int] | None:
        hs = suffix_hashes(ctx, self.n)
        return table.get(hs[-1]) if len(hs) == self.n else None

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        table = self._catch_up(seq).table

        def step(ctx: list[int]) -> int | None:
            counts = self._counts(table, ctx)
            return self._pick(counts) if counts else None

        return Draft(chain_lookups(seq.tokens[-self.n :], min(self.m, max_tokens), step))


class NgramMapK4VDrafter(NgramMapKDrafter):
    """Like `ngram-map-k`, but drafts only while the top continuation clearly dominates: at least `min_hits`
    hits and at least DOMINANCE times the runner-up's."""

    name = "ngram-map-k4v"
    DOMINANCE = 2

    def _pick(self, counts: dict[int, int]) -> int | None:
        tok, hits, second, _ = top(counts)
        return tok if hits >= self.min_hits and hits >= self.DOMINANCE * second else None


class NgramMapKTreeDrafter(NgramMapKDrafter):
    """Like `ngram-map-k`, but every continuation with at least `min_hits` hits may branch: a token tree grown
    best-first by path probability (each continuation's share of its context's hits), cut below
    BRANCH_MIN_PROB, up to the draft length in nodes."""

    name = "ngram-map-k-tree"
    BRANCH_MIN_PROB = 0.1

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        table = self._catch_up(seq).table

        def candidates(ctx: list[int]) -> list[tuple[int, float]]:
            counts = self._counts(table, ctx)
            return ranked(counts, self.min_hits) if counts else []

        return tree_lookups(seq.tokens[-self.n :], min(self.m, max_tokens), candidates, self.BRANCH_MIN_PROB)


def _builder(cls: type[NgramMapKDrafter]):
    return lambda ctx: cls(ctx.options["ngram_n"], ctx.options["ngram_m"], min_hits=ctx.options["ngram_min_hits"])


OPTIONS = (NGRAM_N, NGRAM_M, MIN_HITS)
TYPES = (
    DrafterType(
        "ngram-map-k",
        _builder(NgramMapKDrafter),
        "per sequence, the last n tokens -> the most hit of up to k next tokens",
        OPTIONS,
    ),
    DrafterType(
        "ngram-map-k4v",
        _builder(NgramMapK4VDrafter),
        "ngram-map-k, drafting only while the top continuation clearly dominates",
        OPTIONS,
    ),
    DrafterType(
        "ngram-map-k-tree",
        _builder(NgramMapKTreeDrafter),
        "ngram-map-k as a token tree over every continuation",
        OPTIONS,
    ),
)
