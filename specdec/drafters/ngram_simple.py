"""`ngram-simple` (prompt lookup): find the last n tokens earlier in the context, propose what followed.

With `ngram_min` below n, a miss tries n - 1, n - 2, ... down to it (transformers' prompt lookup from
`max_matching_ngram_size` down to 1; vLLM's from `prompt_lookup_max` down to `prompt_lookup_min`)."""

from __future__ import annotations

import numpy as np

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.ngram_index import NGRAM_M, NGRAM_N, latest_continuation
from specdec.drafters.registry import DrafterType, Option
from specdec.sequence import Sequence


class NgramSimpleDrafter(Drafter):
    name = "ngram-simple"
    model_free = True

    def __init__(self, n: int = 3, m: int = 16, n_min: int = 0):
        self.n, self.m = n, m
        self.n_min = min(n, n_min or n)  # shortest match tried (0: n only)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        ctx = np.asarray(seq.tokens, dtype=np.int64)
        want = min(self.m, max_tokens)
        for n in range(self.n, self.n_min - 1, -1):
            found = latest_continuation(ctx, n, want) if want > 0 else None
            if found is not None:
                return Draft(found)
        return Draft([])


NGRAM_MIN = Option(
    "ngram_min",
    "--spec-ngram-min",
    0,
    "ngram-simple: on a miss, try shorter matches down to this many tokens (0 = only --spec-ngram-size-n; default 0)",
    int,
    ">= 0",
)
TYPES = (
    DrafterType(
        "ngram-simple",
        lambda ctx: NgramSimpleDrafter(ctx.options["ngram_n"], ctx.options["ngram_m"], ctx.options["ngram_min"]),
        "prompt lookup: what followed the last n tokens earlier in the context",
        (NGRAM_N, NGRAM_M, NGRAM_MIN),
    ),
)
