"""Chains (`--spec-type ngram-mod,draft`): the first drafter in order that drafts anything wins."""
from __future__ import annotations

from specdec.drafters.base import Draft, Drafter
from specdec.engine.sequence import Sequence


class ChainDrafter(Drafter):
    """Asks each member in order and returns the first non-empty draft (llama.cpp's behaviour).

    Every member hears `update` and `release`, so each keeps its per-sequence state in step.
    """

    def __init__(self, members: list[Drafter]):
        self.members = members
        self.name = ",".join(m.name for m in members)

    def propose(self, seq: Sequence, max_tokens: int) -> Draft:
        for m in self.members:
            m.min_path_prob = self.min_path_prob
            draft = m.propose(seq, max_tokens)
            if draft.tokens:
                return draft
        return Draft([])

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        for m in self.members:
            m.update(seq, drafted, accepted)

    def release(self, seq: Sequence) -> None:
        for m in self.members:
            m.release(seq)
