"""The drafter interface: `propose` a chain (or tree) of tokens, then hear back how many were accepted."""
from __future__ import annotations

from abc import ABC, abstractmethod

from specdec.runtime.runner import Features, FeatureSpec
from specdec.sequence import Draft, Sequence

__all__ = ["Draft", "Drafter"]


class Drafter(ABC):
    name: str = ""
    # A drafter that knows its own confidence stops drafting by itself once the chance that the whole draft
    # so far gets accepted falls below the `min_path_prob` it is given; the engine then asks for its budget.
    confidence_stop: bool = False
    # Target hidden states this drafter reads (trained heads, block drafters); None: none. The engine then
    # captures them on every target forward and hands over the rows of committed tokens (`observe_features`).
    features: FeatureSpec | None = None

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        """Up to `max_tokens` tokens continuing `seq.tokens`; the draft says how long it spent catching up
        on context it had not seen (`Draft.setup_s`)."""

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Feedback after verification (`seq.tokens` already holds the committed tokens)."""

    def observe_features(self, seq: Sequence, feats: Features) -> None:
        """Target features of tokens just committed, one row per token in sequence order, each token once:
        the prompt at prefill, then per step the last committed token and the accepted draft tokens (rejected
        draft rows never arrive; the bonus token's row comes with the next step)."""

    def release(self, seq: Sequence) -> None:
        """The sequence is finished; drop per-sequence state."""

    def reset(self) -> None:
        """Forget what was learned across requests (e.g. between benchmark repeats)."""
