"""`early-exit`: self-speculation with the target's own first E layers, its final norm and its LM head
(transformers' `assistant_early_exit`, LayerSkip-style drafting without the LayerSkip training).

The draft model is a view of the target (`Transformer.first_layers`): no weights of its own, and no cache of its
own either. It runs on the target's KV cache (`ModelRunner.sharing_cache`), where the target has already written
every committed token but the newest, so a draft starts from that one token: no catch-up prefill, ever.

Nothing is computed twice. The draft's forwards over [newest committed token] + draft tokens write those tokens'
K/V of layers 0..E-1 where the target's own would go, and keep the residual stream they hand to layer E; a chain's
verify then starts at layer E from those rows (`Draft.resume`). The last draft token has no such row unless the
draft fed it on (a draft cut by confidence), so a verify whose every draft token is accepted usually adds no bonus
token: the next draft's forward over that token is its first E layers. Token trees (`--draft-branch-p`) are verified
by a whole forward.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdec.drafters.base import Draft
from specdec.drafters.draft_model import BRANCH_P, P_MIN, DraftModelDrafter
from specdec.drafters.registry import BuildContext, DrafterType, HeadMemory, MemoryQuery, Option
from specdec.errors import SpecdecError
from specdec.runtime.runner import FeatureSpec, ModelRunner
from specdec.sequence import Sequence


class EarlyExitDrafter(DraftModelDrafter):
    name = "early-exit"

    def __init__(self, runner: ModelRunner, target_vocab: int, p_min: float = 0.0, branch_p: float = 0.0):
        super().__init__(runner, target_vocab, p_min, branch_p)
        self.runner.capture = FeatureSpec()  # the residual stream leaving layer E - 1 (`Features.final`)
        self.rows: dict[int, list[torch.Tensor]] = {}  # slot -> [T, H] per forward of the draft in progress

    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int], min_path_probs: list[float]) -> list[Draft]:
        for seq in seqs:  # the shared cache holds the first E layers of every committed token but the newest
            self.cached[seq.slot], self.rows[seq.slot] = seq.tokens[:-1], []
        drafts = super().propose_batch(seqs, max_tokens, min_path_probs)
        return [self._resumable(d, self.rows.pop(s.slot)) for s, d in zip(seqs, drafts)]

    def _after_forward(self, states: list) -> None:
        for st, feats in zip(states, self.runner.features):
            self.rows[st.seq.slot].append(feats.final)

    def _resumable(self, draft: Draft, rows: list[torch.Tensor]) -> Draft:
        """A chain with the rows its verify starts from: [newest committed token] + draft tokens, k or k + 1."""
        if draft.parents is not None or not draft.tokens:
            return draft
        hidden = torch.cat(rows)[: len(draft.tokens) + 1]  # [k or k + 1, H]
        return replace(draft, resume=hidden, resume_layer=self.runner.model.config.num_layers)

    def pending_setup(self, seq: Sequence) -> int:
        """Never any: the target's forwards filled the shared cache."""
        return 0

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Nothing to roll back: the next `propose` starts again from what the target committed."""


def exit_layer(target: ModelRunner, chosen: int) -> int:
    """--spec-exit-layer, checked against the target's depth (0 = half of its layers)."""
    n = target.model.config.num_layers
    layer = chosen or max(1, n // 2)
    if not 1 <= layer < n:
        raise SpecdecError(f"--spec-exit-layer must be in 1..{n - 1} for this {n}-layer target (got {layer})")
    return layer


def planned_memory(q: MemoryQuery) -> HeadMemory:
    """For `specdec plan`: nothing of its own, and when drafting pays (a draft token reads E/N of the weights)."""
    from specdec.plan.speed import break_even_alpha

    layer = q.options["spec_exit_layer"] or max(1, q.num_layers // 2)
    cost = layer / q.num_layers
    return HeadMemory(
        {},
        f"early-exit at layer {layer} of {q.num_layers}: no weights or KV of its own (the target's "
        f"first layers on its cache); a draft token costs ~{cost:.2f} of a target forward, so one "
        f"draft token a step pays only above {break_even_alpha(cost, 1):.0%} acceptance, which "
        "targets not trained for early exit (LayerSkip) rarely reach: plan never recommends it "
        "(measured acceptance: docs/benchmarks.md)",
    )


def build(ctx: BuildContext) -> EarlyExitDrafter:
    target = ctx.target
    if target is None:
        raise SpecdecError("early-exit drafts with the target's own layers: it needs the target")
    layer = exit_layer(target, ctx.options["spec_exit_layer"])
    runner = target.sharing_cache(target.model.first_layers(layer))
    return EarlyExitDrafter(runner, target.vocab_size, ctx.options["draft_p_min"], ctx.options["draft_branch_p"])


EXIT_LAYER = Option(
    "spec_exit_layer",
    "--spec-exit-layer",
    0,
    "early-exit: draft with the target's first E layers, "
    "its final norm and LM head (0 = half of its layers; transformers' assistant_early_exit)",
    int,
    ">= 0",
)
TYPES = (
    DrafterType(
        "early-exit",
        build,
        "self-speculation: the target's own first layers draft (--spec-exit-layer)",
        (EXIT_LAYER, P_MIN, BRANCH_P),
        per_scope=False,
        target_layers=True,
        memory=planned_memory,
    ),
)
