"""`eagle3`: a trained EAGLE-3 head drafts from the target's own hidden states (specdec/models/eagle3.py).

The engine hands the drafter the target features of every committed token (`observe_features`); they are fused
(`fc`) and wait until the token after them is known. At `propose`, the waiting pairs (token[P+1], g[P]) are fed
into the head's one-layer KV cache at positions P, which also yields the first draft token; every further draft
token feeds (token, the previous step's pre-norm output) one position on. Draft-step entries past the committed
tokens are overwritten by the next feed (the cache is position-indexed, like the target's). Greedy and seeded
drafts take the head's best token; sampled drafts draw from q over the draft vocabulary (zero elsewhere).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specdec.drafters.base import SETUP_TOKENS, Draft, Drafter, draft_distribution, draw
from specdec.drafters.draft_model import P_MIN
from specdec.drafters.heads import find_head
from specdec.drafters.registry import BuildContext, DrafterType, Option
from specdec.errors import SpecdecError
from specdec.models.eagle3 import Eagle3Head, load_head
from specdec.models.transformer import Batch
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.runner import HEADROOM, Features, FeatureSpec, ModelRunner
from specdec.sequence import Sequence

class Eagle3Drafter(Drafter):
    name = "eagle3"
    confidence_stop = True

    def __init__(self, head: Eagle3Head, target: ModelRunner, p_min: float = 0.0):
        c = head.config
        self.head, self.embed, self.p_min = head, target.model.model.embed_tokens, p_min
        self.vocab = target.vocab_size
        self.features = FeatureSpec(tuple(c.aux_layers))
        dtype = head.fc.weight.dtype
        self.cache = KVCache.allocate(1, target.cache.num_slots, c.num_kv_heads, target.context + HEADROOM,
                                      c.head_dim, dtype, [head.fc.weight.device])
        self.owner: dict[int, Sequence] = {}           # slot -> the sequence its state belongs to
        self.waiting: dict[int, list[torch.Tensor]] = {}  # slot -> fused features [n, H] not yet fed
        self.fed: dict[int, int] = {}                  # slot -> positions whose pair is in the head's cache
        self.seen: dict[int, int] = {}                 # slot -> positions whose features arrived

    def _state(self, seq: Sequence) -> None:
        if self.owner.get(seq.slot) is not seq:
            self.owner[seq.slot], self.waiting[seq.slot] = seq, []
            self.fed[seq.slot] = self.seen[seq.slot] = 0

    @torch.inference_mode()
    def observe_features(self, seq: Sequence, feats: Features) -> None:
        self._state(seq)
        self.waiting[seq.slot].append(self.head.fuse(feats.layers))  # [n, H]
        self.seen[seq.slot] += len(feats)

    def _step(self, seq: Sequence, tokens: list[int], g: torch.Tensor, start: int):
        """Feed pairs (tokens[i], g[i]) at positions start.. -> (draft logits [Vd] and pre-norm h [1, H] of the
        last position)."""
        n = len(tokens)
        positions = torch.arange(start, start + n)[None]  # [1, n]
        cos, sin = self.head.rotary.tables(positions, g.dtype)
        mask = None
        if n > 1:
            mask = (torch.arange(start + n)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [1, 1, n, S]
        slots = torch.tensor([seq.slot])
        batch = Batch(slots, positions, cos, sin, mask, start + n, KVCache.span(slots, positions))
        emb = self.embed(torch.tensor([tokens])).to(g.dtype)  # [1, n, H]
        logits, h = self.head(emb, g[None], batch, self.cache)
        return logits[0, -1], h[0, -1:]

    def _full(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[Vd] -> [V] target-vocabulary logits, -inf outside the draft vocabulary."""
        out = draft_logits.new_full((self.vocab,), float("-inf"))
        out[self.head.draft_to_target] = draft_logits
        return out

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        self._state(seq)
        slot, start = seq.slot, self.fed[seq.slot]
        if not self.waiting[slot] or self.seen[slot] != len(seq.tokens) - 1:
            return Draft([])  # features of the committed tokens have not all arrived
        t = time.perf_counter()
        g = torch.cat(self.waiting[slot])  # [n, H] for positions start..
        logits, h = self._step(seq, seq.tokens[start + 1:], g, start)
        self.waiting[slot], self.fed[slot] = [], self.seen[slot]
        setup_s = time.perf_counter() - t if len(g) > SETUP_TOKENS else 0.0
        return self._draft(seq, logits, h, max_tokens, min_path_prob, setup_s)

    def _draft(self, seq: Sequence, logits: torch.Tensor, h: torch.Tensor, max_tokens: int, min_path_prob: float,
               setup_s: float) -> Draft:
        """A chain from the first draft position's logits [Vd] and pre-norm state h [1, H]."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        keep_q = not seq.params.greedy and not seq.seeded
        position, path_prob = len(seq.tokens) - 1, 1.0  # the position the next pair is fed at
        while len(tokens) < max_tokens:
            full = self._full(logits)
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
                logits, h = self._step(seq, [tok], h, position)
                position += 1
        return Draft(tokens, torch.stack(probs) if probs else None, setup_s=setup_s)

    def release(self, seq: Sequence) -> None:
        for d in (self.owner, self.waiting, self.fed, self.seen):
            d.pop(seq.slot, None)


def _build(ctx: BuildContext) -> Eagle3Drafter:
    choice = ctx.options["eagle3_head"]
    path = find_head(ctx.model, "eagle3", HEAD.flag) if choice == "auto" else Path(choice)
    target = ctx.target
    head = load_head(path, target.model.config.num_layers, target.model.model.norm.weight.dtype)
    if head.config.vocab_size != target.vocab_size or head.config.target_hidden_size != target.model.config.hidden_size:
        raise SpecdecError(f"EAGLE-3 head {path} was made for another target (vocabulary {head.config.vocab_size}, "
                           f"hidden {head.config.target_hidden_size})")
    return Eagle3Drafter(head, target, ctx.options["draft_p_min"])


HEAD = Option("eagle3_head", "--spec-eagle3-head", "auto", "eagle3: the head's directory (HF / SpecForge or "
              "speculators layout); auto = the head trained for the target (SPECDEC_HOME/heads, then shipped ones)",
              str)
TYPES = (DrafterType("eagle3", _build, "a trained EAGLE-3 head on the target's hidden states",
                     (HEAD, P_MIN), target_features=True, per_scope=False),)
