"""The drafter interface: `propose` a chain of tokens, then hear back how many were accepted."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.engine.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]                  # [k]
    probs: torch.Tensor | None = None  # [k, V] distributions the tokens were sampled from; None = one-hot


class Drafter(ABC):
    name: str = ""

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens continuing `seq.tokens`."""

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Feedback after verification (`seq.tokens` already holds the committed tokens)."""

    def release(self, seq: Sequence) -> None:
        """The sequence is finished; drop per-sequence state."""
