"""`ngram-mod`: the last n tokens hashed into one fixed-size pool of next tokens, shared by all sequences."""

from __future__ import annotations

import numpy as np

from specdec.drafters.base import Draft
from specdec.drafters.ngram_index import (
    NGRAM_M,
    NGRAM_N,
    IncrementalDrafter,
    SeqIndex,
    chain_lookups,
    suffix_hashes,
    window_hashes,
)
from specdec.drafters.registry import DrafterType, Option
from specdec.sequence import Sequence

POOL_MB = Option(
    "ngram_mod_pool_mb",
    "--spec-ngram-mod-pool-mb",
    16.0,
    "ngram-mod: size of the hash pool shared by all sequences, in MB (default 16)",
    float,
    "in (0, 65536]",
)


class NgramModDrafter(IncrementalDrafter):
    """One pool per drafter (so per LLM), written by every sequence it serves; drafts chain look-ups.

    Entry `(h >> 32) % size` holds the token that most recently followed an n-gram with LCG hash h (-1: empty).
    Collisions are not detected: the newest write overwrites the entry, and a look-up may draft another
    context's token (verification rejects it, so only time is lost; false hits happen at about the fill ratio).
    Pool pressure: llama.cpp wipes the whole pool, which forgets every slot's n-grams at once. Here, whenever
    more than FILL_LIMIT of the entries are used, the next of REGIONS equal regions (rotating, so each region
    is cleared in turn) is emptied, so 7/8 of what was learned survives. The low limit keeps false hits rare.
    """

    name = "ngram-mod"
    FILL_LIMIT = 0.25
    REGIONS = 8

    def __init__(self, n: int = 3, m: int = 16, pool_size: int = 4 << 20):
        super().__init__()
        self.n, self.m = n, m
        self.pool = np.full(pool_size, -1, dtype=np.int32)  # [pool_size] next token, -1 = empty
        self.used = 0  # non-empty entries
        self.next_region = 0  # the region cleared at the next pressure event

    def _slot(self, h):
        """Pool entry of hash h (Python int or uint64 array): the high bits mix every token."""
        return (h >> 32) % len(self.pool)

    def _index(self, state: SeqIndex, tokens: list[int], start: int, stop: int) -> None:
        start = max(start, self.n)
        if start >= stop:
            return
        slots = self._slot(window_hashes(tokens, start, stop, self.n)[:, -1]).astype(np.intp)[::-1]  # [W] newest first
        nxt = np.asarray(tokens[start:stop], dtype=np.int32)[::-1]  # [W]
        slots, first = np.unique(slots, return_index=True)  # the newest write to each entry wins
        self.used += int((self.pool[slots] < 0).sum())
        self.pool[slots] = nxt[first]
        while self.used > self.FILL_LIMIT * len(self.pool):
            self._clear_region()

    def _clear_region(self) -> None:
        size, r = len(self.pool), self.next_region
        region = self.pool[size * r // self.REGIONS : size * (r + 1) // self.REGIONS]  # view
        self.used -= int((region >= 0).sum())
        region[:] = -1
        self.next_region = (r + 1) % self.REGIONS

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        self._catch_up(seq)

        def step(ctx: list[int]) -> int | None:
            hs = suffix_hashes(ctx, self.n)
            tok = int(self.pool[self._slot(hs[-1])]) if len(hs) == self.n else -1
            return tok if tok >= 0 else None

        return Draft(chain_lookups(seq.tokens[-self.n :], min(self.m, max_tokens), step))

    def release(self, seq: Sequence) -> None:
        self._catch_up(seq)  # the pool keeps what this sequence wrote, for later requests
        super().release(seq)

    def reset(self) -> None:
        """Forget everything (e.g. between benchmark repeats)."""
        self.pool.fill(-1)
        self.used, self.next_region = 0, 0
        self._seqs.clear()


def _build(ctx) -> NgramModDrafter:
    entries = max(1, int(ctx.options["ngram_mod_pool_mb"] * 2**20) // 4)  # int32 entries
    return NgramModDrafter(ctx.options["ngram_n"], ctx.options["ngram_m"], pool_size=entries)


TYPES = (
    DrafterType(
        "ngram-mod",
        _build,
        "the last n tokens hashed into one pool of next tokens shared by all sequences (llama.cpp's ngram-mod)",
        (NGRAM_N, NGRAM_M, POOL_MB),
    ),
)
