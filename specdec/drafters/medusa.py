"""`medusa`: Medusa-1 heads (specdec/models/medusa.py) draft from the target's final hidden state.

The engine hands over the target's pre-norm final state of every committed token; the drafter keeps the newest,
that of position P = len(seq.tokens) - 2 (the last token the target processed; token P + 1, already committed,
came from the target's own LM head). `propose` runs the heads once on target_norm(final[P]): head k's best token
guesses token P + k + 1, so the chain is the heads' top-1 tokens in order. With `--spec-medusa-topk N` > 1 it
drafts a token tree instead, grown best-first by path probability (the product of the head probabilities along
the path): every node at depth d - 1 may take head d's N best tokens as children. Drafts are deterministic (no
`Draft.probs`), verified like n-gram drafts: lossless at any temperature.
"""

from __future__ import annotations

import heapq
import itertools
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.heads import HEAD_QUANT, HeadShape, find_head, planned_memory, quantize_head, safetensors_params
from specdec.drafters.registry import BuildContext, DrafterType, HeadMemory, MemoryQuery, Option
from specdec.errors import SpecdecError
from specdec.models.medusa import MedusaHeads, load_heads
from specdec.runtime.runner import Features, FeatureSpec
from specdec.sequence import Sequence


class MedusaDrafter(Drafter):
    name = "medusa"
    confidence_stop = True
    features = FeatureSpec(())  # only the final state

    def __init__(self, heads: MedusaHeads, norm: nn.Module, topk: int = 1):
        self.heads, self.norm, self.topk = heads, norm, min(topk, heads.config.draft_vocab_size)
        self.owner: dict[int, Sequence] = {}  # slot -> the sequence its state belongs to
        self.final: dict[int, torch.Tensor] = {}  # slot -> the newest committed token's final state [H]
        self.seen: dict[int, int] = {}  # slot -> positions whose features arrived

    @torch.inference_mode()
    def observe_features(self, seq: Sequence, feats: Features) -> None:
        if self.owner.get(seq.slot) is not seq:
            self.owner[seq.slot], self.seen[seq.slot] = seq, 0
        self.final[seq.slot] = feats.final[-1].clone()  # not a view that keeps the whole batch alive
        self.seen[seq.slot] += len(feats)

    @torch.inference_mode()
    def head_probs(self, final: torch.Tensor) -> torch.Tensor:
        """A pre-norm final state [H] -> each head's distribution over the draft vocabulary [K, Vd]."""
        return self.heads(self.norm(final[None].to(self.norm.weight.device)))[0].softmax(-1)

    def propose(self, seq: Sequence, max_tokens: int, min_path_prob: float = 0.0) -> Draft:
        slot = seq.slot
        if self.owner.get(slot) is not seq or self.seen[slot] != len(seq.tokens) - 1 or max_tokens < 1:
            return Draft([])  # the features of the committed tokens have not all arrived
        top = self.head_probs(self.final[slot]).topk(self.topk, dim=-1)  # [K, N]
        probs, ids = top.values.tolist(), self.heads.token_map[top.indices].tolist()
        if self.topk == 1:
            return chain([p[0] for p in probs], [t[0] for t in ids], max_tokens, min_path_prob)
        return best_first_tree(probs, ids, max_tokens, min_path_prob)

    def release(self, seq: Sequence) -> None:
        for d in (self.owner, self.final, self.seen):
            d.pop(seq.slot, None)


def chain(probs: list[float], ids: list[int], max_tokens: int, min_path_prob: float) -> Draft:
    """Heads' best tokens `ids` [K] (probabilities `probs`) in order, while the path probability stays at least
    `min_path_prob` (the first token always)."""
    tokens: list[int] = []
    path_prob = 1.0
    for p, tok in zip(probs[:max_tokens], ids):
        path_prob *= p
        if tokens and path_prob < min_path_prob:
            break
        tokens.append(tok)
    return Draft(tokens)


def best_first_tree(probs: list[list[float]], ids: list[list[int]], max_nodes: int, min_path_prob: float) -> Draft:
    """A token tree of up to `max_nodes` nodes: repeatedly the candidate with the highest path probability (the
    first node always, then only while at least `min_path_prob`); the children candidates of a node at depth d - 1
    are head d's tokens `ids[d - 1]` [N] with probabilities `probs[d - 1]`. A single path comes out as a chain."""
    tokens: list[int] = []
    parents: list[int] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (-path probability, push order, parent, depth, token)
    order = itertools.count()  # equal probabilities: the earlier candidate first

    def push(parent: int, depth: int, prob: float) -> None:
        if depth < len(ids):
            for p, tok in zip(probs[depth], ids[depth]):
                heapq.heappush(heap, (-prob * p, next(order), parent, depth, tok))

    push(-1, 0, 1.0)
    while heap and len(tokens) < max_nodes:
        neg, _, parent, depth, tok = heapq.heappop(heap)
        if tokens and -neg < min_path_prob:
            break
        tokens.append(tok)
        parents.append(parent)
        push(len(tokens) - 1, depth + 1, -neg)
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return Draft(tokens, parents=None if is_chain else parents)


def head_path(options: Mapping[str, Any], model: str | None) -> Path:
    """--spec-medusa-head: a directory, or auto = the heads trained for the target."""
    choice = options["medusa_head"]
    return find_head(model, "medusa", HEAD.flag) if choice == "auto" else Path(choice)


def _memory(q: MemoryQuery) -> HeadMemory:
    """The heads' weights (no KV cache); without heads, `specdec train medusa`'s default: 3 heads of one block
    and a 16384-token LM head each."""
    estimate = HeadShape(3 * (q.hidden * q.hidden + q.hidden + 16384 * q.hidden))
    return planned_memory(
        q,
        "medusa",
        lambda: head_path(q.options, q.model),
        lambda path: HeadShape(safetensors_params(path)),
        lambda q: estimate,
    )


def _build(ctx: BuildContext) -> MedusaDrafter:
    path = head_path(ctx.options, ctx.model)
    target = ctx.target
    norm = target.model.model.norm
    heads = load_heads(path, norm.weight.dtype).to(target.head_device)
    c, t = heads.config, target.model.config
    if c.vocab_size != target.vocab_size or c.hidden_size != t.hidden_size:
        raise SpecdecError(
            f"Medusa head {path} was made for another target (vocabulary {c.vocab_size}, hidden "
            f"{c.hidden_size}; this target: {target.vocab_size}, {t.hidden_size})"
        )
    return MedusaDrafter(quantize_head(heads, ctx.options), norm, ctx.options["medusa_topk"])


HEAD = Option(
    "medusa_head",
    "--spec-medusa-head",
    "auto",
    "medusa: the heads' directory (vLLM or TGI layout); auto = "
    "the heads trained for the target (SPECDEC_HOME/heads, then shipped ones)",
    str,
)
TOPK = Option(
    "medusa_topk",
    "--spec-medusa-topk",
    1,
    "medusa: candidates per head; 1 = a chain of each head's best "
    "token, N > 1 = a token tree grown best-first by path probability (default 1)",
    int,
    ">= 1",
)
TYPES = (
    DrafterType(
        "medusa",
        _build,
        "trained Medusa-1 heads on the target's last hidden state",
        (HEAD, TOPK, HEAD_QUANT),
        target_features=True,
        per_scope=False,
        memory=_memory,
    ),
)
