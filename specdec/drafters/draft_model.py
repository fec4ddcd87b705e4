"""`draft`: a smaller model with the same tokenizer proposes tokens one forward at a time.

With `branch_p` > 0 the proposal is a small tree: wherever the draft's largest probability is
below `branch_p`, its second choice (greedy, seeded) or a second independent sample (sampling)
is added as a sibling leaf, which costs no extra draft forward. Every cut (`p_min`, `branch_p`,
the adaptive `min_path_prob`) reads only what was known before the position's token was drawn.

`propose_batch` drafts several sequences at once: their short catch-ups in one ragged forward, then one forward
per draft position over the sequences still drafting (the engine calls it for a step's sequences). With a
prefix cache (`ModelRunner.prefix`), a new prompt starts from the draft K/V of its longest cached prefix.

With `lookup` > 0 (chains), each drafting forward also feeds up to that many guessed tokens after the drawn one
(and the forward that catches up on a step's committed tokens, after the last of them):
what followed the context's last 3 tokens earlier in it (prompt lookup). Where the draft then draws the
guessed token, the logits after it are ready and its forward is saved; from the first token drawn otherwise on,
the guessed rows are dropped (length pointer). Every token is still drawn from the draft's own logits for its
position, so the draft is the same as without guesses; only its cost changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.drafters import cross_tokenizer
from specdec.drafters.base import SETUP_TOKENS, Draft, Drafter, draft_distribution, draw
from specdec.drafters.ngram_index import latest_continuation
from specdec.drafters.registry import BuildContext, DrafterType, Option
from specdec.errors import SpecdecError
from specdec.runtime.prefix_cache import Block
from specdec.runtime.runner import ModelRunner
from specdec.sequence import Sequence

GUESS_NGRAM = 3  # `lookup` guesses follow a match of the context's last this many tokens


@dataclass
class _Drafting:
    """One sequence's draft in progress: a main chain, with siblings where the draft is unsure."""

    seq: Sequence
    max_tokens: int
    min_path_prob: float
    logits: torch.Tensor | None = None  # [V_target] the draft's logits for the next position
    setup_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # per node, q it was drawn from (rejection sampling)
    last: int = -1  # node index of the newest main-chain token
    depth: int = 0  # main-chain tokens so far
    path_prob: float = 1.0  # the draft's own estimate that the main chain so far is accepted
    ahead: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (guessed token, [V_target] logits after it)

    def advance(self, p_min: float, branch_p: float) -> int | None:
        """Draw the next main-chain token (and maybe a sibling) from `logits`; return the token whose logits
        the next position needs, or None when the draft is done."""
        seq = self.seq
        if len(self.tokens) >= self.max_tokens:
            return None
        q = draft_distribution(self.logits, seq, p_min > 0 or branch_p > 0 or self.min_path_prob > 0)  # [V]
        top = 1.0 if q is None else float(q.max())
        # Whether to draft this position is decided before drawing its token (from q's largest
        # probability and the path so far): cutting on the drawn token would bias what is kept.
        if top < p_min or (self.tokens and self.path_prob * top < self.min_path_prob):
            return None
        tok, sibling = draw(self.logits, q, seq, len(seq.tokens) + self.depth, top < branch_p)
        self.path_prob *= 1.0 if q is None else float(q[tok])
        self.tokens.append(tok)
        self.parents.append(self.last)
        parent, self.last, self.depth = self.last, len(self.tokens) - 1, self.depth + 1
        if sibling is not None and len(self.tokens) < self.max_tokens:
            self.tokens.append(sibling)
            self.parents.append(parent)
        if not seq.params.greedy and not seq.seeded:
            self.probs += [q] * (len(self.parents) - len(self.probs))
        return tok if len(self.tokens) < self.max_tokens else None

    def draft(self) -> Draft:
        is_tree = any(p != i - 1 for i, p in enumerate(self.parents))
        return Draft(
            self.tokens,
            torch.stack(self.probs) if self.probs else None,
            self.parents if is_tree else None,
            self.setup_s,
        )


