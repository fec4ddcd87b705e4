"""The drafter interface: `propose` a chain (or tree) of tokens, then hear back how many were accepted."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.engine.sequence import Sequence


@dataclass
class Draft:
    """k draft tokens. A chain by default; with `parents`, a tree: node i continues node parents[i]
    (-1 = the last committed token), parents come before children, siblings are distinct tokens
    or independent samples from the same distribution."""
    tokens: list[int]                  # [k]
    probs: torch.Tensor | None = None  # [k, V] distributions the tokens were sampled from; None = one-hot
    parents: list[int] | None = None   # [k] tree structure; None = chain (parents[i] = i - 1)
    forced: int | None = None          # synthetic drafts only: accept this many regardless (lossy)

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path (the chain length for a chain)."""
        if self.parents is None:
            return len(self.tokens)
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 + (depth[p] if p >= 0 else 0))
        return max(depth, default=0)


class Drafter(ABC):
    name: str = ""
    # Drafters that know their own confidence stop drafting by themselves once the chance that the
    # whole draft so far gets accepted falls below `min_path_prob` (set by the adaptive engine).
    confidence_stop: bool = False
    min_path_prob: float = 0.0
    # Seconds of the last `propose` spent catching up on a context it had not seen (a new prompt): a
    # one-off per sequence that the cost model and the load controller count apart from drafting.
    # A drafter that has such a catch-up assigns it in every `propose` (0.0 when there was none).
    setup_s: float = 0.0

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens continuing `seq.tokens`."""

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Feedback after verification (`seq.tokens` already holds the committed tokens)."""

    def release(self, seq: Sequence) -> None:
        """The sequence is finished; drop per-sequence state."""
