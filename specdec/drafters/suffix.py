"""`suffix`: SuffixDecoding-style drafting from the request's own tokens and from past requests' outputs."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from specdec.drafters.base import Draft
from specdec.drafters.ngram_index import (
    ContinuationCounts,
    IncrementalDrafter,
    MatchAcceptance,
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

MAX_ORDER = 8  # contexts of 1..MAX_ORDER tokens are indexed
# Draft at most FACTOR x match length tokens. SuffixDecoding uses 1 with its deeper suffix-tree matches; ours
# are shorter. Replayed on input-grounded prompts (`specdec bench replay`), suffix-tree with 1, 2, 4, 8:
# 2.28x, 2.44x, 2.57x, 2.53x plain decoding.
FACTOR = 4.0
OPTIONS = (
    Option(
        "suffix_max_requests",
        "--spec-suffix-max-requests",
        64,
        "suffix: past requests whose outputs are remembered, oldest evicted; 0 = none (default 64)",
        int,
        ">= 0",
    ),
    Option(
        "suffix_factor",
        "--spec-suffix-factor",
        FACTOR,
        "suffix, suffix-tree: draft at most factor x match length tokens (default 4)",
        float,
        "> 0 and finite",
    ),
    Option(
        "suffix_min_prob",
        "--spec-suffix-min-prob",
        0.1,
        "suffix: stop drafting below this empirical "
        "continuation probability; suffix-tree: cut nodes whose path probability is below it (default 0.1)",
        float,
        "in [0, 1]",
    ),
)


def contexts(tokens: list[int], start: int, stop: int) -> Iterator[tuple[list[int], int]]:
    """For p in [start, stop): (hashes of the 1..min(p, MAX_ORDER) tokens before p, tokens[p])."""
    rows = window_hashes(tokens, start, stop, MAX_ORDER).tolist()  # [W][MAX_ORDER]
    for p, row, tok in zip(range(start, stop), rows, tokens[start:stop]):
        yield row[: min(p, MAX_ORDER)], tok


def _merged(a: dict[int, int] | None, b: dict[int, int] | None) -> dict[int, int] | None:
    if not a or not b:
        return a or b
    out = dict(a)
    for tok, c in b.items():
        out[tok] = out.get(tok, 0) + c
    return out


@dataclass
class _RequestState(SeqIndex):
    table: ContinuationCounts = field(default_factory=ContinuationCounts)  # over this request's prompt + output
    streak: int = 0  # consecutive latest positions whose MAX_ORDER-token context had been seen before
    # the last draft, to score against what gets committed: (tokens before it, the draft, each node's match length)
    last: tuple[int, Draft, list[int]] | None = None
    accepted: float = 0.0  # this request's draft tokens accepted, and the sum of their rates (`MatchAcceptance`)
    expected: float = 0.0


class SuffixDrafter(IncrementalDrafter):
    """Two structures map contexts of 1..MAX_ORDER tokens to next-token counts: one per request (prompt and
    output, updated incrementally) and a global one over the outputs of the last `max_requests` released
    requests (the oldest is evicted). A draft follows the most frequent continuation of the longest matching
    context suffix (counts of both structures summed), re-matching after each token; it stops when that
    token's empirical probability falls below `min_prob`, after ceil(factor * match length) tokens, or where the
    draft's path probability falls below the engine's stop: each token's probability is its empirical one times
    how often tokens drafted from a match of its length were accepted so far (`MatchAcceptance`: a 1-token match
    about a quarter of the time, 4 tokens or more four in five), lowered for a request whose drafts fail.
    Match length (for the cap): the longest matched order, plus, at MAX_ORDER, the run of preceding positions whose
    MAX_ORDER context was also known (a cheap stand-in for a suffix tree's deeper match).
    Memory: about 0.7 KB per remembered output token (64 requests of 1000 novel tokens: ~45 MB).
    """

    name = "suffix"
    confidence_stop = True

    def __init__(self, factor: float = FACTOR, min_prob: float = 0.1, max_requests: int = 64):
        super().__init__()
        self.factor, self.min_prob, self.max_requests = factor, min_prob, max_requests
        self.accepted = MatchAcceptance()
        self.glob = ContinuationCounts()
        self.past: deque[tuple[list[int], int]] = deque()  # (output with the prompt tail before it, output start)

    def _new_state(self, seq: Sequence) -> _RequestState:
        return _RequestState(seq)

    def _index(self, state: _RequestState, tokens: list[int], start: int, stop: int) -> None:
        for hs, tok in contexts(tokens, start, stop):
            if len(hs) == MAX_ORDER:
                known = hs[-1] in state.table or hs[-1] in self.glob
                state.streak = state.streak + 1 if known else 0
            for h in hs:
                state.table.add(h, tok)

    def _lookup(self, state: _RequestState, ctx: list[int]) -> tuple[int, dict[int, int]]:
        """(matched order, next-token counts) for the longest known suffix of ctx; (0, {}) if none is known."""
        hs = suffix_hashes(ctx, MAX_ORDER)
        for order in range(len(hs), 0, -1):
            counts = _merged(state.table.get(hs[order - 1]), self.glob.get(hs[order - 1]))
            if counts:
                return order, counts
        return 0, {}

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        state = self._catch_up(seq)
        state.last = None
        context = seq.tokens[-MAX_ORDER:]
        order, _ = self._lookup(state, context)
        if order == 0:
            return Draft([])
        match_len = order + (state.streak if order == MAX_ORDER else 0)
        orders: list[int] = []
        draft = self._draft(state, context, min(max_tokens, math.ceil(self.factor * match_len)), min_path_prob, orders)
        state.last = (len(seq.tokens), draft, orders) if draft.tokens else None
        return draft

    def _draft(self, state: _RequestState, context: list[int], want: int, stop: float, orders: list[int]) -> Draft:
        """A chain: the most frequent continuation while its empirical probability is at least `min_prob` and the
        path's (`MatchAcceptance`) at least `stop`; appends each token's match length to `orders`."""
        path, trust = 1.0, self.accepted.trust(state.accepted, state.expected)

        def step(ctx: list[int]) -> int | None:
            nonlocal path
            order, counts = self._lookup(state, ctx)
            if not counts:
                return None
            tok, hits, _, total = top(counts)
            p = path * self.accepted.rate(order, trust) * hits / total
            if hits / total < self.min_prob or p < stop:
                return None
            path = p
            orders.append(order)
            return tok

        return Draft(chain_lookups(context, want, step))

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Score the last draft against the tokens committed since (`MatchAcceptance.score`)."""
        state = self._seqs.get(seq.slot)
        if state is not None and state.owner is seq and state.last is not None:
            start, draft, orders = state.last
            hits, expected = self.accepted.score(draft, orders, seq.tokens[start:])
            state.accepted, state.expected, state.last = state.accepted + hits, state.expected + expected, None

    def release(self, seq: Sequence) -> None:
        """Drop the request's structure; its output joins the global one."""
        super().release(seq)
        if self.max_requests == 0 or len(seq.tokens) == seq.prompt_len:
            return
        lo = max(0, seq.prompt_len - MAX_ORDER)
        self.past.append((seq.tokens[lo:], seq.prompt_len - lo))
        self._apply_global(*self.past[-1], self.glob.add)
        if len(self.past) > self.max_requests:
            self._apply_global(*self.past.popleft(), self.glob.remove)

    def _apply_global(self, tokens: list[int], start: int, op: Callable[[int, int], None]) -> None:
        """op(context hash, next token) for every output position of one past request."""
        for hs, tok in contexts(tokens, start, len(tokens)):
            for h in hs:
                op(h, tok)

    def reset(self) -> None:
        """Forget past requests (e.g. between benchmark repeats)."""
        self.glob = ContinuationCounts()
        self.past.clear()
        self._seqs.clear()
        self.accepted = MatchAcceptance()


class SuffixTreeDrafter(SuffixDrafter):
    """Like `suffix`, but the draft is a token tree (SuffixDecoding's tree speculation): grown best-first by
    path probability over every continuation of the longest matching context, cut below `min_prob` and the
    engine's stop. A candidate's probability, as `suffix` drafts: its match length's acceptance (`MatchAcceptance`)
    times its share of the context's hits."""

    name = "suffix-tree"

    def _draft(self, state: _RequestState, context: list[int], want: int, stop: float, orders: list[int]) -> Draft:
        order_at: dict[tuple[int, ...], int] = {}  # a look-up's window (`tree_lookups`) -> its match length
        trust = self.accepted.trust(state.accepted, state.expected)

        def candidates(ctx: list[int]) -> list[tuple[int, float]]:
            order, counts = self._lookup(state, ctx)
            order_at[tuple(ctx)] = order
            rate = self.accepted.rate(order, trust)
            return [(tok, share * rate) for tok, share in ranked(counts)]

        draft = tree_lookups(context, want, candidates, max(self.min_prob, stop))
        paths = draft.paths()  # node j's parent's path is paths[parent + 1]
        parents = draft.parents or list(range(-1, len(draft.tokens) - 1))
        orders += [order_at[tuple((context + paths[p + 1])[-len(context) :])] for p in parents]
        return draft


def _builder(cls: type[SuffixDrafter]):
    return lambda ctx: cls(
        factor=ctx.options["suffix_factor"],
        min_prob=ctx.options["suffix_min_prob"],
        max_requests=ctx.options["suffix_max_requests"],
    )


TYPES = (
    DrafterType(
        "suffix",
        _builder(SuffixDrafter),
        "SuffixDecoding-style: the request's own tokens and past requests' outputs",
        OPTIONS,
    ),
    DrafterType("suffix-tree", _builder(SuffixTreeDrafter), "suffix as a token tree over every continuation", OPTIONS),
)
