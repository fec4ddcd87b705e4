"""Shared n-gram machinery: a 64-bit LCG context hash, continuation counts, per-sequence incremental state."""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.registry import Option
from specdec.sequence import Sequence

LCG_MUL = 6364136223846793005  # Knuth's MMIX LCG multiplier
MASK64 = (1 << 64) - 1

NGRAM_N = Option("ngram_n", "--spec-ngram-size-n", 3, "ngram-*: tokens to match (default 3)", int, ">= 1")
NGRAM_M = Option(
    "ngram_m", "--spec-ngram-size-m", 16, "ngram-*: max tokens to propose after a match (default 16)", int, ">= 1"
)


def hash_step(h, tok):
    """Extend a context hash by one token on its LEFT: h' = (h + tok + 1) * A mod 2^64.

    Works on Python ints and on uint64 numpy arrays alike, so both paths give the same hashes.
    """
    return ((h + tok + 1) * LCG_MUL) & MASK64


def suffix_hashes(tokens: list[int], max_len: int) -> list[int]:
    """Hashes of the last 1, 2, ..., min(max_len, len(tokens)) tokens."""
    out, h = [], 0
    for tok in reversed(tokens[-max_len:]):
        h = hash_step(h, tok)
        out.append(h)
    return out


def window_hashes(tokens: list[int], start: int, stop: int, max_len: int) -> np.ndarray:
    """[stop - start, max_len] uint64: row i, column d-1 hashes tokens[p-d:p], the d tokens before p = start + i.

    Entries with d > p are meaningless; callers skip them.
    """
    lo = max(0, start - max_len)
    seg = np.asarray(tokens[lo:stop], dtype=np.uint64)  # [stop - lo]
    pos = np.arange(start - lo, stop - lo)  # [W] positions within seg
    out = np.empty((len(pos), max_len), dtype=np.uint64)
    h = np.zeros(len(pos), dtype=np.uint64)  # [W]
    for d in range(1, max_len + 1):
        h = hash_step(h, seg[np.maximum(pos - d, 0)])
        out[:, d - 1] = h
    return out


def latest_continuation(ctx: np.ndarray, n: int, want: int) -> list[int] | None:
    """Up to `want` tokens that followed the latest earlier occurrence of the last `n` tokens of ctx ([L] int64);
    None where they do not occur earlier (prompt lookup)."""
    if len(ctx) <= n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)  # [L - n, n] earlier n-grams
    hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
    if not hits.size:
        return None
    start = int(hits[-1]) + n  # most recent occurrence
    return ctx[start : start + want].tolist()


def chain_lookups(context: list[int], want: int, step: Callable[[list[int]], int | None]) -> list[int]:
    """Draft by repeated look-up: append `step(context + drafted)` until it gives None or `want` tokens."""
    ctx, out = list(context), []
    while len(out) < want:
        tok = step(ctx)
        if tok is None:
            break
        out.append(tok)
        ctx.append(tok)
    return out


def tree_lookups(
    context: list[int], max_nodes: int, candidates: Callable[[list[int]], list[tuple[int, float]]], min_path_prob: float
) -> Draft:
    """Draft a token tree best-first: repeatedly add the candidate whose path probability (the product of
    the empirical probabilities `candidates(context + path)` gives along its path) is highest, while it is
    at least `min_path_prob`, up to `max_nodes` nodes. `context` is the window look-ups read (its length
    is kept as nodes extend it). A tree that came out as a single path is a chain."""
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = []  # per node: the window of context + path that ends at it
    heap: list[tuple[float, int, int, int]] = []  # (-path probability, push order, parent node, token)
    order = itertools.count()  # equal probabilities: the earlier candidate first

    def push(parent: int, ctx: list[int], prob: float) -> None:
        for tok, p in candidates(ctx):
            if prob * p >= min_path_prob:
                heapq.heappush(heap, (-prob * p, next(order), parent, tok))

    push(-1, context, 1.0)
    while heap and len(tokens) < max_nodes:
        neg, _, parent, tok = heapq.heappop(heap)
        ctx = (context if parent < 0 else paths[parent]) + [tok]
        tokens.append(tok)
        parents.append(parent)
        paths.append(ctx[-max(1, len(context)) :])
        push(len(tokens) - 1, paths[-1], -neg)
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return Draft(tokens, parents=None if is_chain else parents)


def top(counts: dict[int, int]) -> tuple[int, int, int, int]:
    """(most frequent token, its count, the runner-up's count, total); ties go to the most recently hit."""
    best, c1, c2, total = -1, 0, 0, 0
    for tok, c in reversed(counts.items()):  # newest first
        total += c
        if c > c1:
            best, c1, c2 = tok, c, c1
        elif c > c2:
            c2 = c
    return best, c1, c2, total


def ranked(counts: dict[int, int], min_hits: int = 1) -> list[tuple[int, float]]:
    """[(token, its share of all hits)] for tokens with at least `min_hits`, most frequent (then most recent) first."""
    total = sum(counts.values())
    best = sorted(reversed(counts.items()), key=lambda kv: -kv[1])  # stable: recency breaks ties
    return [(tok, c / total) for tok, c in best if c >= min_hits]


