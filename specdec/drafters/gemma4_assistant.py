"""`mtp` with a Gemma 4 assistant (`-md ASSISTANT_DIR`, specdec/models/gemma4_assistant.py): drafts from the
target's final-normed state of the last position it ran and the target's own K/V, every draft step at the position
of the last committed token. It keeps nothing per sequence but that state: no cache, no catch-up.

The drafting loop is `PairedHeadDrafter`'s (confidence stop, greedy / seeded / sampled draws); its head runs at one
position instead of feeding pairs.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Draft
from specdec.drafters.paired_head import PairedHeadDrafter
from specdec.models.gemma4_assistant import Gemma4Assistant
from specdec.models.transformer import Batch
from specdec.runtime.runner import Features, FeatureSpec, ModelRunner
from specdec.sequence import Sequence


class AssistantDrafter(PairedHeadDrafter):
    name = "mtp"
    features = FeatureSpec(())  # only the final state

    def __init__(self, assistant: Gemma4Assistant, target: ModelRunner, p_min: float = 0.0):
        assistant.attach(target.model.config)
        self.assistant, self.target = assistant, target
        super().__init__(target.model.model.embed_tokens, assistant.text.rotary, target.cache, target.vocab_size, p_min)

    def state(self, feats: Features) -> torch.Tensor:
        return self.target.model.model.norm(feats.final)  # [n, Hb] post-norm (HF hidden_states[N])

    @torch.inference_mode()
    def observe_features(self, seq: Sequence, feats: Features) -> None:
        self._state(seq)
        self.waiting[seq.slot] = [self.state(feats.rows([len(feats) - 1]))]  # the last position's is all a draft reads
        self.seen[seq.slot] += len(feats)

    def embed_ids(self, tokens: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return self.target.model.embed(torch.tensor(tokens)).to(dtype)  # scaled as the target's input

    def _step(self, seq: Sequence, tokens: list[int], g: torch.Tensor, start: int, depth: int | None):
        """Every step at the last committed token's position, whatever `start` the drafting loop counts."""
        return super()._step(seq, tokens, g, len(seq.tokens) - 1, depth)

    def run(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, depth: int | None):
        position, slot = int(batch.cache_index[0, 0]), int(batch.slots[0])
        logits, h = self.assistant(emb[0], g[0], position, slot, self.cache)
        return logits[None, None], h[None]

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        self._state(seq)
        if not self.waiting[seq.slot] or self.seen[seq.slot] != len(seq.tokens) - 1:
            return Draft([])  # the target has not run the tokens before the last one yet
        g = self.waiting[seq.slot][0]
        logits, h = self._step(seq, seq.tokens[-1:], g, 0, 0)
        return self._draft(seq, logits, h, max_tokens, min_path_prob, 0.0)
