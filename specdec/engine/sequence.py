"""A sequence being generated: its tokens, budgets, sampler state and stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.engine.adaptive import AcceptanceEstimate
from specdec.engine.stats import Stats
from specdec.sampling import SamplingParams


@dataclass
class Sequence:
    tokens: list[int]          # prompt + committed output
    prompt_len: int
    slot: int                  # KV cache row
    params: SamplingParams
    generator: torch.Generator | None = None
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None  # "stop" | "length"
    text: str = ""                    # decoded output (stop strings cut off)
    synthetic: bool = False           # a synthetic drafter forced acceptances: not the target's text
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    top2_gaps: list[float] = field(default_factory=list)  # per output token: target's top-1 minus top-2 logit

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def last_position(self) -> int:
        """Position of the newest token: the one not yet in the target's KV cache."""
        return len(self.tokens) - 1