class ContinuationCounts:
    """Context hash -> {next token: hits}, each map ordered from least to most recently hit.

    A context seen once stores the bare token id (most long contexts are seen once; this saves memory).
    With `k`, a full map replaces its least frequent (then least recent) token.
    """

    def __init__(self, k: int | None = None):
        self.k = k
        self.table: dict[int, int | dict[int, int]] = {}

    def __contains__(self, h: int) -> bool:
        return h in self.table

    def __len__(self) -> int:
        return len(self.table)

    def get(self, h: int) -> dict[int, int] | None:
        v = self.table.get(h)
        return {v: 1} if isinstance(v, int) else v

    def add(self, h: int, tok: int) -> None:
        v = self.table.get(h)
        if v is None:
            self.table[h] = tok
            return
        if isinstance(v, int):
            v = self.table[h] = {v: 1}
        if tok in v:
            v[tok] = v.pop(tok) + 1  # re-insert: most recent last
            return
        if self.k is not None and len(v) >= self.k:
            del v[min(v, key=v.get)]  # least frequent; ties: the least recent (first in order)
        v[tok] = 1

    def remove(self, h: int, tok: int) -> None:
        """Undo one `add(h, tok)` (exact only without `k`)."""
        v = self.table.get(h)
        if isinstance(v, int):
            if v == tok:
                del self.table[h]
        elif v is not None and tok in v:
            v[tok] -= 1
            if v[tok] == 0:
                del v[tok]
                if not v:
                    del self.table[h]


# P(a model-free draft token is accepted | the tokens before it were) by the length of the context match that proposed
# it, 1, 2, 3 and 4 or more tokens, before any is observed: measured over 24 Spec-Bench questions with
# qwen2.5-coder-1.5b's greedy answers (every output position with an earlier match of its context: 0.24, 0.49, 0.69,
# 0.81; by category the 1-token rate ran from 0.11 (translation) to 0.38 (summarization)).
MATCH_PRIOR = (0.25, 0.5, 0.7, 0.8)
PRIOR_WEIGHT = 8.0  # the prior counts as this many observations
KEEP = 512.0  # observations of one match length past which older ones fade (its counts are halved)
SEQ_WEIGHT = 2.0  # `MatchAcceptance.trust`: a request's own record counts once its drafts expected this many


class MatchAcceptance:
    """How often draft tokens of each match length were accepted, over every request a drafter served: the
    probability a model-free drafter gives its draft tokens, so that the engine's path-probability stop
    (`Drafter.confidence_stop`) cuts its drafts where another token is expected to cost more than it saves."""

    def __init__(self):
        self.seen = [0.0] * len(MATCH_PRIOR)
        self.hits = [0.0] * len(MATCH_PRIOR)

    def rate(self, match_len: int, trust: float = 1.0) -> float:
        """The acceptance of a token drafted from a match of `match_len` tokens, times a request's `trust`."""
        i = _match_bucket(match_len)
        return min(1.0, trust * (self.hits[i] + PRIOR_WEIGHT * MATCH_PRIOR[i]) / (self.seen[i] + PRIOR_WEIGHT))

    @staticmethod
    def trust(accepted: float, expected: float) -> float:
        """A request's own factor on the rates, at most 1: its accepted draft tokens over those expected, shrunk
        toward 1 (in a request whose drafts keep failing, the rates fall for it alone)."""
        return min(1.0, (accepted + SEQ_WEIGHT) / (expected + SEQ_WEIGHT))

    def observe(self, match_len: int, accepted: bool) -> None:
        i = _match_bucket(match_len)
        self.seen[i] += 1
        self.hits[i] += accepted
        if self.seen[i] > KEEP:
            self.seen[i] /= 2
            self.hits[i] /= 2

    def score(self, draft: Draft, match_lens: list[int], committed: list[int]) -> tuple[float, float]:
        """Observe each node of `draft` (its match length) against the tokens committed after it was drafted:
        a node whose path is committed is accepted if its token comes next, rejected if not; nodes past the
        committed tokens, or under a rejected node, say nothing. (Greedy: also right for a draft the engine did
        not verify, a chain's other member having drafted.) Returns (accepted, expected): the nodes observed that
        were accepted, and the sum of their rates before."""
        hits = expected = 0.0
        depth: list[int] = []
        on_path: list[bool] = []
        for j, tok in enumerate(draft.tokens):
            parent = j - 1 if draft.parents is None else draft.parents[j]
            depth.append(1 + (depth[parent] if parent >= 0 else 0))
            known = (parent < 0 or on_path[parent]) and depth[j] <= len(committed)
            on_path.append(known and committed[depth[j] - 1] == tok)
            if known:
                expected += self.rate(match_lens[j])
                hits += on_path[j]
                self.observe(match_lens[j], on_path[j])
        return hits, expected


def _match_bucket(match_len: int) -> int:
    """The index of `match_len` in MATCH_PRIOR (the last holds every longer match)."""
    return min(max(match_len, 1), len(MATCH_PRIOR)) - 1


@dataclass
class SeqIndex:
    owner: Sequence  # the sequence this state belongs to (a slot reused without release starts afresh)
    indexed: int = 0  # owner.tokens[:indexed] have been recorded as continuations


class IncrementalDrafter(Drafter):
    """Keeps per-sequence state by slot; `_index` sees each committed token once (prompt, then output)."""

    model_free = True

    def __init__(self):
        self._seqs: dict[int, SeqIndex] = {}

    def _new_state(self, seq: Sequence) -> SeqIndex:
        return SeqIndex(seq)

    @abstractmethod
    def _index(self, state: SeqIndex, tokens: list[int], start: int, stop: int) -> None:
        """Record tokens[p] as the continuation of its context, for p in [start, stop)."""

    def _catch_up(self, seq: Sequence) -> SeqIndex:
        st = self._seqs.get(seq.slot)
        if st is None or st.owner is not seq or st.indexed > len(seq.tokens):
            st = self._seqs[seq.slot] = self._new_state(seq)
        if st.indexed < len(seq.tokens):
            self._index(st, seq.tokens, st.indexed, len(seq.tokens))
            st.indexed = len(seq.tokens)
        return st

    def release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.slot, None)
