"""`dflash`: a block draft network (specdec/models/dflash.py) drafts a whole block in one forward pass.

The engine hands over the target features of every committed token; each becomes a context state c that waits, as
in `PairedHeadDrafter` (drafters/paired_head.py), until `propose`. There the waiting states (positions fed..P-1, P
the last committed token, whose own features come with the next step) are injected into every draft layer's KV
cache, and the block [token P, MASK...] runs once at positions P..P+B-1: one logit row per draft slot. The chain is
then read off in order: a Markov head (DSpark checkpoints) adds its bias from the previous token (the anchor first),
a confidence head (DSpark) ends the block before a draft whose predicted acceptance is below the threshold
(`dspark`'s `--spec-dspark-threshold`; 0 = never), and the stopping rules of the other model drafters apply
(`--spec-draft-p-min`, the engine's path probability) - all decided before the token is drawn. Greedy and seeded
drafts take the best token; sampled drafts draw from q, the distribution of that position given the tokens drawn
before it, so the block verifies as an ordinary chain. The next injection overwrites the block's cache rows, so
the cache again holds exactly the committed context. The lengths of the blocks drafted are counted in
`block_lens` (length -> blocks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from specdec.drafters.base import Draft, draft_distribution, draw
from specdec.drafters.draft_model import P_MIN
from specdec.drafters.heads import HeadShape, find_head, layer_params, planned_memory, safetensors_params
from specdec.drafters.paired_head import PairedHeadDrafter
from specdec.drafters.registry import BuildContext, DrafterType, HeadMemory, MemoryQuery, Option
from specdec.errors import SpecdecError
from specdec.models.dflash import BlockDraft, default_features, load_block_drafter, read_config
from specdec.models.transformer import Batch
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.runner import HEADROOM, Features, FeatureSpec, ModelRunner
from specdec.sequence import Sequence


class DFlashDrafter(PairedHeadDrafter):
    name = "dflash"

    def __init__(self, net: BlockDraft, target: ModelRunner, p_min: float = 0.0, threshold: float = 0.0):
        c = net.config
        n = target.model.config.num_layers
        if any(not 0 <= i < n for i in c.feature_layers):
            raise SpecdecError(f"{c.kind} drafter reads target layers {c.feature_layers}: the target has {n}")
        if threshold > 0 and net.confidence_head is None:
            raise SpecdecError(f"this {c.kind} drafter has no confidence head (threshold {threshold})")
        self.net, self.threshold = net, threshold
        self.lm_head = target.model.lm_head
        self.features = FeatureSpec(c.feature_layers)
        self.block_lens: dict[int, int] = {}  # tokens drafted per block -> blocks
        cache = net.allocate_cache(target.cache.num_slots, target.context + c.block_size + HEADROOM)
        super().__init__(target.model.model.embed_tokens, net.rotary, cache, target.vocab_size, p_min)

    def state(self, feats: Features) -> torch.Tensor:
        return self.net.context(feats.layers)  # [n, H]

    def _step(self, seq: Sequence, tokens: list[int], g: torch.Tensor, start: int, depth: int | None):
        """The draft forward: context states g [n, H] of positions start..P-1 and the block [tokens[-1] (the anchor,
        position P = start + n), MASK...] -> (logits [D, V] fp32 of the D draft slots, before the Markov bias; their
        states [D, H])."""
        c = self.net.config
        anchor = start + len(tokens)
        positions = torch.arange(anchor, anchor + c.block_size)[None]  # [1, B]
        cos, sin = self.rotary.tables(positions, g.dtype)
        slots = torch.tensor([seq.slot])
        batch = Batch(slots, positions, cos, sin, None, anchor + c.block_size, KVCache.span(slots, positions)).to(
            self.device
        )
        block = [tokens[-1]] + [c.mask_token_id] * (c.block_size - 1)
        logits, h = self.run(self.embed_ids([block], g.dtype), g[None], batch, depth)
        return logits[0].cpu(), h[0]

    def run(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, depth: int | None):
        """Inject context g [1, n, H] just before the block, run the block emb [1, B, H] -> (logits [1, D, V] fp32,
        states [1, D, H]) of its draft slots."""
        n, first = g.shape[1], int(batch.cache_index[0, 0])
        ctx = torch.arange(first - n, first)[None]  # [1, n]
        cos, sin = self.rotary.tables(ctx, g.dtype)
        slots = batch.slots.cpu()
        self.net.inject(
            g, Batch(slots, ctx, cos, sin, None, first, KVCache.span(slots, ctx)).to(self.device), self.cache
        )
        h = self.net.block(emb, batch, self.cache)[:, self.net.config.first_slot :]  # [1, D, H]
        return self.lm_head(h).float(), h  # the network runs in the target's activation dtype

    def _draft(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        h: torch.Tensor,
        max_tokens: int,
        min_path_prob: float,
        setup_s: float,
    ) -> Draft:
        """The chain read off the block's logits [D, V] and states [D, H]."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        keep_q = not seq.params.greedy and not seq.seeded
        prev, path_prob = seq.tokens[-1], 1.0
        for k in range(min(max_tokens, len(logits))):
            if self.threshold > 0 and self._confidence(h[k], prev) < self.threshold:
                break
            full = logits[k] + self.net.markov_bias(torch.tensor(prev, device=self.device)).cpu()  # [V]
            q = draft_distribution(full, seq, self.p_min > 0 or min_path_prob > 0)  # [V] or None
            top = 1.0 if q is None else float(q.max())
            if top < self.p_min or (tokens and path_prob * top < min_path_prob):  # decided before drawing
                break
            prev, _ = draw(full, q, seq, len(seq.tokens) + k, False)
            path_prob *= 1.0 if q is None else float(q[prev])
            tokens.append(prev)
            if keep_q:
                probs.append(q)
        self.block_lens[len(tokens)] = self.block_lens.get(len(tokens), 0) + 1
        return Draft(tokens, torch.stack(probs) if probs else None, setup_s=setup_s)

    def _confidence(self, h: torch.Tensor, prev: int) -> float:
        """The confidence head's P(accepted) for a draft slot's state h [H] after token `prev`."""
        return float(torch.sigmoid(self.net.confidence(h, torch.tensor(prev, device=h.device))))


