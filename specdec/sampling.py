"""Sampling parameters and the small functions that turn logits into tokens.

Unseeded sampling draws from a per-sequence generator (`sample`). Seeded sampling is a function of
(seed, position) only: Gumbel-max with noise keyed by both (`seeded_pick`), so a seeded request's
text is the same whatever drafted it and whatever else ran beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import SpecdecError

GREEDY_EPS = 1e-5  # as vLLM
SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
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
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.seed is None or 0 <= self.seed < SEED_LIMIT, f"seed must be in [0, {SEED_LIMIT})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SpecdecError(msg)
        return self

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # non-deterministic, this generator only (torch.seed() would reseed every device)
        else:
            g.manual_seed(self.seed)
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
        probs = sorted_x.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= p.top_p  # keep the smallest prefix reaching top_p
        drop_sorted[..., 0] = False  # the likeliest token stays, also where top_p rounds to 0 in float32 (5e-324)
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


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value from x."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [V] that depends on (seed, position) only."""
    g = torch.Generator().manual_seed(_mix64(_mix64(seed) ^ position))
    u = torch.rand(vocab, generator=g, dtype=torch.float64)
    return -torch.log(-torch.log(u))  # u = 0 gives -inf: that token is never picked (p = 2^-53)


def seeded_scores(logits: torch.Tensor, p: SamplingParams, position: int) -> torch.Tensor:
    """logits [V] -> Gumbel-perturbed scores [V] for the token at `position` (index in the sequence).

    argmax of the scores is an exact draw from probs_from_logits(logits, p); any model that scores
    the same position with the same seed shares the noise, so a draft model's pick and the
    target's coincide as often as their distributions allow."""
    x = filter_logits(logits[None].double(), p)[0]  # [V]
    return x.log_softmax(-1) + gumbel_noise(p.seed, position, x.shape[-1])


def seeded_pick(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    """logits [V] -> the seeded token at `position`."""
    return int(seeded_scores(logits, p, position).argmax())
