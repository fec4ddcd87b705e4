"""The drafter interface: `propose` a chain (or tree) of tokens, then hear back how many were accepted."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specdec.runtime.runner import Features, FeatureSpec
from specdec.sampling import probs_from_logits, sample, seeded_scores
from specdec.sequence import Draft, Sequence

__all__ = ["SETUP_TOKENS", "Budgets", "Draft", "Drafter", "draft_distribution", "draw", "time_shares"]

# per part of a drafter, by name: (tokens to ask it for, path probability below which it stops by itself)
Budgets = dict[str, tuple[int, float]]
SETUP_TOKENS = 32  # a catch-up longer than any draft: the prompt, counted as setup (not drafting)


class Drafter(ABC):
    name: str = ""
    # A drafter that knows its own confidence stops drafting by itself once the chance that the whole draft
    # so far gets accepted falls below the `min_path_prob` it is given; the engine then asks for its budget.
    confidence_stop: bool = False
    # Target hidden states this drafter reads (trained heads, block drafters); None: none. The engine then
    # captures them on every target forward and hands over the rows of committed tokens (`observe_features`).
    features: FeatureSpec | None = None
    # A drafter that runs a model may draft several sequences in one call, its forwards batched over them:
    # it then sets this and implements `propose_batch(seqs, max_tokens, min_path_probs) -> list[Draft]`.
    batched: bool = False
    # A drafter that runs no model (look-ups in token statistics): its drafts cost next to nothing to make, so the
    # load controller may let only such parts draft under load (`Engine.step(light=True)`).
    model_free: bool = False

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        """Up to `max_tokens` tokens continuing `seq.tokens`; the draft says how long it spent catching up
        on context it had not seen (`Draft.setup_s`)."""

    def parts(self, seq: Sequence) -> list[Drafter]:
        """The drafters whose drafts the engine judges apart for `seq` (each its own cost per token, acceptance and
        draft length): a chain's members that may still draft for it; any other drafter is one part, itself."""
        return [self]

    def propose_parts(self, seqs: list[Sequence], budgets: list[Budgets]) -> list[Draft]:
        """A draft for each of `seqs`, whose budgets give each part (`parts`) by name the tokens to ask it for and
        the path probability below which it stops by itself; a part without one drafts nothing. One drafter: its
        own budget, all sequences in one call where it drafts in batches."""
        asks = [b.get(self.name, (0, 0.0)) for b in budgets]
        if self.batched:
            return self.propose_batch(seqs, [k for k, _ in asks], [p for _, p in asks])
        return [self.propose(s, k, p) if k > 0 else Draft([]) for s, (k, p) in zip(seqs, asks)]

    def pending_setup(self, seq: Sequence) -> int:
        """Tokens this drafter would first have to catch up on (its own prefill of a new prompt) before drafting
        for `seq`, when that is a one-off setup of more than SETUP_TOKENS; 0 otherwise. The engine drafts only
        where that setup is expected to be repaid (`engine.adaptive.expected_saving`)."""
        return 0

    def decline_setup(self, seq: Sequence) -> bool:
        """The engine judged the pending catch-up on `seq` not worth paying: True if this drafter can still draft
        for `seq` without it (a chain then leaves out the members that need one), False to draft nothing."""
        return False

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Feedback after verification (`seq.tokens` already holds the committed tokens)."""

    def observe_features(self, seq: Sequence, feats: Features) -> None:
        """Target features of tokens just committed, one row per token in sequence order, each token once:
        the prompt at prefill, then per step the last committed token and the accepted draft tokens (rejected
        draft rows never arrive; the bonus token's row comes with the next step)."""

    def release(self, seq: Sequence) -> None:
        """The sequence is finished; drop per-sequence state."""

    def reset(self) -> None:
        """Forget what was learned across requests (e.g. between benchmark repeats)."""


def time_shares(seconds: float, drafts: list[Draft]) -> list[float]:
    """Each draft's share of the `seconds` one call spent drafting them all (catch-ups apart): by drafted tokens,
    equal shares where none drafted anything."""
    drafted = sum(len(d.tokens) for d in drafts)
    return [seconds * (len(d.tokens) / drafted if drafted else 1 / len(drafts)) for d in drafts]


def draft_distribution(logits: torch.Tensor, seq: Sequence, needed: bool) -> torch.Tensor | None:
    """A model drafter's logits [V] -> the distribution q [V] its token is drawn from (the sequence's sampling
    settings); greedy: the softmax only when a stopping rule reads it (`needed`), else None."""
    if not seq.params.greedy:
        return probs_from_logits(logits[None], seq.params)[0]
    return logits.softmax(-1) if needed else None


def draw(logits: torch.Tensor, q: torch.Tensor | None, seq: Sequence, position: int,
         branch: bool) -> tuple[int, int | None]:
    """(token, sibling or None) for the draft position that is token `position` of the sequence.

    Greedy: the two best. Seeded: the two best under the target's noise for that position.
    Sampling: two independent draws from q (the verifier treats siblings as such)."""
    if seq.params.greedy or seq.seeded:
        scores = logits if seq.params.greedy else seeded_scores(logits, seq.params, position)  # [V]
        top = scores.topk(2)
        second_ok = branch and bool(torch.isfinite(top.values[1]))
        return int(top.indices[0]), int(top.indices[1]) if second_ok else None
    tok = int(sample(q[None], seq.generator))
    return tok, int(sample(q[None], seq.generator)) if branch else None
