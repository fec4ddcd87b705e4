"""What drafters build on: the interface (`Drafter`: `propose` a chain or tree of tokens, then hear back how many were
accepted; defined in specdec/sequence.py beside the `Draft` and `Sequence` it works on, and re-exported here), the
setup threshold, time shares of a batched call and drawing a draft token by the sequence's sampling settings."""

from __future__ import annotations

import torch

from specdec.sampling import probs_from_logits, sample, seeded_scores
from specdec.sequence import Budgets, Draft, Drafter, Sequence

__all__ = ["SETUP_TOKENS", "Budgets", "Draft", "Drafter", "draft_distribution", "draw", "time_shares"]

SETUP_TOKENS = 32  # a catch-up longer than any draft: the prompt, counted as setup (not drafting)


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


def draw(
    logits: torch.Tensor, q: torch.Tensor | None, seq: Sequence, position: int, branch: bool
) -> tuple[int, int | None]:
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
