"""`eagle3`: a trained EAGLE-3 head drafts from the target's own hidden states (specdec/models/eagle3.py).

The target features of every committed token are fused (`fc`) into the head's input state g; the feeding and the
chain (pairs (token[P+1], g[P]) at positions P, then each draft token with the previous step's pre-norm output)
are `PairedHeadDrafter`'s (drafters/paired_head.py). Sampled drafts draw from q over the draft vocabulary (zero
elsewhere).

With `--spec-eagle3-topk K` > 1 the draft is an EAGLE-2 dynamic token tree (drafters/tree.py) of up to
`--spec-eagle3-nodes` nodes instead: per depth the head runs once on the K best new nodes by path probability (those
whose children could still make the tree), each as the pair (its token, its parent's pre-norm output) at position
base + depth in cache row base + expansion order (base: the committed pairs), attending to the committed pairs and
its own ancestors; each offers the head's K best tokens as children (seeded: the best under the target's noise for
that position). Tree drafts are deterministic, verified one-hot: lossless at any temperature. The next feed
overwrites their cache rows, so the head's cache again holds exactly the committed pairs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from specdec.drafters.base import Draft, draft_distribution
from specdec.drafters.draft_model import P_MIN
from specdec.drafters.heads import (
    HEAD_QUANT,
    HeadShape,
    find_head,
    layer_params,
    planned_memory,
    quantize_head,
    safetensors_params,
)
from specdec.drafters.paired_head import PairedHeadDrafter
from specdec.drafters.registry import BuildContext, DrafterType, HeadMemory, MemoryQuery, Option
from specdec.drafters.tree import ROOT, DynamicTree
from specdec.errors import SpecdecError
from specdec.models.eagle3 import Eagle3Head, load_head
from specdec.models.transformer import Batch
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.runner import HEADROOM, Features, FeatureSpec, ModelRunner
from specdec.sampling import seeded_scores
from specdec.sequence import Sequence


class Eagle3Drafter(PairedHeadDrafter):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, target: ModelRunner, p_min: float = 0.0, topk: int = 1, nodes: int = 0):
        c = head.config
        self.head = head
        self.draft_ids = head.draft_to_target.cpu()  # [Vd] target id of each draft entry, where logits come back
        self.topk, self.nodes = min(topk, c.draft_vocab_size), nodes  # tree width (1: chains); node budget (0: any)
        self.features = FeatureSpec(tuple(c.aux_layers))
        cache = KVCache.allocate(
            1,
            target.cache.num_slots,
            c.num_kv_heads,
            target.context + HEADROOM,
            c.head_dim,
            head.dtype,
            [head.norm.weight.device],
        )
        super().__init__(target.model.model.embed_tokens, head.rotary, cache, target.vocab_size, p_min)

    def state(self, feats: Features) -> torch.Tensor:
        return self.head.fuse(feats.layers)  # [n, H]

    def run(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, depth: int | None):
        return self.head(emb, g, batch, self.cache)

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """[Vd] -> [V] target-vocabulary logits, -inf outside the draft vocabulary."""
        out = logits.new_full((self.vocab,), float("-inf"))
        out[self.draft_ids] = logits
        return out

    def _draft(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        h: torch.Tensor,
        max_tokens: int,
        min_path_prob: float,
        setup_s: float,
    ) -> Draft:
        """A chain (topk 1), else a tree, from the first draft position's logits [Vd] and pre-norm state h [1, H]."""
        if self.topk == 1:
            return super()._draft(seq, logits, h, max_tokens, min_path_prob, setup_s)
        budget = min(max_tokens, self.nodes or max_tokens)
        tokens, parents = self._tree(seq, logits, h[0], budget, min_path_prob).draft()
        return Draft(tokens, parents=parents, setup_s=setup_s)

    def _tree(
        self, seq: Sequence, logits: torch.Tensor, h: torch.Tensor, budget: int, min_path_prob: float
    ) -> DynamicTree:
        """An EAGLE-2 tree of up to `budget` nodes from the first draft position's logits [Vd] and pre-norm state
        h [H]: one head forward per depth over the nodes `DynamicTree.to_expand` picks."""
        tree = DynamicTree(budget, min_path_prob)
        outputs = {ROOT: h}  # expanded candidate -> its pre-norm output [H], its children's g
        frontier = [(ROOT, logits)]  # (expanded candidate, its logits [Vd])
        while frontier:
            layer = [c for node, lg in frontier for c in self._children(seq, tree, node, lg)]
            chosen = tree.to_expand(layer, self.topk)
            if not chosen:
                break
            lg, hs = self._feed(seq, tree, chosen, torch.stack([outputs[tree.parents[c]] for c in chosen]))
            outputs.update(zip(chosen, hs))
            frontier = list(zip(chosen, lg))
        return tree

    def _children(self, seq: Sequence, tree: DynamicTree, node: int, logits: torch.Tensor) -> list[int]:
        """Add the head's `topk` best continuations of `node` (its logits [Vd]) to the tree, none where its largest
        probability is below p_min -> the new candidates."""
        full = self.full(logits)  # [V]
        q = draft_distribution(full, seq, True)  # [V]: ranks the paths
        if float(q.max()) < self.p_min:
            return []
        position = len(seq.tokens) + (0 if node == ROOT else tree.depths[node] + 1)  # the children's tokens'
        scores = seeded_scores(full, seq.params, position) if seq.seeded else q
        ids = scores.topk(self.topk).indices  # [K]
        ids = ids[q[ids] > 0]
        return tree.add_children(node, ids.tolist(), q[ids].tolist())

    def _feed(self, seq: Sequence, tree: DynamicTree, chosen: list[int], g: torch.Tensor):
        """Run the head once on the chosen candidates (pairs: token, its parent's output g [m, H]) in their cache
        rows past the committed pairs, each attending to those and its own ancestors -> (logits [m, Vd], h [m, H])."""
        base = self.fed[seq.slot]  # committed pairs in the cache = the first draft pair's position
        end = base + len(tree.rows)
        mask = torch.zeros(len(chosen), end, dtype=torch.bool)  # [m, end]
        mask[:, :base] = True
        for i, c in enumerate(chosen):
            mask[i, [base + tree.rows[a] for a in tree.lineage(c)]] = True
        positions = torch.tensor([[base + tree.depths[c] for c in chosen]])  # [1, m]
        rows = torch.tensor([[base + tree.rows[c] for c in chosen]])  # [1, m], consecutive
        cos, sin = self.rotary.tables(positions, g.dtype)
        slots = torch.tensor([seq.slot])
        batch = Batch(slots, rows, cos, sin, mask[None, None], end, KVCache.span(slots, rows)).to(self.device)
        emb = self.embed_ids([[tree.tokens[c] for c in chosen]], g.dtype)  # [1, m, H]
        logits, h = self.run(emb, g[None], batch, tree.depths[chosen[0]] + 1)
        return logits[0].cpu(), h[0]


