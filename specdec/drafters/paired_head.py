"""The shared loop of drafters whose head reads (token, hidden state) pairs and recycles its own state: EAGLE-3
(`drafters/eagle3.py`) and MTP (`drafters/mtp.py`).

The engine hands the drafter the target features of every committed token (`observe_features`); the drafter turns
them into one state g per position (EAGLE-3: fused aux layers; MTP: the post-norm final state), and they wait until
the token after them is known. At `propose`, the waiting pairs (token[P+1], g[P]) are fed into the head's KV cache
at positions P, which also yields the first draft token; every further draft token feeds (token, the state the
previous step returned) one position on. Draft-step entries past the committed tokens are overwritten by the next
feed (the cache is position-indexed, like the target's). Greedy and seeded drafts take the head's best token; sampled
drafts draw from q (zero outside a reduced draft vocabulary). Where a draft ends is decided before each draw, from
the largest q and the path so far, so it never depends on the token drawn.
"""

from __future__ import annotations

import time
from abc import abstractmethod

import torch
from torch import nn

from specdec.drafters.base import SETUP_TOKENS, Draft, Drafter, draft_distribution, draw
from specdec.models.rope import Rotary
from specdec.models.transformer import Batch
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.runner import Features
from specdec.sequence import Sequence


class PairedHeadDrafter(Drafter):
    confidence_stop = True

    def __init__(self, embed: nn.Embedding, rotary: Rotary, cache: KVCache, vocab: int, p_min: float = 0.0):
        self.embed, self.rotary, self.cache, self.vocab, self.p_min = embed, rotary, cache, vocab, p_min
        self.device = cache.k[0].device  # the head's (the target's head device, `ModelRunner.head_device`)
        self.owner: dict[int, Sequence] = {}  # slot -> the sequence its state belongs to
        self.waiting: dict[int, list[torch.Tensor]] = {}  # slot -> states [n, H] not yet fed
        self.fed: dict[int, int] = {}  # slot -> positions whose pair is in the head's cache
        self.seen: dict[int, int] = {}  # slot -> positions whose features arrived

    @abstractmethod
    def state(self, feats: Features) -> torch.Tensor:
        """Target features of n committed tokens -> the head's input states g [n, H]."""

    @abstractmethod
    def run(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, depth: int | None):
        """emb, g [1, n, H] at the batch's positions -> (logits [1, n, V'] fp32, recycled state [1, n, H]).
        `depth`: the draft step (0 = the first draft token), None = committed pairs (catch-up)."""

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """[V'] head logits -> [V] target-vocabulary logits (a reduced vocabulary: -inf outside it)."""
        return logits

    def _state(self, seq: Sequence) -> None:
        if self.owner.get(seq.slot) is not seq:
            self.owner[seq.slot], self.waiting[seq.slot] = seq, []
            self.fed[seq.slot] = self.seen[seq.slot] = 0

    @torch.inference_mode()
    def observe_features(self, seq: Sequence, feats: Features) -> None:
        self._state(seq)
        self.waiting[seq.slot].append(self.state(feats.to(self.device)))  # [n, H]
        self.seen[seq.slot] += len(feats)

    def embed_ids(self, tokens: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        """The target's embeddings of token ids [1, n] (looked up where they sit) on the head's device [1, n, H]."""
        return self.embed(torch.tensor(tokens, device=self.embed.weight.device)).to(self.device, dtype)

    def _step(self, seq: Sequence, tokens: list[int], g: torch.Tensor, start: int, depth: int | None):
        """Feed pairs (tokens[i], g[i]) at positions start.. -> (logits [V'] on the CPU, like the target's, and
        state [1, H] of the last one)."""
        n = len(tokens)
        positions = torch.arange(start, start + n)[None]  # [1, n]
        cos, sin = self.rotary.tables(positions, g.dtype)
        mask = None
        if n > 1:
            mask = (torch.arange(start + n)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [1, 1, n, S]
        slots = torch.tensor([seq.slot])
        batch = Batch(slots, positions, cos, sin, mask, start + n, KVCache.span(slots, positions)).to(self.device)
        logits, h = self.run(self.embed_ids([tokens], g.dtype), g[None], batch, depth)
        return logits[0, -1].cpu(), h[0, -1:]

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        self._state(seq)
        slot, start = seq.slot, self.fed[seq.slot]
        if not self.waiting[slot] or self.seen[slot] != len(seq.tokens) - 1:
            return Draft([])  # features of the committed tokens have not all arrived
        t = time.perf_counter()
        g = torch.cat(self.waiting[slot])  # [n, H] for positions start..
        logits, h = self._step(seq, seq.tokens[start + 1 :], g, start, None)
        self.waiting[slot], self.fed[slot] = [], self.seen[slot]
        setup_s = time.perf_counter() - t if len(g) > SETUP_TOKENS else 0.0
        return self._draft(seq, logits, h, max_tokens, min_path_prob, setup_s)

    def _draft(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        h: torch.Tensor,
        max_tokens: int,
        min_path_prob: float,
        setup_s: float,
    ) -> Draft:
        """A chain from the first draft position's logits [V'] and recycled state h [1, H]."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        keep_q = not seq.params.greedy and not seq.seeded
        position, path_prob = len(seq.tokens) - 1, 1.0  # the position the next pair is fed at
        while len(tokens) < max_tokens:
            full = self.full(logits)
            q = draft_distribution(full, seq, self.p_min > 0 or min_path_prob > 0)  # [V] or None
            top = 1.0 if q is None else float(q.max())
            if top < self.p_min or (tokens and path_prob * top < min_path_prob):  # decided before drawing
                break
            tok, _ = draw(full, q, seq, position + 1, False)
            path_prob *= 1.0 if q is None else float(q[tok])
            tokens.append(tok)
            if keep_q:
                probs.append(q)
            if len(tokens) < max_tokens:
                logits, h = self._step(seq, [tok], h, position, len(tokens))
                position += 1
        return Draft(tokens, torch.stack(probs) if probs else None, setup_s=setup_s)

    def release(self, seq: Sequence) -> None:
        for d in (self.owner, self.waiting, self.fed, self.seen):
            d.pop(seq.slot, None)
