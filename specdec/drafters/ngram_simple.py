"""`ngram-simple` (prompt lookup): find the last n tokens earlier in the context, propose what followed."""
from __future__ import annotations

import numpy as np

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.ngram_index import NGRAM_M, NGRAM_N
from specdec.drafters.registry import DrafterType
from specdec.sequence import Sequence


class NgramSimpleDrafter(Drafter):
    name = "ngram-simple"

    def __init__(self, n: int = 3, m: int = 16):
        self.n, self.m = n, m

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        ctx = np.asarray(seq.tokens, dtype=np.int64)
        n, want = self.n, min(self.m, max_tokens)
        if len(ctx) <= n or want <= 0:
            return Draft([])
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)  # [L-n, n] earlier n-grams
        hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
        if hits.size == 0:
            return Draft([])
        start = int(hits[-1]) + n  # most recent occurrence
        return Draft(ctx[start:start + want].tolist())


TYPES = (DrafterType("ngram-simple", lambda ctx: NgramSimpleDrafter(ctx.options["ngram_n"], ctx.options["ngram_m"]),
                     "prompt lookup: what followed the last n tokens earlier in the context", (NGRAM_N, NGRAM_M)),)
