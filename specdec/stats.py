"""Per-call speculative decoding statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


def mean_accept_len(accepted: int, steps: int) -> float:
    """Tokens a verify step commits on average: the target's own token plus the drafted ones it accepted (vLLM's
    mean acceptance length), over `steps` verifying forwards; 1.0 without drafts. (Tokens per forward would count the
    prefill's forward and the forward whose token was the end-of-text, and fall below 1 with no drafter.)"""
    return 1.0 + accepted / steps if steps > 0 else 1.0


@dataclass
class Stats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill counts as one
    drafted: int = 0
    accepted: int = 0
    relaxed: int = 0  # of them, accepted only by the opt-in relaxed rule (--spec-accept-threshold)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    drafted_at: list[int] = field(default_factory=list)  # per draft depth: times drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft depth: times accepted
    chosen_lens: dict[int, int] = field(default_factory=dict)  # draft length asked for -> steps

    def record_step(self, chosen: int, drafted: int, accepted: int, depth: int) -> None:
        """One verify: `drafted` nodes (a chain or tree `depth` deep), `accepted` of them kept."""
        self.target_forwards += 1
        self.chosen_lens[chosen] = self.chosen_lens.get(chosen, 0) + 1
        self.drafted += drafted
        self.accepted += accepted
        grow = depth - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accept_len(self) -> float:
        return mean_accept_len(self.accepted, self.target_forwards - 1)  # the prefill's forward verifies nothing

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def to_dict(self) -> dict:
        r = lambda x: round(x, 4)  # noqa: E731
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "relaxed": self.relaxed,
            "acceptance_rate": r(self.acceptance_rate),
            "mean_accept_len": r(self.mean_accept_len),
            "tokens_per_s": r(self.tokens_per_s),
            "per_position_acceptance": [r(x) for x in self.per_position_acceptance],
            "chosen_draft_lens": dict(sorted(self.chosen_lens.items())),
            "prefill_s": r(self.prefill_s),
            "draft_s": r(self.draft_s),
            "verify_s": r(self.verify_s),
            "total_s": r(self.total_s),
        }


def first_divergence(base: list[int], base_gaps: list[float], other: list[int]) -> dict | None:
    """Where `other` first differs from the plain run `base`, with the plain run's top-2 logit gap there.

    In bf16 a divergence at a near-tie (small gap) is rounding; anywhere else it is a bug.
    """
    for i, (a, b) in enumerate(zip(base, other)):
        if a != b:
            return {"index": i, "top2_gap": round(base_gaps[i], 4)}
    if len(base) != len(other):
        i = min(len(base), len(other))
        return {"index": i, "top2_gap": round(base_gaps[i], 4) if i < len(base_gaps) else None}
    return None
