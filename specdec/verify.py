"""Lossless verification of a drafted chain or tree against the target's logits.

Greedy: follow the target's argmax through the tree as long as a child matches, then the
target's own token. Sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023),
multi-candidate at tree nodes (SpecInfer); a drafter without probabilities counts as one-hot.
Seeded sampling: the target's token at each position is a Gumbel-max draw keyed by (seed,
position) (`sampling.seeded_pick`), so verification is an exact match, like greedy.
Either way the result is the accepted drafts along one path + one token from the target.
A chain is the tree whose node i continues node i-1.

Opt-in and lossy (`Relaxed`, --spec-accept-threshold T): where the rule above accepts no child of a node, the
first child whose target probability is at least T times the target's top probability is accepted anyway.
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.runtime.small_ops import top2
from specdec.sampling import SamplingParams, probs_from_logits, sample, seeded_pick


def chain(k: int) -> list[int]:
    """Parents of a k-token chain: node i continues node i-1."""
    return list(range(-1, k - 1))


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> list[int]:
    """Chain: draft [k], target_logits [k+1, V] -> accepted drafts followed by the bonus token."""
    return verify_tree_greedy(draft, chain(len(draft)), target_logits)[0]


def verify_sampling(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Chain rejection sampling: draft [k], draft_probs [k, V] or None (one-hot), target_logits [k+1, V]."""
    return verify_tree_sampling(draft, chain(len(draft)), draft_probs, target_logits, params, generator)[0]


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


class Relaxed:
    """Opt-in lossy acceptance: at a node where the lossless rule accepted none of `kids`, the first child whose
    target probability is at least `threshold` x the target's top probability there; counts what it accepted."""

    def __init__(self, tokens: list[int], target_logits: torch.Tensor, params: SamplingParams, threshold: float):
        self.tokens, self.logits, self.params = tokens, target_logits, params  # logits [N+1, V]
        self.threshold, self.count = threshold, 0

    def __call__(self, row: int, kids: list[int]) -> int | None:
        logits = self.logits[row : row + 1]  # [1, V]; only the row where the lossless rule stopped is scored
        p = (logits.softmax(-1) if self.params.greedy else probs_from_logits(logits, self.params))[0]  # [V]
        floor = self.threshold * float(p.max())
        x = next((x for x in kids if float(p[self.tokens[x]]) >= floor), None)
        self.count += x is not None
        return x


def verify_tree_greedy(
    tokens: list[int], parents: list[int], target_logits: torch.Tensor, relax: Relaxed | None = None
) -> tuple[list[int], list[int]]:
    """Greedy over a token tree.

    tokens, parents [N]; target_logits [N+1, V] (row 0: the last committed token, row i+1: node i).
    Returns (accepted tokens + bonus, accepted node indices along the path).
    """
    pred = top2(target_logits)[0]  # [N+1]
    return _verify_tree_match(tokens, parents, lambda row, _depth: pred[row], relax)


def verify_tree_seeded(
    tokens: list[int],
    parents: list[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    position: int,
    relax: Relaxed | None = None,
) -> tuple[list[int], list[int]]:
    """Seeded sampling over a token tree: the target's own seeded pick at each node, matched like greedy.

    target_logits [N+1, V]; `position`: index in the sequence of the first token after the committed ones.
    """
    return _verify_tree_match(
        tokens, parents, lambda row, depth: seeded_pick(target_logits[row], params, position + depth), relax
    )


def _verify_tree_match(
    tokens: list[int], parents: list[int], pick: Callable[[int, int], int], relax: Relaxed | None = None
) -> tuple[list[int], list[int]]:
    """Follow the children that equal the target's pick(row, depth) (row i+1: node i; depth: nodes
    on the path so far), then append the target's pick where none does."""
    kids = _children(parents)
    out, path, cur = [], [], -1
    while True:
        want = pick(cur + 1, len(path))
        nxt = next((i for i in kids.get(cur, []) if tokens[i] == want), None)
        if nxt is None and relax is not None and kids.get(cur):
            nxt = relax(cur + 1, kids[cur])
        if nxt is None:
            out.append(want)
            return out, path
        out.append(tokens[nxt])
        path.append(nxt)
        cur = nxt


def verify_tree_sampling(
    tokens: list[int],
    parents: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    relax: Relaxed | None = None,
) -> tuple[list[int], list[int]]:
    """Multi-candidate rejection sampling over a tree (SpecInfer / EAGLE-2 style).

    At each node the children are tried in order: child x (drawn from q) is accepted with
    probability min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)). If no child is accepted
    the bonus token is sampled from what is left of p. q is one-hot for deterministic drafters.
    draft_probs [N, V] or None; target_logits [N+1, V]. Returns (tokens, accepted node path).
    """
    p_all = probs_from_logits(target_logits, params)  # [N+1, V]
    V = p_all.shape[-1]
    kids = _children(parents)
    out, path, cur = [], [], -1
    while True:
        p = p_all[cur + 1]  # [V]
        accepted = None
        for x in kids.get(cur, []):
            q = (
                draft_probs[x]
                if draft_probs is not None
                else torch.nn.functional.one_hot(torch.tensor(tokens[x]), V).float()
            )  # [V]
            if float(torch.rand(1, generator=generator)) * float(q[tokens[x]]) < float(p[tokens[x]]):
                accepted = x
                break
            residual = (p - q).clamp_min(0)
            p = residual / residual.sum() if residual.sum() > 0 else p
        if accepted is None and relax is not None and kids.get(cur):
            accepted = relax(cur + 1, kids[cur])
        if accepted is None:
            out += sample(p[None], generator).tolist()
            return out, path
        out.append(tokens[accepted])
        path.append(accepted)
        cur = accepted