def head_path(options: Mapping[str, Any], model: str | None, kind: str, flag: str) -> Path:
    """The drafter's directory option, or auto = the one trained for the target."""
    choice = options[f"{kind}_head"]
    return find_head(model, kind, flag) if choice == "auto" else Path(choice)


def shape(path: Path) -> HeadShape:
    """A block drafter directory: parameters and its KV cache (one entry per draft layer)."""
    c = read_config(path).layer
    return HeadShape(
        safetensors_params(path, lambda name: name.startswith(("embed_tokens", "verifier_"))),
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
    )


def estimate(q: MemoryQuery, layers: int = 5, markov_rank: int = 0) -> HeadShape:
    """A default block drafter for the target: `layers` layers shaped like the target's, fc over one feature per
    layer (DFlash's default), a Markov head of `markov_rank` and a confidence head when DSpark."""
    H = q.hidden
    markov = markov_rank * 2 * q.vocab + H + markov_rank + 1 if markov_rank else 0
    return HeadShape(layers * H * H + layers * layer_params(q, H) + 2 * H + markov, layers, q.num_kv_heads, q.head_dim)


def build(
    ctx: BuildContext, kind: str, flag: str, threshold: float = 0.0, cls: type[DFlashDrafter] = DFlashDrafter
) -> DFlashDrafter:
    """A `kind` drafter (class `cls`) from the directory the options name, loaded in the target's dtype and device."""
    target = ctx.target
    path = head_path(ctx.options, ctx.model, kind, flag)
    net = load_block_drafter(path, target.model.model.norm.weight.dtype).to(target.head_device)
    L, t = net.config.layer, target.model.config
    if L.vocab_size != t.vocab_size or L.hidden_size != t.hidden_size:
        raise SpecdecError(
            f"{kind} drafter {path} was made for another target (vocabulary {L.vocab_size}, hidden "
            f"{L.hidden_size}; this target: {t.vocab_size}, {t.hidden_size})"
        )
    return cls(net, target, ctx.options["draft_p_min"], threshold)


HEAD = Option(
    "dflash_head",
    "--spec-dflash-head",
    "auto",
    "dflash: the drafter's directory (z-lab DFlash or "
    "speculators dflash layout); auto = the one trained for the target (SPECDEC_HOME/heads, then shipped "
    "ones)",
    str,
)


def _memory(q: MemoryQuery) -> HeadMemory:
    return planned_memory(
        q,
        "dflash",
        lambda: head_path(q.options, q.model, "dflash", HEAD.flag),
        shape,
        lambda m: estimate(m, len(default_features(m.num_layers, 5))),
    )


TYPES = (
    DrafterType(
        "dflash",
        lambda ctx: build(ctx, "dflash", HEAD.flag),
        "a DFlash block draft network on the target's hidden states: a block of drafts per forward",
        (HEAD, P_MIN),
        target_features=True,
        per_scope=False,
        memory=_memory,
    ),
)
