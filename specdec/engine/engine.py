"""The speculative step loop: prefill, then draft -> verify in one target forward -> commit."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.engine.sequence import Sequence
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Detokenizer, Tokenizer
from specdec.runtime.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import verify_greedy, verify_sampling

StreamCallback = Callable[[str], None]


@dataclass
class SpecConfig:
    draft_max: int = 16
    draft_min: int = 0


class Engine:
    """Generates for one sequence at a time through a target runner and an optional drafter."""

    def __init__(self, target: ModelRunner, tokenizer: Tokenizer, drafter: Drafter | None = None,
                 spec: SpecConfig | None = None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.spec = spec or SpecConfig()
        self.stop_ids = tokenizer.stop_ids(target.model.config.eos_token_ids)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_text: StreamCallback | None = None) -> Sequence:
        params.validate()
        context = self.target.context
        if not prompt_ids:
            raise SpecdecError("empty prompt")
        if len(prompt_ids) >= context:
            raise SpecdecError(f"prompt has {len(prompt_ids)} tokens but the context is {context} "
                               f"(at least one free position is needed; raise -c)")
        seq = Sequence(list(prompt_ids), len(prompt_ids), slot=0, params=params,
                       generator=None if params.greedy else params.generator())
        detok = Detokenizer(self.tokenizer)
        start = time.perf_counter()
        logits = self.target.prefill(seq.tokens, seq.slot)  # [V]
        seq.stats.prefill_s = time.perf_counter() - start
        seq.stats.target_forwards = 1
        self._commit(seq, [self._sample(logits[None], seq)], logits[None], detok, on_text)
        while seq.finish_reason is None:
            self._step(seq, detok, on_text)
        if self.drafter:
            self.drafter.release(seq)
        seq.stats.total_s = time.perf_counter() - start
        return seq

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        if seq.params.greedy:
            return int(logits[0].argmax())
        return int(sample(probs_from_logits(logits, seq.params), seq.generator)[0])

    def _draft_len(self, seq: Sequence) -> int:
        """Drafts that can still matter: room in the context and in max_tokens, less the bonus token."""
        room = min(self.target.context - len(seq.tokens), seq.params.max_tokens - len(seq.output_ids)) - 1
        return max(0, min(self.spec.draft_max, room))

    def _step(self, seq: Sequence, detok: Detokenizer, on_text: StreamCallback | None) -> None:
        t0 = time.perf_counter()
        k = self._draft_len(seq) if self.drafter else 0
        draft = self.drafter.propose(seq, k) if k > 0 else Draft([])
        if len(draft.tokens) < self.spec.draft_min:
            draft = Draft([])
        t1 = time.perf_counter()
        inp = [seq.tokens[-1]] + draft.tokens
        logits = self.target.forward([inp], [seq.last_position], [seq.slot])[0]  # [k+1, V]
        drafted = torch.tensor(draft.tokens, dtype=torch.long)
        if seq.params.greedy:
            new = verify_greedy(drafted, logits)
        else:
            new = verify_sampling(drafted, draft.probs, logits, seq.params, seq.generator)
        seq.stats.draft_s += t1 - t0
        seq.stats.verify_s += time.perf_counter() - t1
        seq.stats.record_step(len(draft.tokens), len(new) - 1)
        self._commit(seq, new, logits, detok, on_text)
        if self.drafter:
            self.drafter.update(seq, len(draft.tokens), len(new) - 1)

    def _commit(self, seq: Sequence, new: list[int], logits: torch.Tensor, detok: Detokenizer,
                on_text: StreamCallback | None) -> None:
        """Append verified tokens one by one, stopping at EOS, stop strings, max tokens or the context.

        logits [>= len(new), V]: row i is the target distribution token i was chosen from.
        """
        top2 = logits[:len(new)].topk(2, dim=-1).values  # [n, 2]
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        for tok, gap in zip(new, gaps):
            if tok in self.stop_ids:
                seq.finish_reason = "stop"
                break
            seq.tokens.append(tok)
            seq.top2_gaps.append(gap)
            seq.stats.new_tokens += 1
            delta = detok.push([tok])
            text = seq.text + delta
            cut = _find_stop(text, seq.params.stop, len(seq.text))
            if cut is not None:
                delta, seq.finish_reason = text[len(seq.text):cut], "stop"
                text = text[:cut]
            seq.text = text
            if delta and on_text:
                on_text(delta)
            if seq.finish_reason:
                break
            if len(seq.output_ids) >= seq.params.max_tokens or len(seq.tokens) >= self.target.context:
                seq.finish_reason = "length"
                break


def _find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Index where the earliest stop string that ends in the new text begins."""
    best = None
    for s in stops:
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
