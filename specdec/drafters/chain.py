"""Chains (`--spec-type ngram-mod,draft`): several drafters, one draft per step.

`first` (llama.cpp's behaviour): ask each member in order, use the first non-empty draft.
`gain`: use the draft with the most expected accepted tokens, from each member's own measured
per-position acceptance on this sequence; a drafter that knows its confidence (the draft model,
the expensive one) is only asked when even a full-length draft from it could beat the best so far,
and a draft it samples (temperature > 0, unseeded) is then used whatever its length.
A member whose catch-up on a new prompt (the draft model's own prefill) the engine declines sits out the rest of
that sequence, and the others draft without it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from specdec.acceptance import AcceptanceEstimate
from specdec.drafters.base import Draft, Drafter
from specdec.errors import SpecdecError
from specdec.runtime.runner import Features
from specdec.sequence import Sequence

CHAIN_MODES = ("first", "gain")


class ChainDrafter(Drafter):
    """Every member hears `update` and `release`, so each keeps its per-sequence state in step."""

    def __init__(self, members: list[Drafter], mode: str = "first"):
        self.members, self.mode = members, mode
        self.name = ",".join(m.name for m in members)
        self.acceptance: dict[int, list[AcceptanceEstimate]] = {}  # slot -> per member
        self.chosen: dict[int, int] = {}  # slot -> member whose draft was used last
        self.declined: dict[int, set[int]] = {}  # slot -> members whose catch-up the engine declined
        for m in members:
            if m.features is not None:
                self.features = m.features.union(self.features)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        best, best_gain = Draft([]), 0.0
        setup_s = 0.0  # every member's catch-up, whichever draft is used
        est = self.acceptance.setdefault(seq.slot, [AcceptanceEstimate() for _ in self.members])
        declined = self.declined.get(seq.slot, ())
        for i, m in enumerate(self.members):
            if i in declined:
                continue
            if self.mode == "gain" and m.confidence_stop and best_gain >= sum(est[i].survival(max_tokens)):
                continue
            draft = m.propose(seq, max_tokens, min_path_prob)
            setup_s += draft.setup_s
            if not draft.tokens:
                continue
            if self.mode == "first" or draft.probs is not None:
                # A sampled draft is used once drawn: choosing by its (random) length would bias its tokens.
                self.chosen[seq.slot] = i
                return replace(draft, setup_s=setup_s, source=m.name)
            gain = sum(est[i].survival(draft.depth))  # expected accepted tokens
            if gain > best_gain:
                best, best_gain, self.chosen[seq.slot] = replace(draft, source=m.name), gain, i
        return replace(best, setup_s=setup_s)

    def pending_setup(self, seq: Sequence) -> int:
        declined = self.declined.get(seq.slot, ())
        return sum(m.pending_setup(seq) for i, m in enumerate(self.members) if i not in declined)

    def decline_setup(self, seq: Sequence) -> bool:
        declined = self.declined.setdefault(seq.slot, set())
        declined.update(i for i, m in enumerate(self.members) if m.pending_setup(seq))
        return len(declined) < len(self.members)

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        who = self.chosen.pop(seq.slot, None)
        if who is not None and drafted:
            self.acceptance[seq.slot][who].observe(drafted, accepted)
        for m in self.members:
            m.update(seq, drafted, accepted)

    def observe_features(self, seq: Sequence, feats: Features) -> None:
        for m in self.members:
            if m.features is not None:
                m.observe_features(seq, feats.columns(m.features.layers, self.features.layers))

    def release(self, seq: Sequence) -> None:
        self.acceptance.pop(seq.slot, None)
        self.chosen.pop(seq.slot, None)
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