def head_path(options: Mapping[str, Any], model: str | None) -> Path:
    """--spec-eagle3-head: a directory, or auto = the head trained for the target."""
    choice = options["eagle3_head"]
    return find_head(model, "eagle3", HEAD.flag) if choice == "auto" else Path(choice)


def _shape(path: Path) -> HeadShape:
    """A head directory (HF / SpecForge or speculators layout): parameters and its one-layer KV cache."""
    d = json.loads((path / "config.json").read_text())
    layer = d.get("transformer_layer_config", d)
    kv_heads = layer.get("num_key_value_heads", layer["num_attention_heads"])
    return HeadShape(
        safetensors_params(path, lambda name: "embed_tokens" in name),
        1,
        kv_heads,
        layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
    )


def _estimate(q: MemoryQuery) -> HeadShape:
    """`specdec train eagle3`'s default head: fc over 3 features, one layer on [embedding; state], a 16384-token
    LM head."""
    H = q.hidden
    return HeadShape(3 * H * H + layer_params(q, 2 * H) + H + 16384 * (H + 1), 1, q.num_kv_heads, q.head_dim)


def _memory(q: MemoryQuery) -> HeadMemory:
    return planned_memory(q, "eagle3", lambda: head_path(q.options, q.model), _shape, _estimate)


def _build(ctx: BuildContext) -> Eagle3Drafter:
    path = head_path(ctx.options, ctx.model)
    target = ctx.target
    head = load_head(path, target.model.config.num_layers, target.model.model.norm.weight.dtype).to(target.head_device)
    if head.config.vocab_size != target.vocab_size or head.config.target_hidden_size != target.model.config.hidden_size:
        raise SpecdecError(
            f"EAGLE-3 head {path} was made for another target (vocabulary {head.config.vocab_size}, "
            f"hidden {head.config.target_hidden_size})"
        )
    return Eagle3Drafter(
        quantize_head(head, ctx.options),
        target,
        ctx.options["draft_p_min"],
        ctx.options["eagle3_topk"],
        ctx.options["eagle3_nodes"],
    )


HEAD = Option(
    "eagle3_head",
    "--spec-eagle3-head",
    "auto",
    "eagle3: the head's directory (HF / SpecForge or "
    "speculators layout); auto = the head trained for the target (SPECDEC_HOME/heads, then shipped ones)",
    str,
)
TOPK = Option(
    "eagle3_topk",
    "--spec-eagle3-topk",
    1,
    "eagle3: 1 = a chain of the head's best tokens; K > 1 = an "
    "EAGLE-2 dynamic token tree: per depth the K best new nodes by path probability each offer the head's "
    "K best tokens (one head forward per depth; default 1)",
    int,
    ">= 1",
)
NODES = Option(
    "eagle3_nodes",
    "--spec-eagle3-nodes",
    0,
    "eagle3 trees: at most this many nodes, the best by path probability; 0 = the engine's draft length (default 0)",
    int,
    ">= 0",
)
TYPES = (
    DrafterType(
        "eagle3",
        _build,
        "a trained EAGLE-3 head on the target's hidden states",
        (HEAD, P_MIN, TOPK, NODES, HEAD_QUANT),
        target_features=True,
        per_scope=False,
        memory=_memory,
    ),
)
