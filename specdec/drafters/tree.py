"""EAGLE-2-style dynamic draft trees (Li et al. 2024): grown one depth at a time by path probability.

A drafter that scores a node's children with one model forward (a trained head) keeps its candidates here:
every child it proposed, with the path probability of reaching it (the product of the drafter's probabilities
along the path). Per depth, `to_expand` picks the few newest candidates worth a forward (the best paths whose
children could still make the final tree); the draft is the `budget` best candidates over all depths, which is
a tree because a child's path probability never exceeds its parent's. Drafts are deterministic (the drafter's
best tokens, no `Draft.probs`), so the verifier treats them as one-hot: lossless at any temperature.
"""

from __future__ import annotations

ROOT = -1  # the parent of depth-0 candidates: the last committed token


class DynamicTree:
    """Candidates of one draft tree, in the order they were proposed (a parent before its children)."""

    def __init__(self, budget: int, min_path_prob: float = 0.0):
        self.budget, self.min_path_prob = budget, min_path_prob
        self.tokens: list[int] = []
        self.parents: list[int] = []  # candidate index, or ROOT
        self.depths: list[int] = []  # 0: continues the last committed token
        self.paths: list[float] = []  # path probability
        self.rows: dict[int, int] = {}  # expanded candidate -> its order of expansion (a cache row)

    def __len__(self) -> int:
        return len(self.tokens)

    def add_children(self, parent: int, tokens: list[int], probs: list[float]) -> list[int]:
        """Candidates continuing `parent` (ROOT or a candidate): `tokens` with the drafter's probabilities `probs`.
        Paths below `min_path_prob` are dropped, except the very first candidate (a draft has at least one token).
        Returns the new candidates' indices."""
        base = 1.0 if parent == ROOT else self.paths[parent]
        depth = 0 if parent == ROOT else self.depths[parent] + 1
        new = []
        for tok, p in zip(tokens, probs):
            if self.tokens and base * p < self.min_path_prob:
                continue
            self.tokens.append(tok)
            self.parents.append(parent)
            self.depths.append(depth)
            self.paths.append(base * p)
            new.append(len(self.tokens) - 1)
        return new

    def _ranked(self) -> list[int]:
        """Every candidate, best path first (ties: the earlier one, so a parent before its children)."""
        return sorted(range(len(self)), key=lambda c: (-self.paths[c], c))

    def to_expand(self, layer: list[int], width: int) -> list[int]:
        """Up to `width` candidates of `layer` (best path first) whose children could still enter the `budget` best,
        at most `budget - 1` expansions in all; they get the next rows (`rows`)."""
        ranked = self._ranked()
        bar = self.paths[ranked[self.budget - 1]] if len(ranked) >= self.budget else 0.0  # the budget-th best path
        room = self.budget - 1 - len(self.rows)
        chosen = [
            c
            for c in sorted(layer, key=lambda c: (-self.paths[c], c))
            if self.paths[c] > bar and self.paths[c] >= self.min_path_prob
        ][: max(0, min(width, room))]
        for c in chosen:
            self.rows[c] = len(self.rows)
        return chosen

    def lineage(self, c: int) -> list[int]:
        """Candidates from depth 0 down to `c`."""
        out = []
        while c != ROOT:
            out.append(c)
            c = self.parents[c]
        return out[::-1]

    def draft(self) -> tuple[list[int], list[int] | None]:
        """(tokens [N], parents [N] or None for a chain) of the `budget` best candidates, parents first."""
        keep = sorted(self._ranked()[: self.budget])
        node = {c: i for i, c in enumerate(keep)}
        parents = [ROOT if self.parents[c] == ROOT else node[self.parents[c]] for c in keep]
        is_chain = all(p == i - 1 for i, p in enumerate(parents))
        return [self.tokens[c] for c in keep], None if is_chain else parents