class DraftModelDrafter(Drafter):
    name = "draft"
    confidence_stop = True
    batched = True

    def __init__(
        self, runner: ModelRunner, target_vocab: int, p_min: float = 0.0, branch_p: float = 0.0, lookup: int = 0
    ):
        self.runner, self.target_vocab = runner, target_vocab
        self.p_min, self.branch_p = p_min, branch_p
        self.lookup = 0 if branch_p > 0 else lookup  # guessed tokens fed per drafting forward (chains only)
        self.reach: dict[int, int] = {}  # slot -> guessed tokens to feed next: 2 x the last guess's matches + 1
        self.cached: dict[int, list[int]] = {}  # slot -> tokens whose K/V the draft cache holds, in order
        self.drafted_from: dict[int, int] = {}  # slot -> length of `cached` when the last draft began
        self.held: dict[int, Block | None] = {}  # slot -> the prefix-cache block its sequence holds

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: drop or pad (with -inf) the padding rows."""
        v = logits.shape[-1]
        if v >= self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        return self.propose_batch([seq], [max_tokens], [min_path_prob])[0]

    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int], min_path_probs: list[float]) -> list[Draft]:
        """Drafts for several sequences (distinct slots), each draft-model forward one ragged batch over them."""
        states = [_Drafting(s, k, p) for s, k, p in zip(seqs, max_tokens, min_path_probs)]
        self._catch_up(states)
        feed = [(st, tok) for st, tok in ((st, self._advance(st)) for st in states) if tok is not None]
        while feed:
            slots = [st.seq.slot for st, _ in feed]
            chunks = [[tok, *self._guess(st)] for st, tok in feed]
            out = self.runner.forward(
                chunks,
                [len(self.cached[s]) for s in slots],
                slots,
                last_only=all(len(c) == 1 for c in chunks),
                settle=False,  # drafted tokens: a rejection rolls back to any of them
            )  # per sequence [T_i, V_draft]
            self._after_forward([st for st, _ in feed])
            for (st, tok), chunk, logits in zip(feed, chunks, out):
                self.cached[st.seq.slot].append(tok)
                st.logits = self._fit_vocab(logits[0])
                st.ahead = [(g, self._fit_vocab(row)) for g, row in zip(chunk[1:], logits[1:])]
            feed = [(st, tok) for st, tok in ((st, self._advance(st)) for st, _ in feed) if tok is not None]
        return [st.draft() for st in states]

    def _advance(self, st: _Drafting) -> int | None:
        """Draw the next token(s): on through the guessed rows while the draws match them; the token to feed next,
        or None when the draft is done."""
        tok, guessed, slot = st.advance(self.p_min, self.branch_p), len(st.ahead), st.seq.slot
        while tok is not None and st.ahead and st.ahead[0][0] == tok:
            self.cached[slot].append(tok)  # its K/V was written by the guessing forward
            st.logits = st.ahead.pop(0)[1]
            tok = st.advance(self.p_min, self.branch_p)
        if guessed:  # next time guess a little beyond what matched: a wrong guess costs its rows
            self.reach[slot] = min(self.lookup, 2 * (guessed - len(st.ahead)) + 1)
        st.ahead = []  # rows after a token drawn otherwise are stale (overwritten by the next forward)
        return tok

    def _guess(self, st: _Drafting) -> list[int]:
        """Up to `reach` tokens (no more than the draft can still use): what followed the context's last 3 tokens
        at their latest earlier occurrence (the context: the sequence and the draft so far). Shorter matches
        guessed new text wrongly too often to pay for their rows."""
        want = min(self.reach.get(st.seq.slot, self.lookup), st.max_tokens - len(st.tokens) - 1)
        if want <= 0:
            return []
        return latest_continuation(np.asarray(st.seq.tokens + st.tokens, dtype=np.int64), GUESS_NGRAM, want) or []

    def _catch_up(self, states: list[_Drafting]) -> None:
        """Feed each sequence's tokens the draft has not seen yet (prompt, accepted drafts, bonus token) and set
        its next-position logits: a new prompt alone (timed as setup, reusing the prefix cache), the short
        rests of running sequences in one ragged forward."""
        short = []
        for st in states:
            seq = st.seq
            if seq.slot in self.drafted_from:  # drafted again with no verdict in between (a retry): drop that draft
                self.update(seq, 0, 0)
            cached = self.cached.setdefault(seq.slot, [])
            if not cached:
                self._reuse_prefix(seq, cached)
            if len(seq.tokens) - len(cached) <= SETUP_TOKENS:
                short.append(st)
                continue
            t = time.perf_counter()
            n = len(cached)
            st.logits = self._fit_vocab(self.runner.prefill(seq.tokens[n:], seq.slot, start=n))
            cached[n:] = seq.tokens[n:]
            self._keep_prefix(seq)
            st.setup_s = time.perf_counter() - t
        if short:
            slots = [st.seq.slot for st in short]
            starts = [len(self.cached[s]) for s in slots]
            guesses = [self._guess(st) if self.lookup else [] for st in short]  # rows for the first drafted tokens
            out = self.runner.forward(
                [st.seq.tokens[n:] + g for st, n, g in zip(short, starts, guesses)],
                starts,
                slots,
                last_only=not any(guesses),
            )  # per sequence [1 or T_i, V_draft]
            self._after_forward(short)
            for st, g, logits in zip(short, guesses, out):
                self.cached[st.seq.slot][:] = st.seq.tokens
                st.logits = self._fit_vocab(logits[-1 - len(g)])
                st.ahead = [(t, self._fit_vocab(row)) for t, row in zip(g, logits[len(logits) - len(g) :])]
        for st in states:
            self.drafted_from[st.seq.slot] = len(self.cached[st.seq.slot])

    def _after_forward(self, states: list[_Drafting]) -> None:
        """The draft runner just ran one drafting forward over these sequences (in this order)."""

    def pending_setup(self, seq: Sequence) -> int:
        n = len(seq.tokens) - len(self.cached.get(seq.slot, []))
        return n if n > SETUP_TOKENS else 0

    def _reuse_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """A new sequence in this slot: start from the draft K/V of its longest cached prompt prefix."""
        store = self.runner.prefix
        if store is not None and seq.cache_prompt:
            n, self.held[seq.slot] = store.reuse(seq.slot, seq.tokens, seq.cache_salt)
            cached[:] = seq.tokens[:n]

    def _keep_prefix(self, seq: Sequence) -> None:
        """Keep the draft K/V of the tokens this slot holds in the prefix cache."""
        if self.runner.prefix is not None and seq.cache_prompt:
            self.runner.prefix.keep(seq.slot, self.cached.get(seq.slot, []), seq.cache_salt)

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        # Keep the cache entries whose tokens were committed; the rest is stale (length pointer back).
        # Only entries cached while drafting (from `drafted_from` on) can differ from the committed tokens;
        # in a chain the draft that was used may not be this drafter's.
        cached = self.cached.get(seq.slot, [])
        keep = min(len(cached), len(seq.tokens) - 1)
        for i in range(self.drafted_from.pop(seq.slot, keep), keep):
            if cached[i] != seq.tokens[i]:
                keep = i
                break
        del cached[keep:]

    def release(self, seq: Sequence) -> None:
        self._keep_prefix(seq)
        if self.runner.prefix is not None:
            self.runner.prefix.release(self.held.pop(seq.slot, None))
        self.cached.pop(seq.slot, None)
        self.drafted_from.pop(seq.slot, None)
        self.reach.pop(seq.slot, None)


P_MIN = Option(
    "draft_p_min",
    "--draft-p-min",
    0.0,
    "draft, eagle3: stop drafting when the draft's largest "
    "probability at the next position falls below this (decided before drawing, so sampling stays "
    "lossless; default 0)",
    float,
    "in [0, 1]",
)
BRANCH_P = Option(
    "draft_branch_p",
    "--draft-branch-p",
    0.0,
    "draft model: where its largest probability is below "
    "this, also propose its second choice (sampling: a second draw) as a sibling (a token tree "
    "verified in one forward); 0 = chains only (default 0)",
    float,
    "in [0, 1]",
)

LOOKUP = Option(
    "draft_lookup",
    "--draft-lookup",
    8,
    "draft model: feed up to N guessed tokens (prompt lookup: what "
    "followed the context's last 3 tokens earlier in it) after each drafted token in the same draft "
    "forward; where the draft draws them, their forwards are saved; the draft is unchanged (chains, same "
    "tokenizer; 0 = off, default 8)",
    int,
    ">= 0",
)
# `--draft-vocab auto`: larger vocabularies are cut to this many ids (the code edit with the 0.5B draft: 1.04-1.08x the
# whole head's tok/s; 32,768 lost there, 7 of its 192 output tokens lie above it)
AUTO_VOCAB = 65536
VOCAB = Option(
    "draft_vocab",
    "--draft-vocab",
    "auto",
    "draft model: compute its logits over the first N token ids "
    "only (BPE vocabularies list the most frequent merges first), so each drafted token reads N rows of its "
    "LM head instead of all; the target checks every token as before, so the output is unchanged; 0 = the "
    f"whole vocabulary; auto = {AUTO_VOCAB} where the vocabulary is larger (Qwen2.5, Llama 3), else all "
    "(default auto)",
    lambda t: t if t == "auto" else int(t),
    "auto or >= 0",
)


def head_rows(option: int | str, vocab: int) -> int:
    """`--draft-vocab`'s value for a draft of `vocab` ids -> the LM-head rows it computes (0 = all)."""
    if option == "auto":
        return AUTO_VOCAB if vocab > AUTO_VOCAB else 0
    return option


def build(ctx: BuildContext) -> Drafter:
    """The -md model's drafter; across tokenizers when its vocabulary differs from the target's."""
    runner, opts, tokenizers = ctx.draft_runner(), ctx.options, ctx.draft_tokenizers()
    if tokenizers is not None:
        if opts["draft_vocab"] not in (0, "auto"):
            raise SpecdecError("--draft-vocab is not supported with a draft model of another tokenizer")
        return cross_tokenizer.build(
            runner, tokenizers, ctx.target.vocab_size, opts["draft_p_min"], opts["draft_branch_p"]
        )
    runner.model.keep_head_rows(head_rows(opts["draft_vocab"], runner.vocab_size))
    return DraftModelDrafter(
        runner, ctx.target.vocab_size, opts["draft_p_min"], opts["draft_branch_p"], opts["draft_lookup"]
    )


TYPES = (
    DrafterType(
        "draft",
        build,
        "a smaller model (-md); with another tokenizer than the target's, through text",
        (P_MIN, BRANCH_P, VOCAB, LOOKUP),
        draft_model=True,
        per_scope=False,
    ),
)
