"""What the engine and the drafters share: a `Sequence` being generated and a `Draft` proposed for it.

A leaf module (it imports no engine or drafter code), so drafters and the engine both depend on it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable

import torch

from specdec.acceptance import AcceptanceEstimate
from specdec.sampling import SamplingParams
from specdec.stats import Stats

if TYPE_CHECKING:
    from specdec.drafters.base import Drafter
    from specdec.models.tokenizer import Detokenizer
    from specdec.runtime.prefix_cache import Block
    from specdec.trace import TokenTrace

StreamCallback = Callable[[str], None]


@dataclass
class Draft:
    """k draft tokens. A chain by default; with `parents`, a tree: node i continues node parents[i]
    (-1 = the last committed token), parents come before children, siblings are distinct tokens
    or independent samples from the same distribution."""
    tokens: list[int]                  # [k]
    probs: torch.Tensor | None = None  # [k, V] distributions the tokens were sampled from; None = one-hot
    parents: list[int] | None = None   # [k] tree structure; None = chain (parents[i] = i - 1)
    # Seconds of this `propose` spent catching up on a context the drafter had not seen (a new prompt): a
    # one-off per sequence that the cost model and the load controller count apart from drafting.
    setup_s: float = 0.0
    source: str | None = None  # which member of a chain drafted it (None: the sequence's drafter)
    # Seconds spent drafting it, where its drafter drafted several sequences in one call and can tell each one's
    # share (a chain: each member's call shared by that member's drafts); None: the engine shares the call's time.
    draft_s: float | None = None
    # A chain whose first layers the drafter already ran (early exit): the residual stream entering target layer
    # `resume_layer` for the verify's inputs [last committed token] + tokens, k + 1 rows, or the first k (no row
    # for the last token: the verify then checks every draft token but has no bonus token to add). The K/V of
    # layers below `resume_layer` for those inputs are in the target's cache already.
    resume: torch.Tensor | None = None  # [k or k + 1, H]
    resume_layer: int = 0

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path (the chain length for a chain)."""
        if self.parents is None:
            return len(self.tokens)
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 + (depth[p] if p >= 0 else 0))
        return max(depth, default=0)


@dataclass
class Sequence:
    tokens: list[int]          # prompt + committed output
    prompt_len: int
    slot: int                  # KV cache row
    params: SamplingParams
    generator: torch.Generator | None = None
    drafter: Drafter | None = None
    draft_max: int | None = None      # this sequence's cap on drafted tokens per step (None: the engine's)
    on_text: StreamCallback | None = None
    detok: Detokenizer | None = None
    stats: Stats = field(default_factory=Stats)
    prefilled: int = 0                # prompt tokens already in the target's KV cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None          # why this sequence failed (the others in its batch go on)
    text: str = ""                    # decoded output (stop strings cut off)
    streamed: int = 0                 # characters of `text` handed to on_text
    synthetic: bool = False           # a synthetic drafter forced acceptances: not the target's text
    accept_threshold: float = 0.0     # opt-in lossy relaxed acceptance (verify.Relaxed); 0 = lossless
    # per drafter judged apart (the sequence's drafter, or each member of its chain; `Drafter.parts`), by name
    acceptance: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    top2_gaps: list[float] = field(default_factory=list)  # per output token: target's top-1 minus top-2 logit
    # per output token, when asked for: the target's log-probability of it and its `top_logprobs` best
    # alternatives [(token, log-probability)], from the verification pass
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    top_logprobs: int = 0
    trace: list[TokenTrace] | None = None  # per output token, when asked for: where it came from (specdec/trace.py)
    started: float = 0.0              # perf_counter at admission
    cache_prompt: bool = True         # reuse and keep prompt K/V in the prefix cache (when the engine has one)
    cache_salt: Hashable = None       # prefix-cache scope: sequences see only K/V kept under the same salt
    cached_tokens: int = 0            # prompt tokens whose target K/V came from the prefix cache
    prefix_held: Block | None = None  # the target's prefix-cache block this sequence holds until it ends

    @property
    def lossless(self) -> bool:
        """Whether the output is the target's own (no synthetic drafts, no relaxed acceptance)."""
        return not self.synthetic and not self.accept_threshold

    def acceptance_of(self, drafter: str, history: AcceptanceEstimate | None = None) -> AcceptanceEstimate:
        """This sequence's acceptance of `drafter`'s drafts so far; before its first, the prior, or where given,
        `history.start()` (the drafter's acceptance over earlier sequences, no lower than the prior)."""
        if drafter not in self.acceptance:
            self.acceptance[drafter] = history.start() if history is not None else AcceptanceEstimate()
        return self.acceptance[drafter]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def last_position(self) -> int:
        """Position of the newest token: the one not yet in the target's KV cache."""
        return len(self.tokens) - 1

    @property
    def seeded(self) -> bool:
        """Seeded sampling: each token is a function of (seed, position), whatever drafted it."""
        return not self.params.greedy and self.params.seed is not None
