"""Per-token origin of a sequence's output (the server's opt-in `specdec_trace`): for each committed token, which
drafter proposed it or whether the target chose it, with the step, the draft position, the target's probability
and its top-2 logit gap; and the drafted tokens the target rejected, on the token that replaced them.

The engine fills `Sequence.trace` with these entries (`TokenTrace`, defined beside `Sequence`) when asked for."""

from __future__ import annotations

import torch

from specdec.sequence import Draft, TokenTrace

__all__ = ["TokenTrace", "step_trace"]


def step_trace(
    step: int,
    new: list[int],
    logits: torch.Tensor,
    gaps: list[float],
    draft: Draft | None,
    path: list[int],
    drafter: str | None,
    texts: list[str],
) -> list[TokenTrace]:
    """The trace of the first len(new) tokens a step committed: `new` are the accepted drafts along `path` then
    the target's token, logits [>= len(new), V] their target rows, gaps their top-2 gaps, texts what each added
    to the output text (the streaming detokenizer's pieces)."""
    probs = logits[: len(new)].float().softmax(-1).gather(1, torch.tensor(new)[:, None])[:, 0].tolist()
    out = []
    for i, (tok, p, gap, text) in enumerate(zip(new, probs, gaps, texts)):
        if i < len(path):
            out.append(TokenTrace(tok, "draft", step, i + 1, p, gap, drafter, text=text))
            continue
        rejected = _rejected(draft, path)
        origin = "correction" if rejected else "bonus" if draft is not None and draft.tokens else "target"
        out.append(
            TokenTrace(
                tok,
                origin,
                step,
                i + 1,
                p,
                gap,
                rejected=rejected,
                drafted=len(draft.tokens) if draft is not None else 0,
                text=text,
            )
        )
    return out


def _rejected(draft: Draft | None, path: list[int]) -> list[int]:
    """Drafted tokens the target turned down where the accepted path ends: a chain's rest, or a tree's children
    of the last accepted node."""
    if draft is None or not draft.tokens:
        return []
    if draft.parents is None:
        return draft.tokens[len(path) :]
    at = path[-1] if path else -1
    return [t for t, parent in zip(draft.tokens, draft.parents) if parent == at]
