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

from dataclasses import dataclass, field, replace
from typing import Callable

from specdec.acceptance import AcceptanceEstimate
from specdec.drafters.base import Draft, Drafter
from specdec.errors import SpecdecError
from specdec.runtime.runner import Features
from specdec.sequence import Sequence

CHAIN_MODES = ("first", "gain")


@dataclass
class _Pick:
    """One sequence's choice among its members' drafts so far."""
    draft: Draft = field(default_factory=lambda: Draft([]))
    gain: float = 0.0     # expected accepted tokens of `draft` (`gain`)
    setup_s: float = 0.0  # every asked member's catch-up, whichever draft is used
    final: bool = False   # settled: no further member is asked


class ChainDrafter(Drafter):
    """Every member hears `update` and `release`, so each keeps its per-sequence state in step. Members that draft
    in batches (the draft model) draft every sequence of a step that asks them in one call."""

    def __init__(self, members: list[Drafter], mode: str = "first"):
        self.members, self.mode = members, mode
        self.name = ",".join(m.name for m in members)
        self.batched = any(m.batched for m in members)
        self.acceptance: dict[int, list[AcceptanceEstimate]] = {}  # slot -> per member
        self.chosen: dict[int, int] = {}  # slot -> member whose draft was used last
        self.declined: dict[int, set[int]] = {}  # slot -> members whose catch-up the engine declined
        for m in members:
            if m.features is not None:
                self.features = m.features.union(self.features)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        return self.propose_batch([seq], [max_tokens], [min_path_prob])[0]

    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int], min_path_probs: list[float]) -> list[Draft]:
        """Each member in turn drafts for the sequences still asking it (in one call where it drafts in batches)."""
        picks = [_Pick() for _ in seqs]
        for i, m in enumerate(self.members):
            ask = [j for j, s in enumerate(seqs) if self._asks(i, s, max_tokens[j], picks[j])]
            if not ask:
                continue
            args = ([seqs[j] for j in ask], [max_tokens[j] for j in ask], [min_path_probs[j] for j in ask])
            drafts = m.propose_batch(*args) if m.batched else [m.propose(*a) for a in zip(*args)]
            for j, draft in zip(ask, drafts):
                self._offer(seqs[j].slot, picks[j], i, draft)
        return [replace(p.draft, setup_s=p.setup_s) for p in picks]

    def _asks(self, i: int, seq: Sequence, max_tokens: int, pick: _Pick) -> bool:
        """Whether member i drafts for `seq`: nothing settled yet, its catch-up not declined and (`gain`) if it
        knows its confidence, a full-length draft from it could beat the best so far."""
        if pick.final or i in self.declined.get(seq.slot, ()):
            return False
        est = self.acceptance.setdefault(seq.slot, [AcceptanceEstimate() for _ in self.members])[i]
        return not (self.mode == "gain" and self.members[i].confidence_stop
                    and pick.gain >= sum(est.survival(max_tokens)))

    def _offer(self, slot: int, pick: _Pick, i: int, draft: Draft) -> None:
        """Member i's draft for the sequence in `slot`: used at once (`first`, or sampled), or if it is the best."""
        pick.setup_s += draft.setup_s
        if not draft.tokens:
            return
        if self.mode == "first" or draft.probs is not None:
            # A sampled draft is used once drawn: choosing by its (random) length would bias its tokens.
            pick.draft, pick.final, self.chosen[slot] = replace(draft, source=self.members[i].name), True, i
            return
        gain = sum(self.acceptance[slot][i].survival(draft.depth))  # expected accepted tokens
        if gain > pick.gain:
            pick.draft, pick.gain, self.chosen[slot] = replace(draft, source=self.members[i].name), gain, i

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
