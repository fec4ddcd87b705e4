"""The speculative step loop: prefill, then draft -> verify in one target forward -> commit."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.engine.adaptive import CostModel, choose_draft_len
from specdec.engine.sequence import Sequence
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Detokenizer, Tokenizer
from specdec.runtime.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import chain, verify_tree_greedy, verify_tree_sampling

StreamCallback = Callable[[str], None]


@dataclass
class SpecConfig:
    draft_max: int = 16
    draft_min: int = 0
    adaptive: bool = True  # choose each step's draft length by expected tokens/s (engine/adaptive.py)


class Engine:
    """Generates for one sequence at a time through a target runner and an optional drafter."""

    def __init__(self, target: ModelRunner, tokenizer: Tokenizer, drafter: Drafter | None = None,
                 spec: SpecConfig | None = None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.spec = spec or SpecConfig()
        self.cost = CostModel()  # measured target/draft costs, shared by every sequence
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
        k_max = max(0, min(self.spec.draft_max, room))
        if not self.spec.adaptive or k_max == 0:
            return k_max
        if self.drafter.confidence_stop:
            # Draft one more token while its expected yield (the chance the path so far is accepted,
            # times the target forward it saves) beats what drafting it costs.
            known = self.cost.draft_s_per_token > 0 and self.cost.verify_s
            self.drafter.min_path_prob = self.cost.draft_s_per_token / self.cost.verify_cost(1) if known else 0.0
            return k_max
        k = choose_draft_len(self.cost, seq.acceptance, min(self.spec.draft_min, k_max), k_max)
        if k == 0:
            seq.acceptance.relax()
        return k

    def _step(self, seq: Sequence, detok: Detokenizer, on_text: StreamCallback | None) -> None:
        t0 = time.perf_counter()
        k = self._draft_len(seq) if self.drafter else 0
        draft = self.drafter.propose(seq, k) if k > 0 else Draft([])
        if len(draft.tokens) < self.spec.draft_min:
            draft = Draft([])
        t1 = time.perf_counter()
        inp = [seq.tokens[-1]] + draft.tokens
        parents = chain(len(draft.tokens)) if draft.parents is None else draft.parents
        if draft.parents is None:
            logits = self.target.forward([inp], [seq.last_position], [seq.slot])[0]  # [k+1, V]
        else:
            logits = self.target.verify_tree(seq.slot, seq.last_position, inp, parents)  # [N+1, V]
        if draft.forced is not None:  # synthetic drafter: acceptance decided by its rates (output not valid)
            seq.synthetic = True
            path = list(range(draft.forced))
            new = draft.tokens[:draft.forced] + [int(logits[draft.forced].argmax())]
        elif seq.params.greedy:
            new, path = verify_tree_greedy(draft.tokens, parents, logits)
        else:
            new, path = verify_tree_sampling(draft.tokens, parents, draft.probs, logits, seq.params, seq.generator)
        if draft.parents is not None:
            self.target.keep_path(seq.slot, seq.last_position, path)
            logits = logits[[0] + [i + 1 for i in path]]  # rows the committed tokens were chosen from
        t2 = time.perf_counter()
        seq.stats.draft_s += t1 - t0
        seq.stats.verify_s += t2 - t1
        depth = _depth(parents)
        seq.stats.record_step(k, len(draft.tokens), len(path), depth)
        self.cost.observe_verify(len(inp), t2 - t1)
        if draft.tokens:
            if seq.stats.target_forwards > 2:  # the first draft of a sequence includes the drafter's prefill
                self.cost.observe_draft(len(draft.tokens), t1 - t0)
            seq.acceptance.observe(depth, len(path))
        self._commit(seq, new, logits, detok, on_text)
        if self.drafter:
            self.drafter.update(seq, len(draft.tokens), len(path))

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


def _depth(parents: list[int]) -> int:
    """Depth of the deepest node of a tree given by parent indices (0 for no nodes)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 + (depth[p] if p >= 0 else 0))
    return max(depth, default=0)


def _find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Index where the earliest stop string that ends in the new text begins."""
    best = None
    for s in stops:
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
