"""`synthetic`: fake drafts accepted at given per-position rates, to measure verification cost.

Its `verify_hook` keeps `forced` draft tokens whatever the target says, so the output is NOT the
target's text (results are flagged `synthetic`). Only for benchmarks, and only on request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.registry import DrafterType, Option, float_list
from specdec.sequence import Sequence


@dataclass
class SyntheticDraft(Draft):
    forced: int = 0  # accept this many draft tokens regardless of the target


class SyntheticDrafter(Drafter):
    name = "synthetic"
    model_free = True

    def __init__(self, rates: list[float], length: int, seed: int = 0):
        self.rates, self.length = rates, length
        self.rng = random.Random(seed)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        k = min(self.length, max_tokens)
        accepted = 0
        while accepted < k and self.rng.random() < self.rates[min(accepted, len(self.rates) - 1)]:
            accepted += 1
        return SyntheticDraft(self._text(seq.output_ids or seq.tokens[-1:], k), forced=accepted)

    def _text(self, tokens: list[int], k: int) -> list[int]:
        """k consecutive tokens from a random place in the output so far (cycled where it is shorter): text, not
        one token repeated, since on a mixture of experts the rows' tokens choose the experts a verify reads
        (gpt-oss-20b shape, 9 rows: 18.6 distinct experts a layer for text, 15.8 for one token repeated). Not the
        prompt's: its end-of-turn tokens would stop the sequence once forced."""
        at = self.rng.randrange(len(tokens))
        return [tokens[(at + i) % len(tokens)] for i in range(k)]


def forced_acceptance(seq: Sequence, draft: Draft, logits: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """A synthetic draft's `forced` tokens plus the target's pick after them (logits [N+1, V]); flags the
    sequence as not the target's output. Other drafts: None (verified as usual)."""
    if not isinstance(draft, SyntheticDraft):
        return None
    seq.synthetic = True
    n = draft.forced
    return draft.tokens[:n] + [int(logits[n].argmax())], list(range(n))


OPTIONS = (
    Option(
        "synth_rates",
        "--spec-synth-rates",
        (0.8,),
        "synthetic: acceptance probability per draft position, "
        "e.g. 0.9,0.8,0.6 (the last one repeats); output is NOT valid text (default 0.8)",
        float_list,
        "numbers in [0, 1]",
    ),
    Option("synth_len", "--spec-synth-len", 8, "synthetic: tokens per fake draft (default 8)", int, ">= 1"),
)
TYPES = (
    DrafterType(
        "synthetic",
        lambda ctx: SyntheticDrafter(list(ctx.options["synth_rates"]), ctx.options["synth_len"]),
        "fake drafts accepted at --spec-synth-rates (benchmarks; output NOT valid)",
        OPTIONS,
        lossy=True,
        verify_hook=forced_acceptance,
    ),
)
