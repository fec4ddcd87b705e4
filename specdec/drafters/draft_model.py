"""`draft`: a smaller model with the same tokenizer proposes tokens one forward at a time."""
from __future__ import annotations

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.engine.sequence import Sequence
from specdec.runtime.runner import ModelRunner
from specdec.sampling import probs_from_logits, sample


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, runner: ModelRunner, target_vocab: int, p_min: float = 0.0):
        self.runner, self.target_vocab, self.p_min = runner, target_vocab, p_min
        self.cached: dict[int, int] = {}  # slot -> draft KV entries valid for seq.tokens[:n]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: drop or pad (with -inf) the padding rows."""
        v = logits.shape[-1]
        if v >= self.target_vocab:
            return logits[..., :self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, seq: Sequence, max_tokens: int) -> Draft:
        n = self.cached.get(seq.slot, 0)
        # Catch up on tokens the draft has not seen yet (prompt, accepted drafts, bonus token).
        logits = self.runner.prefill(seq.tokens[n:], seq.slot, start=n)
        pos = len(seq.tokens)
        tokens, probs = [], []
        while True:
            logits = self._fit_vocab(logits)
            if seq.params.greedy:
                tok = int(logits.argmax())
                conf = float(logits.softmax(-1)[tok]) if self.p_min > 0 else 1.0
            else:
                p = probs_from_logits(logits[None], seq.params)[0]
                tok = int(sample(p[None], seq.generator))
                conf = float(p[tok])
            if conf < self.p_min:
                break
            tokens.append(tok)
            if not seq.params.greedy:
                probs.append(p)
            if len(tokens) == max_tokens:
                break
            logits = self.runner.forward([[tok]], [pos + len(tokens) - 1], [seq.slot])[0][-1]
        # Fed so far: every committed token, and each draft that was followed by another forward.
        self.cached[seq.slot] = pos + (len(tokens) - (len(tokens) == max_tokens))
        return Draft(tokens, torch.stack(probs) if probs else None)

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        # Entries past the last committed-and-fed token are stale: move the pointer back.
        self.cached[seq.slot] = min(self.cached.get(seq.slot, 0), len(seq.tokens) - 1)

    def release(self, seq: Sequence) -> None:
        self.cached.pop(seq.slot, None)
