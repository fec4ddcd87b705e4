"""`synthetic`: fake drafts accepted at given per-position rates, to measure verification cost.

The engine keeps `forced` draft tokens whatever the target says, so the output is NOT the
target's text (results are flagged `synthetic`). Only for benchmarks, and only on request.
"""
from __future__ import annotations

import random

from specdec.drafters.base import Draft, Drafter
from specdec.engine.sequence import Sequence


class SyntheticDrafter(Drafter):
    name = "synthetic"

    def __init__(self, rates: list[float], length: int, seed: int = 0):
        self.rates, self.length = rates, length
        self.rng = random.Random(seed)

    def propose(self, seq: Sequence, max_tokens: int) -> Draft:
        k = min(self.length, max_tokens)
        accepted = 0
        while accepted < k and self.rng.random() < self.rates[min(accepted, len(self.rates) - 1)]:
            accepted += 1
        return Draft([seq.tokens[-1]] * k, forced=accepted)
