"""What the engine and the drafters share: the `Drafter` interface, the `Draft` it proposes for a `Sequence`, the
`RequestOptions` a sequence runs with and the `TokenTrace` entries it may keep.

A leaf module (it imports no engine, drafter or server code), so the drafters, the engine and the server all depend
on it and it on none of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, TypeVar

import torch

from specdec.acceptance import AcceptanceEstimate
from specdec.sampling import SamplingParams
from specdec.stats import Stats

if TYPE_CHECKING:
    from specdec.constraint import Constraint, Grammar
    from specdec.models.tokenizer import Detokenizer
    from specdec.runtime.prefix_cache import Block
    from specdec.runtime.runner import Features, FeatureSpec

StreamCallback = Callable[[str], None]
# per part of a drafter, by name: (tokens to ask it for, path probability below which it stops by itself)
Budgets = dict[str, tuple[int, float]]
T = TypeVar("T")


@dataclass
class Draft:
    """k draft tokens. A chain by default; with `parents`, a tree: node i continues node parents[i]
    (-1 = the last committed token), parents come before children, siblings are distinct tokens
    or independent samples from the same distribution."""

    tokens: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, V] distributions the tokens were sampled from; None = one-hot
    parents: list[int] | None = None  # [k] tree structure; None = chain (parents[i] = i - 1)
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

    def paths(self) -> list[list[int]]:
        """The tokens leading to each verify row: [] (the last committed token's row), then node j's path."""
        paths: list[list[int]] = [[]]
        for j, t in enumerate(self.tokens):
            paths.append(paths[(j - 1 if self.parents is None else self.parents[j]) + 1] + [t])
        return paths

    def as_chain(self) -> Draft:
        """A chain the target verifies with a plain forward: a tree's path through each node's first child (drafters
        put the likeliest first); no `resume`. For targets with recurrent layers, whose state follows one sequence."""
        if self.parents is None:
            return replace(self, resume=None)
        keep: list[int] = []
        for j, p in enumerate(self.parents):
            if p == (keep[-1] if keep else -1):
                keep.append(j)
        return replace(self.subset(keep), parents=None)

    def subset(self, keep: list[int]) -> Draft:
        """The draft of nodes `keep` (ascending, each with its parent: a chain's first n), renumbered."""
        if self.parents is None:
            n = len(keep)
            extra = 0 if self.resume is None else len(self.resume) - len(self.tokens)
            resume = None if self.resume is None else self.resume[: n + extra]
            return replace(
                self, tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n], resume=resume
            )
        new = {old: i for i, old in enumerate(keep)}
        return replace(
            self,
            tokens=[self.tokens[j] for j in keep],
            probs=None if self.probs is None else self.probs[keep],
            parents=[new.get(self.parents[j], -1) for j in keep],
        )


@dataclass
class TokenTrace:
    """One committed output token (specdec/trace.py). origin: "draft" (an accepted draft token, `drafter` proposed
    it), or the target's own token: "correction" (a draft was rejected here; `rejected` holds what was drafted),
    "bonus" (the whole draft was accepted) or "target" (nothing was drafted this step; step 0 is the prefill)."""

    token: int
    origin: str
    step: int  # the target forward that chose it (0: prefill)
    pos: int  # 1-based position within its step (draft tokens first, then the target's)
    p: float  # the target's probability of it (raw model distribution, before temperature)
    gap: float  # the target's top-1 minus top-2 logit
    drafter: str | None = None
    rejected: list[int] = field(default_factory=list)
    drafted: int = 0  # on the target's token: draft tokens (tree nodes) its step proposed
    text: str = ""  # the text it added to the output ("" for the first bytes of a character)


class Drafter(ABC):
    """Proposes a chain (or tree) of tokens continuing a sequence, then hears back how many were accepted. Helpers
    for implementations (drawing a draft token, the setup threshold): specdec/drafters/base.py."""

    name: str = ""
    # A drafter that knows its own confidence stops drafting by itself once the chance that the whole draft
    # so far gets accepted falls below the `min_path_prob` it is given; the engine then asks for its budget.
    confidence_stop: bool = False
    # Target hidden states this drafter reads (trained heads, block drafters); None: none. The engine then
    # captures them on every target forward and hands over the rows of committed tokens (`observe_features`).
    features: FeatureSpec | None = None
    # A drafter that runs a model may draft several sequences in one call, its forwards batched over them:
    # it then sets this and implements `propose_batch(seqs, max_tokens, min_path_probs) -> list[Draft]`.
    batched: bool = False
    # A drafter that runs no model (look-ups in token statistics): its drafts cost next to nothing to make, so the
    # load controller may let only such parts draft under load (`Engine.step(light=True)`).
    model_free: bool = False

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        """Up to `max_tokens` tokens continuing `seq.tokens`; the draft says how long it spent catching up
        on context it had not seen (`Draft.setup_s`)."""

    def parts(self, seq: Sequence) -> list[Drafter]:
        """The drafters whose drafts the engine judges apart for `seq` (each its own cost per token, acceptance and
        draft length): a chain's members that may still draft for it; any other drafter is one part, itself."""
        return [self]

    def propose_parts(self, seqs: list[Sequence], budgets: list[Budgets]) -> list[Draft]:
        """A draft for each of `seqs`, whose budgets give each part (`parts`) by name the tokens to ask it for and
        the path probability below which it stops by itself; a part without one drafts nothing. One drafter: its
        own budget, all sequences in one call where it drafts in batches."""
        asks = [b.get(self.name, (0, 0.0)) for b in budgets]
        if self.batched:
            return self.propose_batch(seqs, [k for k, _ in asks], [p for _, p in asks])
        return [self.propose(s, k, p) if k > 0 else Draft([]) for s, (k, p) in zip(seqs, asks)]

    def pending_setup(self, seq: Sequence) -> int:
        """Tokens this drafter would first have to catch up on (its own prefill of a new prompt) before drafting
        for `seq`, when that is a one-off setup of more than `drafters.base.SETUP_TOKENS`; 0 otherwise. The engine
        drafts only where that setup is expected to be repaid (`engine.adaptive.expected_saving`)."""
        return 0

    def decline_setup(self, seq: Sequence) -> bool:
        """The engine judged the pending catch-up on `seq` not worth paying: True if this drafter can still draft
        for `seq` without it (a chain then leaves out the members that need one), False to draft nothing."""
        return False

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


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks for, declared once: built from an HTTP body (the server), `LLM.generate`'s keywords or
    CLI flags, and carried as it is through the scheduler's `Request` into its `Sequence`."""

    params: SamplingParams = field(default_factory=SamplingParams)  # sampling, max_tokens, stop strings, seed
    drafter: Drafter | None = None  # the drafter of its spec type or chain (None: no speculation)
    draft_max: int | None = None  # its cap on drafted tokens per step (None: the engine's)
    accept_threshold: float | None = None  # opt-in lossy relaxed acceptance (verify.Relaxed); None: the engine's
    logprobs: bool = False  # keep each output token's log-probability (`Sequence.logprobs`)
    top_logprobs: int = 0  # and that many best alternatives of each
    trace: bool = False  # keep each output token's origin (`Sequence.trace`)
    cache_prompt: bool = True  # reuse and keep prompt K/V in the prefix cache (when the engine has one)
    cache_salt: Hashable = None  # prefix-cache scope: sequences see only K/V kept under the same salt
    grammar: Grammar | None = None  # constrained decoding: what the output must match (specdec/constraint.py)

    @classmethod
    def of(
        cls, options: RequestOptions | SamplingParams, drafter: Drafter | None = None, **fields: Any
    ) -> RequestOptions:
        """`options` as they are; or, the short form of tests and tools, sampling parameters with a `drafter` and
        other fields by keyword."""
        if not isinstance(options, RequestOptions):
            return cls(options, drafter, **fields)
        if drafter is not None or fields:
            raise TypeError("give RequestOptions, or sampling parameters with the other options, not both")
        return options


@dataclass
class Sequence:
    """One request being generated: its tokens, the options it runs with and what the engine keeps on it."""

    tokens: list[int]  # prompt + committed output
    prompt_len: int
    slot: int  # KV cache row
    options: RequestOptions  # (sampling parameters alone: those, the other options' defaults)
    generator: torch.Generator | None = None
    on_text: StreamCallback | None = None
    detok: Detokenizer | None = None
    stats: Stats = field(default_factory=Stats)
    prefilled: int = 0  # prompt tokens already in the target's KV cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # why this sequence failed (the others in its batch go on)
    text: str = ""  # decoded output (stop strings cut off)
    streamed: int = 0  # characters of `text` handed to on_text
    synthetic: bool = False  # a synthetic drafter forced acceptances: not the target's text
    # per drafter judged apart (the sequence's drafter, or each member of its chain; `Drafter.parts`), by name
    acceptance: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    top2_gaps: list[float] = field(default_factory=list)  # per output token: target's top-1 minus top-2 logit
    # per output token, when the options ask for it: the target's log-probability of it and its `top_logprobs` best
    # alternatives [(token, log-probability)], from the verification pass
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = field(default=None, init=False)
    trace: list[TokenTrace] | None = field(default=None, init=False)  # per output token, when asked for
    started: float = 0.0  # perf_counter at admission
    cached_tokens: int = 0  # prompt tokens whose target K/V came from the prefix cache
    prefix_held: Block | None = None  # the target's prefix-cache block this sequence holds until it ends
    constraint: Constraint | None = None  # where the output is in `options.grammar`

    def __post_init__(self) -> None:
        self.options = RequestOptions.of(self.options)
        self.logprobs = [] if self.options.logprobs else None
        self.trace = [] if self.options.trace else None

    @property
    def params(self) -> SamplingParams:
        return self.options.params

    @property
    def drafter(self) -> Drafter | None:
        return self.options.drafter

    @property
    def cache_prompt(self) -> bool:
        return self.options.cache_prompt

    @property
    def cache_salt(self) -> Hashable:
        return self.options.cache_salt

    @property
    def lossless(self) -> bool:
        """Whether the output is the target's own (no synthetic drafts, no relaxed acceptance)."""
        return not self.synthetic and not self.options.accept_threshold

    def guarded(self, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args) for this sequence within a batch: a failure ends this sequence ("error", None), not the batch."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            self.error, self.finish_reason = f"{type(e).__name__}: {e}", "error"
            return None

    def acceptance_of(
        self, drafter: str, history: AcceptanceEstimate | None = None, pace: float = 1.0
    ) -> AcceptanceEstimate:
        """This sequence's acceptance of `drafter`'s drafts so far; before its first, the prior, or where given,
        `history.start(pace)` (the drafter's acceptance over earlier sequences, lifted toward the prior)."""
        if drafter not in self.acceptance:
            self.acceptance[drafter] = history.start(pace) if history is not None else AcceptanceEstimate()
        return self.acceptance[drafter]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def last_position(self) -> int:
        """Position of the newest token: the one not yet in the target's KV cache."""
        return len(self.tokens) - 1

    @property
    def seeded(self) -> bool:
        """Seeded sampling: each token is a function of (seed, position), whatever drafted it."""
        return not self.params.greedy and self.params.seed is not None
