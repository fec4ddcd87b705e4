"""`draft`: a smaller model with the same tokenizer proposes tokens one forward at a time.

With `branch_p` > 0 the proposal is a small tree: wherever the draft's largest probability is
below `branch_p`, its second choice (greedy, seeded) or a second independent sample (sampling)
is added as a sibling leaf, which costs no extra draft forward. Every cut (`p_min`, `branch_p`,
the adaptive `min_path_prob`) reads only what was known before the position's token was drawn.
"""
from __future__ import annotations

import time

import torch

from specdec.drafters.base import SETUP_TOKENS, Draft, Drafter, draft_distribution, draw
from specdec.drafters.registry import DrafterType, Option
from specdec.runtime.runner import ModelRunner
from specdec.sequence import Sequence


class DraftModelDrafter(Drafter):
    name = "draft"
    confidence_stop = True

    def __init__(self, runner: ModelRunner, target_vocab: int, p_min: float = 0.0, branch_p: float = 0.0):
        self.runner, self.target_vocab = runner, target_vocab
        self.p_min, self.branch_p = p_min, branch_p
        self.cached: dict[int, list[int]] = {}  # slot -> tokens whose K/V the draft cache holds, in order
        self.drafted_from: dict[int, int] = {}  # slot -> length of `cached` when the last draft began

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: drop or pad (with -inf) the padding rows."""
        v = logits.shape[-1]
        if v >= self.target_vocab:
            return logits[..., :self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        cached = self.cached.setdefault(seq.slot, [])
        n = len(cached)
        # Catch up on tokens the draft has not seen yet (prompt, accepted drafts, bonus token).
        t = time.perf_counter()
        logits = self.runner.prefill(seq.tokens[n:], seq.slot, start=n)
        setup_s = time.perf_counter() - t if len(seq.tokens) - n > SETUP_TOKENS else 0.0
        cached[n:] = seq.tokens[n:]
        self.drafted_from[seq.slot] = len(cached)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []  # per node, q it was drawn from (rejection sampling only)
        keep_q = not seq.params.greedy and not seq.seeded
        last = -1  # node index of the newest main-chain token
        depth = 0  # main-chain tokens so far
        path_prob = 1.0  # the draft's own estimate that the main chain so far is accepted
        while len(tokens) < max_tokens:
            logits = self._fit_vocab(logits)
            q = draft_distribution(logits, seq, self.p_min > 0 or self.branch_p > 0 or min_path_prob > 0)  # [V]
            top = 1.0 if q is None else float(q.max())
            # Whether to draft this position is decided before drawing its token (from q's largest
            # probability and the path so far): cutting on the drawn token would bias what is kept.
            if top < self.p_min or (tokens and path_prob * top < min_path_prob):
                break
            tok, sibling = draw(logits, q, seq, len(seq.tokens) + depth, top < self.branch_p)
            path_prob *= 1.0 if q is None else float(q[tok])
            tokens.append(tok)
            parents.append(last)
            parent, last, depth = last, len(tokens) - 1, depth + 1
            if sibling is not None and len(tokens) < max_tokens:
                tokens.append(sibling)
                parents.append(parent)
            if keep_q:
                probs += [q] * (len(parents) - len(probs))
            if len(tokens) >= max_tokens:
                break
            logits = self.runner.forward([[tok]], [len(cached)], [seq.slot])[0][-1]
            cached.append(tok)
        is_tree = any(p != i - 1 for i, p in enumerate(parents))
        return Draft(tokens, torch.stack(probs) if probs else None, parents if is_tree else None, setup_s)

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
        self.cached.pop(seq.slot, None)
        self.drafted_from.pop(seq.slot, None)


P_MIN = Option("draft_p_min", "--draft-p-min", 0.0, "draft, eagle3: stop drafting when the draft's largest "
               "probability at the next position falls below this (decided before drawing, so sampling stays "
               "lossless; default 0)", float, "in [0, 1]")
BRANCH_P = Option("draft_branch_p", "--draft-branch-p", 0.0, "draft model: where its largest probability is below "
                  "this, also propose its second choice (sampling: a second draw) as a sibling (a token tree "
                  "verified in one forward); 0 = chains only (default 0)", float, "in [0, 1]")
TYPES = (DrafterType("draft", lambda ctx: DraftModelDrafter(ctx.draft_runner(), ctx.target.vocab_size,
                                                            ctx.options["draft_p_min"], ctx.options["draft_branch_p"]),
                     "a smaller model with the target's tokenizer (-md)", (P_MIN, BRANCH_P), draft_model=True,
                     per_scope=False),)
