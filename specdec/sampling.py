"""Sampling parameters and the three small functions that turn logits into tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import SpecdecError


GREEDY_EPS = 1e-5  # as vLLM


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_EPS are greedy (dividing logits by them would overflow)."""
        return self.temperature < GREEDY_EPS

    def validate(self) -> "SamplingParams":
        checks = [(self.temperature >= 0, "temperature must be >= 0"), (self.top_k >= 0, "top_k must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"), (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.max_tokens >= 1, "max_tokens must be >= 1")]
        for ok, msg in checks:
            if not ok:
                raise SpecdecError(msg)
        return self

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.seed()))
        return g


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> temperature-scaled logits [N, V] with filtered entries at -inf.

    Order: temperature, top-k, top-p, min-p; applied identically to target and draft.
    """
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_x.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted), float("-inf"))
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def probs_from_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the sampling distribution [N, V] (float32)."""
    return filter_logits(logits.float(), p).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> token ids [N]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
