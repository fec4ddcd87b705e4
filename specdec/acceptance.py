"""Per-sequence acceptance estimate: for each draft position, P(accepted | every earlier one was).

A leaf module: sequences hold one, drafters (chains) and the adaptive draft length read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of a new observation. At 0.2 a position accepted 80% of the time swung between 0.45 and 0.95, and the
# lows cut drafts short: `specdec bench replay` of synthetic acceptance 0.8 on the gpt-oss-20b shape, 1.30x plain at
# 0.2, 1.35x at 0.1 (model-free drafters on the 1.5B, replayed: no change).
EMA = 0.1
PRIOR_ACCEPT = 0.7
RELAX = 0.05  # per step a position is not drafted, its estimate drifts back toward the prior (so it is retried)


@dataclass
class AcceptanceEstimate:
    rates: list[float] = field(default_factory=list)  # per draft position: P(accept | reached)

    def rate(self, i: int) -> float:
        """Unobserved positions are assumed like the deepest observed one, so longer drafts get tried."""
        if i < len(self.rates):
            return self.rates[i]
        return self.rates[-1] if self.rates else PRIOR_ACCEPT

    def survival(self, k: int) -> list[float]:
        """For i < k: the chance that draft positions 0..i are all accepted."""
        out, p = [], 1.0
        for i in range(k):
            p *= self.rate(i)
            out.append(p)
        return out

    def start(self, pace: float = 1.0) -> AcceptanceEstimate:
        """A new sequence's estimate from this one (a drafter's history over earlier sequences): each position no
        lower than the prior where the first position did well (a drafter that did well starts long), else `pace`
        of the way back to the prior (1: at it, so a drafter that did badly is still tried; less where a failed
        draft is dear, `adaptive.retry_pace`)."""
        lift = 1.0 if not self.rates or self.rates[0] >= PRIOR_ACCEPT else pace
        return AcceptanceEstimate([r if r >= PRIOR_ACCEPT else r + lift * (PRIOR_ACCEPT - r) for r in self.rates])

    def relax(self, pace: float = 1.0, start: int = 0) -> None:
        """One step's drift back toward the prior of the positions from `start` on (those the step does not draft):
        RELAX of the gap, times `pace`. Else a position that did badly a few times stays where it was once drafts
        stop short of it: synthetic acceptance 0.8 on the gpt-oss-20b shape, replayed, kept 1-token drafts for
        a whole request after two rejections at the second position (its estimate 0.44)."""
        self.rates[start:] = [r + RELAX * pace * (PRIOR_ACCEPT - r) for r in self.rates[start:]]

    def observe(self, drafted: int, accepted: int) -> None:
        """Positions 0..accepted-1 were accepted, position `accepted` (if drafted) rejected."""
        reached = min(drafted, accepted + 1)
        if len(self.rates) < reached:
            self.rates += [PRIOR_ACCEPT] * (reached - len(self.rates))
        for i in range(reached):
            x = 1.0 if i < accepted else 0.0
            self.rates[i] += EMA * (x - self.rates[i])
