"""Draft planning for one engine step: how many tokens to ask each part of each sequence's drafter for (a chain's
members judged apart; priced by engine/adaptive.py), the drafts they make, timed, and the costs they show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec.drafters.base import time_shares
from specdec.engine.adaptive import (
    CostModel,
    choose_draft_len,
    expected_saving,
    failed_share,
    plain_cost,
    probe_every,
    retry_pace,
)
from specdec.sequence import Budgets, Draft, Drafter, Sequence

__all__ = ["DraftPlanner", "Proposal", "SpecConfig", "source"]


@dataclass
class SpecConfig:
    """The engine's drafting settings (`Config.spec`)."""

    draft_max: int = 16
    draft_min: int = 0
    adaptive: bool = True  # choose each step's draft length by expected tokens/s (engine/adaptive.py)
    accept_threshold: float = 0.0  # opt-in LOSSY relaxed acceptance (verify.Relaxed); 0 = off, lossless


@dataclass
class Proposal:
    """One sequence's draft for a step."""

    draft: Draft
    asked: int  # the draft length asked for (the adaptive choice)


def source(seq: Sequence, draft: Draft) -> str:
    """The part of the sequence's drafter that drafted `draft`."""
    return draft.source or seq.drafter.name


class DraftPlanner:
    """Plans a step's drafts from the engine's settings (`spec`), its measured costs (`cost`, which the drafts
    update), its context and clock. `propose` holds the step's state: its batch, draft cap, whether it is light, and
    the rows its target forward holds so far (each sequence's last token, then the drafts granted before)."""

    def __init__(self, spec: SpecConfig, cost: CostModel, context: int, clock: Callable[[], float]):
        self.spec, self.cost, self.context, self.clock = spec, cost, context, clock
        self.batch, self.cap, self.light, self.rows = 0, None, False, 0

    def propose(self, seqs: list[Sequence], cap: int | None = None, light: bool = False) -> dict[int, Proposal | None]:
        """Each sequence's proposal by id (None where its drafting failed, which ended it), at most `cap` tokens each
        (`light`: only drafter parts that run no model draft); sequences sharing a batched drafter draft together."""
        self.batch, self.cap, self.light, self.rows = len(seqs), cap, light, len(seqs)
        out: dict[int, Proposal | None] = {}
        groups: dict[int, list[Sequence]] = {}
        for s in seqs:
            if s.drafter is not None and s.drafter.batched:
                groups.setdefault(id(s.drafter), []).append(s)
            else:
                out[id(s)] = s.guarded(self._propose, s)
        for group in groups.values():
            out.update(self._propose_batch(group))
        return out

    def _propose(self, seq: Sequence) -> Proposal:
        """The sequence's draft for this step, timed."""
        return self._propose_alone(seq, self._budgets(seq))

    def _propose_batch(self, seqs: list[Sequence]) -> dict[int, Proposal | None]:
        """Proposals of sequences sharing one batched drafter, from one `propose_parts` call whose time is shared
        by drafted tokens (each sequence's catch-up on a new prompt apart) unless the drafter tells each draft's
        share. If that call fails, each sequence drafts alone, so a failure ends only the sequence it belongs to."""
        budgets = {id(s): s.guarded(self._budgets, s) for s in seqs}
        live = [s for s in seqs if budgets[id(s)] is not None]
        todo = [s for s in live if budgets[id(s)]]
        setups = {id(s): self._setups(s, budgets[id(s)]) for s in todo}
        t = self.clock()
        try:
            drafts = seqs[0].drafter.propose_parts(todo, [budgets[id(s)] for s in todo]) if todo else []
        except Exception:  # noqa: BLE001 - retried one by one below
            return {id(s): s.guarded(self._propose_alone, s, budgets[id(s)]) for s in live}
        dt = self.clock() - t
        shares = time_shares(dt - sum(d.setup_s for d in drafts), drafts)
        by_seq = dict(zip(map(id, todo), zip(drafts, shares)))
        out: dict[int, Proposal | None] = {id(s): None for s in seqs if budgets[id(s)] is None}
        for s in live:
            if id(s) not in by_seq:  # asked for no draft this step
                out[id(s)] = self._proposal(s, {}, Draft([]), 0.0)
                continue
            d, share = by_seq[id(s)]
            spent = d.draft_s if d.draft_s is not None else share
            out[id(s)] = self._proposal(s, budgets[id(s)], d, d.setup_s + spent, setups[id(s)])
        return out

    def _propose_alone(self, seq: Sequence, budgets: Budgets) -> Proposal:
        """One sequence's draft within its parts' budgets, timed."""
        setups = self._setups(seq, budgets)
        t = self.clock()
        draft = seq.drafter.propose_parts([seq], [budgets])[0] if budgets else Draft([])
        return self._proposal(seq, budgets, draft, self.clock() - t, setups)

    def _budgets(self, seq: Sequence) -> Budgets:
        """Per part of the sequence's drafter (`Drafter.parts`: a chain's members, judged apart), the tokens to ask
        it for and the path probability below which it should stop by itself; parts not expected to pay are left
        out, and in a light step those that run a model. Only drafts that can still matter: room in the context and
        in max_tokens, less the bonus token; with adaptive lengths, no longer than `CostModel.ramp` lets a forward
        of unmeasured size grow."""
        room = min(self.context - len(seq.tokens), seq.params.max_tokens - len(seq.output_ids)) - 1
        asked = seq.options.draft_max
        k_max = min(self.spec.draft_max if asked is None else asked, room)
        if self.cap is not None:
            k_max = min(k_max, self.cap)
        if self.spec.adaptive:
            k_max = min(k_max, self.cost.ramp(self.rows))
        if seq.drafter is None or k_max <= 0:
            return {}
        parts = [p for p in seq.drafter.parts(seq) if p.model_free or not self.light]
        if not self.spec.adaptive:
            return {p.name: (k_max, 0.0) for p in parts}
        out = {p.name: self._part_len(seq, p, k_max) for p in parts}
        self.rows += max((rows for _, _, rows in out.values()), default=0)  # one part's draft is verified
        return {name: (k, prob) for name, (k, prob, _) in out.items() if k > 0}

    def _part_len(self, seq: Sequence, part: Drafter, k_max: int) -> tuple[int, float, int]:
        """(tokens, stopping path probability, tokens expected) for one part of the sequence's drafter: 0 where
        no draft of it is expected to beat plain decoding on top of the step's rows so far, except a one-token
        probe now and then. A part that stops by itself gets k_max tokens but is expected to draft the best k."""
        failed = failed_share(self.cost, part.name, self.batch, self.rows)
        pace = retry_pace(failed)
        acc = seq.acceptance_of(part.name, self.cost.acceptance(part.name), pace)
        k = choose_draft_len(self.cost, acc, min(self.spec.draft_min, k_max), k_max, part.name, self.batch, self.rows)
        acc.relax(pace, start=k)  # the positions this step does not draft drift back toward the prior
        probe = k == 0
        if probe:  # drafting is not expected to pay: skip it, but now and then draft one token to re-measure
            if not self.cost.probe_due(part.name, probe_every(failed)):
                return 0, 0.0, 0
            if self.batch > 1 and part.pending_setup(seq) > len(seq.output_ids):
                return 0, 0.0, 0  # in a batch a probe never pays a catch-up on a new prompt: the batch would wait
            k = min(k_max, max(1, self.spec.draft_min))
        if not self._setup_pays(seq, part, k_max):
            seq.drafter.decline_setup(seq)  # a chain leaves the part out for the rest of the sequence
            return 0, 0.0, 0
        if not part.confidence_stop:
            return k, 0.0, k
        # Draft one more token while its expected yield (the chance the path so far is accepted, times the
        # target forward it saves) beats what drafting it and verifying one more row cost.
        draft_s = self.cost.draft_cost(part.name)
        min_path_prob = (
            (draft_s + self.cost.row_cost()) / plain_cost(self.cost, self.batch)
            if draft_s > 0 and self.cost.verify_s
            else 0.0
        )
        return (k if probe else k_max), min_path_prob, k

    def _setup_pays(self, seq: Sequence, part: Drafter, k_max: int) -> bool:
        """Whether the part's pending catch-up on this sequence (its own prefill of a new prompt) is expected to
        be repaid over the rest of the request (engine/adaptive.py); unmeasured, it is paid and so measured. A
        sequence refused at its first step lets the part's history drift back toward the prior, so a later
        request pays again and re-measures."""
        setup_s = self.cost.setup_cost(part.pending_setup(seq), part.name)
        if setup_s == 0:
            return True
        left = min(self.context - len(seq.tokens), seq.params.max_tokens - len(seq.output_ids))
        if left * expected_saving(self.cost, k_max, part.name, self.batch) > setup_s:
            return True
        if seq.stats.target_forwards == 1:
            self.cost.acceptance(part.name).relax()
        return False

    @staticmethod
    def _setups(seq: Sequence, budgets: Budgets) -> dict[str, int]:
        """Tokens each part asked to draft must first catch up on (its own prefill of a new prompt), by name."""
        return {p.name: p.pending_setup(seq) for p in seq.drafter.parts(seq) if p.name in budgets} if budgets else {}

    def _proposal(
        self, seq: Sequence, budgets: Budgets, draft: Draft, seconds: float, setups: dict[str, int] | None = None
    ) -> Proposal:
        """Record a sequence's draft (its parts asked for `budgets`, `seconds` spent on it, their catch-up on
        `setups` tokens included): costs and, later, acceptance count for the part that drafted it."""
        if len(draft.tokens) < self.spec.draft_min and draft.probs is None:
            draft = Draft([], setup_s=draft.setup_s)  # a sampled draft is kept: dropping it by length biases it
        seq.stats.draft_s += seconds
        total = sum((setups or {}).values())
        for name, tokens in (setups or {}).items():
            if tokens:
                self.cost.observe_setup(tokens, draft.setup_s * tokens / total, name)
        if draft.tokens:  # the drafter's catch-up on a new prompt is not drafting
            self.cost.observe_draft(len(draft.tokens), seconds - draft.setup_s, source(seq, draft))
        return Proposal(draft, max((k for k, _ in budgets.values()), default=0))
