"""Chains (`--spec-type ngram-mod,draft`): several drafters, one draft per step.

`first` (llama.cpp's behaviour): ask each member in order, use the first non-empty draft.
`gain`: use the draft with the most expected accepted tokens, from each member's own measured per-position
acceptance on this sequence (`Sequence.acceptance_of`); a drafter that knows its confidence (the draft model, the
expensive one) is only asked when even a full-length draft from it could beat the best so far, and a draft it
samples (temperature > 0, unseeded) is then used whatever its length.
The engine judges each member apart (`Drafter.parts`): its own cost per token, acceptance and draft length, so a
member not expected to pay at the step's load (the draft model in a large batch) is not asked while a cheap one
(the suffix tree) still drafts. A member whose catch-up on a new prompt (the draft model's own prefill) the engine
declines sits out the rest of that sequence, and the others draft without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from specdec.drafters.base import Budgets, Draft, Drafter, time_shares
from specdec.errors import SpecdecError
from specdec.runtime.runner import Features
from specdec.sequence import Sequence

CHAIN_MODES = ("first", "gain")


@dataclass
class _Pick:
    """One sequence's choice among its members' drafts so far."""

    draft: Draft = field(default_factory=lambda: Draft([]))
    gain: float = 0.0  # expected accepted tokens of `draft` (`gain`)
    setup_s: float = 0.0  # every asked member's catch-up, whichever draft is used
    draft_s: float = 0.0  # every asked member's drafting time for this sequence, whichever draft is used
    final: bool = False  # settled: no further member is asked


class ChainDrafter(Drafter):
    """Every member hears `update` and `release`, so each keeps its per-sequence state in step. The engine judges
    each member apart (`parts`: its own cost, acceptance and draft length), so a cheap member drafts alone where
    an expensive one does not pay. Members that draft in batches (the draft model) draft every sequence of a step
    that asks them in one call."""

    def __init__(self, members: list[Drafter], mode: str = "first"):
        self.members, self.mode = members, mode
        self.name = ",".join(m.name for m in members)
        self.batched = any(m.batched for m in members)
        self.declined: dict[int, set[int]] = {}  # slot -> members whose catch-up the engine declined
        for m in members:
            if m.features is not None:
                self.features = m.features.union(self.features)

    def parts(self, seq: Sequence) -> list[Drafter]:
        declined = self.declined.get(seq.slot, ())
        return [m for i, m in enumerate(self.members) if i not in declined]

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        return self.propose_parts([seq], [{m.name: (max_tokens, min_path_prob) for m in self.parts(seq)}])[0]

    def propose_parts(self, seqs: list[Sequence], budgets: list[Budgets]) -> list[Draft]:
        """Each member in turn drafts for the sequences still asking it (in one call where it drafts in batches);
        each sequence's drafting time is its share of every call that asked for it."""
        picks = [_Pick() for _ in seqs]
        for m in self.members:
            ask = [j for j, s in enumerate(seqs) if self._asks(m, s, budgets[j].get(m.name, (0, 0.0))[0], picks[j])]
            if not ask:
                continue
            t = time.perf_counter()
            drafts = m.propose_parts([seqs[j] for j in ask], [budgets[j] for j in ask])
            spent = time.perf_counter() - t - sum(d.setup_s for d in drafts)
            for j, draft, share in zip(ask, drafts, time_shares(spent, drafts)):
                picks[j].draft_s += share
                self._offer(seqs[j], picks[j], m, draft)
        return [replace(p.draft, setup_s=p.setup_s, draft_s=p.draft_s) for p in picks]

    def _asks(self, m: Drafter, seq: Sequence, max_tokens: int, pick: _Pick) -> bool:
        """Whether member m drafts for `seq`: given a budget, nothing settled yet and (`gain`) if it knows its
        confidence, a full-length draft from it could beat the best so far."""
        if pick.final or max_tokens <= 0:
            return False
        return not (
            self.mode == "gain"
            and m.confidence_stop
            and pick.gain >= sum(seq.acceptance_of(m.name).survival(max_tokens))
        )

    def _offer(self, seq: Sequence, pick: _Pick, m: Drafter, draft: Draft) -> None:
        """Member m's draft for `seq`: used at once (`first`, or sampled), or if it is the best."""
        pick.setup_s += draft.setup_s
        if not draft.tokens:
            return
        if self.mode == "first" or draft.probs is not None:
            # A sampled draft is used once drawn: choosing by its (random) length would bias its tokens.
            pick.draft, pick.final = replace(draft, source=m.name), True
            return
        gain = sum(seq.acceptance_of(m.name).survival(draft.depth))  # expected accepted tokens
        if gain > pick.gain:
            pick.draft, pick.gain = replace(draft, source=m.name), gain

    def pending_setup(self, seq: Sequence) -> int:
        return sum(m.pending_setup(seq) for m in self.parts(seq))

    def decline_setup(self, seq: Sequence) -> bool:
        declined = self.declined.setdefault(seq.slot, set())
        declined.update(i for i, m in enumerate(self.members) if m.pending_setup(seq))
        return len(declined) < len(self.members)

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        for m in self.members:
            m.update(seq, drafted, accepted)

    def observe_features(self, seq: Sequence, feats: Features) -> None:
        for m in self.members:
            if m.features is not None:
                m.observe_features(seq, feats.columns(m.features.layers, self.features.layers))

    def release(self, seq: Sequence) -> None:
        self.declined.pop(seq.slot, None)
        for m in self.members:
            m.release(seq)

    def reset(self) -> None:
        for m in self.members:
            m.reset()


def assemble(parts: list[str], member: Callable[[str], Drafter | None], mode: str = "first") -> Drafter | None:
    """The drafter for spec types `parts` (one, or a chain of several), each made by `member`."""
    if mode not in CHAIN_MODES:
        raise SpecdecError(f"unknown chain mode {mode!r} (choose {', '.join(CHAIN_MODES)})")
    if len(parts) == 1:
        return member(parts[0])
    return ChainDrafter([member(p) for p in parts], mode)
