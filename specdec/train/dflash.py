"""Training DFlash and DSpark block drafters (specdec/models/dflash.py) on a frozen target, from a feature cache
(specdec/train/data.py), as SpecForge / speculators train them.

Per packed row, up to `anchors` anchor positions a are drawn among those whose next token is a response token of
the same conversation. Each anchor makes a block [token[a], MASK...] at positions a..a+B-1 whose queries see the
context states of their conversation strictly before a and their whole block. Draft i of a block (DFlash: slot
i + 1, DSpark: slot i) learns token[a+1+i] against the target's full-vocabulary distribution there (its LM head on
final[a+i]), soft-label cross-entropy weighted exp(-i / gamma), where that token is a response token of the same
conversation. DSpark adds its Markov bias teacher-forced on the data tokens (the anchor before draft 0) and a
confidence head trained with binary cross-entropy on each draft's acceptance rate 1 - TV(q, p) (q detached), same
weights, times `confidence_alpha`. The feature layers are the cache's; embeddings and LM head are the target's
(frozen, not stored); the final norm starts as the target's. Validation (conversations answered greedily): greedy
blocks drafted as the drafter does (the Markov bias from the previous draft), acceptance length against the data
tokens = the target's greedy choices; tau = 1 + its mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.dflash import BlockConfig, BlockDraft, save_speculators, save_zlab
from specdec.paths import home
from specdec.train.eagle3 import Eagle3Trainer, Packed, assemble
from specdec.train.loop import Batch, Loss, TrainSettings


@dataclass(frozen=True)
class TrainConfig(TrainSettings):
    draft_vocab: int | None = None  # the drafter shares the target's LM head: its whole vocabulary
    num_layers: int = 2  # draft layers
    block_size: int | None = None  # None: 8 for DFlash (7 drafts), 7 for DSpark (7 drafts)
    anchors: int = 32  # blocks per packed row
    gamma: float | None = None  # loss decay over draft positions; None: 7 for blocks of 16+, else 4
    mask_token: int | None = None  # None: the last vocabulary id
    markov_rank: int = 256  # DSpark
    confidence_alpha: float = 1.0  # DSpark
    intermediate: int | None = None  # the draft layers' MLP width; None = the target's
    epochs: int = 3
    lr: float = 6e-4
    warmup: float = 0.04
    clip: float = 1.0

    def check(self) -> None:
        if self.draft_vocab is not None:
            raise SpecdecError("--draft-vocab: a block drafter shares the target's LM head and its whole vocabulary")
        super().check()
        if min(self.num_layers, self.anchors, self.markov_rank, self.intermediate or 1) < 1 or (
            self.block_size is not None and self.block_size < 2
        ):
            raise SpecdecError("layers, anchors, Markov rank and intermediate must be >= 1, the block size >= 2")


def default_out(target: str, kind: str) -> Path:
    """Where `--spec-type dflash|dspark` looks for a trained drafter: $SPECDEC_HOME/heads/<kind>-<target name>."""
    return home() / "heads" / f"{kind}-{Path(target).name}"


@dataclass
class Blocks:
    """The anchored blocks of one packed row (n blocks of B slots, D drafts each)."""

    anchor: torch.Tensor  # [n] row index of each anchor
    label: torch.Tensor  # [n, D] row index of draft i's label token (a + 1 + i, clamped)
    valid: torch.Tensor  # [n, D] bool: that token is a response token of the anchor's conversation


def anchored(p: Packed, b: int, drafts: int, limit: int, generator: torch.Generator | None) -> Blocks:
    """Up to `limit` anchors of row b whose first label is valid (random with `generator`, else evenly spread)."""
    R = p.segment.shape[1]
    seg, resp = p.segment[b].cpu(), p.response[b].cpu()
    label = (torch.arange(R)[:, None] + 1 + torch.arange(drafts)).clamp(max=R - 1)  # [R, D]
    valid = (label < R) & (seg[label] == seg[:, None]) & resp[label] & (seg[:, None] >= 0)
    valid &= (torch.arange(R)[:, None] + 1 + torch.arange(drafts)) < R
    candidates = valid[:, 0].nonzero().flatten()
    if len(candidates) > limit:
        pick = (
            torch.randperm(len(candidates), generator=generator)[:limit]
            if generator is not None
            else torch.linspace(0, len(candidates) - 1, limit).long()
        )
        candidates = candidates[pick.sort().values]
    return Blocks(candidates, label[candidates], valid[candidates])


def block_states(net: BlockDraft, embed: nn.Embedding, p: Packed, b: int, blk: Blocks) -> torch.Tensor:
    """The draft slots' post-norm states [n, D, H] of row b's blocks."""
    c, B = net.config, net.config.block_size
    anchor = blk.anchor
    R, M, dev = p.segment.shape[1], len(anchor) * B, p.tokens.device
    seg = p.segment[b]
    tokens = torch.full((len(anchor), B), c.mask_token_id, device=dev)
    tokens[:, 0] = p.tokens[b, anchor.to(dev)]
    positions = (p.position[b, anchor.to(dev)][:, None] + torch.arange(B, device=dev)).reshape(1, M)
    a = anchor.to(dev).repeat_interleave(B)  # [M] each query's anchor
    ctx = (seg[None, :] == seg[a][:, None]) & (torch.arange(R, device=dev)[None, :] < a[:, None])  # [M, R]
    own = torch.arange(M, device=dev) // B
    mask = torch.cat([ctx, own[:, None] == own[None, :]], dim=1)[None, None]  # [1, 1, M, R + M]
    h = net.packed(net.context(p.aux[b])[None], p.position[b][None], embed(tokens.reshape(1, M)), positions, mask)
    return h[0].reshape(len(anchor), B, -1)[:, c.first_slot :]


class DFlashTrainer(Eagle3Trainer):
    """One training run: `DFlashTrainer(target, cache, out, cfg, resume).run()` -> the drafter's manifest. The
    target-argmax scan, segments and packed rows are EAGLE-3's (`train/eagle3.py`)."""

    kind = "dflash"
    betas = (0.9, 0.999)
    dspark = False

    @property
    def block(self) -> int:
        return self.cfg.block_size or (7 if self.dspark else 8)

    def build(self, model: nn.Module) -> BlockDraft:
        self.convs = self._targets(model)
        self.t2d = torch.ones(model.config.vocab_size, dtype=torch.bool)
        cfg, t = self.cfg, model.config
        c = BlockConfig.for_target(
            t,
            cfg.num_layers,
            self.block,
            t.vocab_size - 1 if cfg.mask_token is None else cfg.mask_token,
            self.dspark,
            cfg.markov_rank,
        )
        c = replace(
            c,
            feature_layers=self.cache.aux_layers,
            layer=replace(c.layer, intermediate_size=cfg.intermediate or t.intermediate_size),
        )
        net = BlockDraft(c)
        with torch.no_grad():
            net.norm.weight.copy_(self.teacher.norm.weight)  # warm start: the target's final norm
            if net.markov_head is not None:
                net.markov_head.markov_w1.weight.normal_(0, 0.01)
        return net

    @property
    def gamma(self) -> float:
        return self.cfg.gamma or (7.0 if self.block >= 16 else 4.0)

    def _packed(self, view, batch: Batch) -> Packed:
        return assemble(view, self.convs, batch, self.block, self.t2d, self.device)

    def _logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Draft states [n, D, H] and the tokens before each draft [n, D] -> logits [n, D, V] fp32 (Markov bias
        added)."""
        logits = (h @ self.teacher.rows.T.to(h.dtype)).float()
        return logits + self.head.markov_bias(prev) if self.head.markov_head is not None else logits

    def loss(self, batch: Batch) -> Loss:
        p = self._packed(self.train_view, batch)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.progress.step)
        total, weight_sum, shown = None, 0.0, {}
        D = self.head.config.drafts
        decay = torch.exp(-torch.arange(D, device=self.device) / self.gamma)  # [D]
        for b in range(p.tokens.shape[0]):
            blk = anchored(p, b, D, self.cfg.anchors, g)
            if not len(blk.anchor):
                continue
            h = block_states(self.head, self.teacher.embed, p, b, blk)  # [n, D, H]
            label = blk.label.to(self.device)
            prev = torch.cat([blk.anchor[:, None].to(self.device), label[:, :-1]], dim=1)  # [n, D] row indices
            logits = self._logits(h, p.tokens[b][prev])  # [n, D, V]
            target = self.teacher.probs(p.final[b][label - 1])  # [n, D, V] the target at a + i
            w = decay * blk.valid.to(self.device)  # [n, D]
            ce = -(target * logits.log_softmax(-1)).sum(-1)  # [n, D]
            loss = (ce * w).sum()
            if self.head.confidence_head is not None:
                accept = torch.minimum(logits.detach().softmax(-1), target).sum(-1)  # [n, D] 1 - TV(q, p)
                bce = F.binary_cross_entropy_with_logits(
                    self.head.confidence(h, p.tokens[b][prev]), accept, reduction="none"
                )
                loss = loss + self.cfg.confidence_alpha * (bce * w).sum()
            total, weight_sum = (loss if total is None else total + loss), weight_sum + float(blk.valid.sum())
        value = total / weight_sum if total is not None else None
        shown["loss"] = float("nan") if value is None else value.item()
        return Loss(value, shown, p.real_tokens)

    def evaluate(self) -> dict:
        """Greedy blocks on the validation split (anchors evenly spread, every draft's label valid): P(drafts 0..i
        accepted) per i, and tau."""
        D = self.head.config.drafts
        hits, counted = torch.zeros(D, dtype=torch.long), 0
        for batch in self.val_batches:
            p = self._packed(self.val_view, batch)
            for b in range(p.tokens.shape[0]):
                blk = anchored(p, b, D, self.cfg.anchors, None)
                full = blk.valid.all(-1)
                if not full.any():
                    continue
                blk = Blocks(blk.anchor[full], blk.label[full], blk.valid[full])
                h = block_states(self.head, self.teacher.embed, p, b, blk)
                run = self._greedy(h, p.tokens[b][blk.anchor.to(self.device)]) == p.tokens[b][blk.label.to(self.device)]
                hits += run.long().cumprod(-1).sum(0).cpu()
                counted += len(blk.anchor)
        accept = (hits.double() / max(counted, 1)).tolist()
        return {
            "blocks": counted,
            "drafts": D,
            "accept": [round(a, 4) for a in accept],
            "tau": round(1 + sum(accept), 4),
        }

    def _greedy(self, h: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The drafter's greedy blocks [n, D] from draft states h [n, D, H] after the anchors [n]."""
        prev, out = anchor, []
        for i in range(h.shape[1]):
            prev = self._logits(h[:, i : i + 1], prev[:, None])[:, 0].argmax(-1)
            out.append(prev)
        return torch.stack(out, dim=1)

    def save_head(self, head: nn.Module, out: Path, manifest: dict) -> None:
        if self.dspark:
            save_speculators(head, out, self.target, manifest)
        else:
            save_zlab(head, out, self.teacher_layers, manifest)

    @property
    def teacher_layers(self) -> int:
        return self.cache.manifest["target"]["num_layers"]

    def describe(self) -> dict:
        c = self.head.config
        return {
            "head": {
                "layers": c.layer.num_layers,
                "block_size": c.block_size,
                "drafts": c.drafts,
                "feature_layers": list(c.feature_layers),
                "mask_token_id": c.mask_token_id,
                "intermediate_size": c.layer.intermediate_size,
                "markov_rank": c.markov_rank,
                "confidence": c.confidence,
                "shared": ["embed_tokens and lm_head: the target's (not stored)"],
                "warm_start": ["norm <- target final norm"],
            },
            "training": {
                "anchors": self.cfg.anchors,
                "gamma": self.gamma,
                "loss_weights": [round(math.exp(-i / self.gamma), 4) for i in range(c.drafts)],
            },
        }


class DSparkTrainer(DFlashTrainer):
    kind = "dspark"
    dspark = True


def train(
    target: str,
    cache_dir: Path | str,
    out: Path | str | None = None,
    cfg: TrainConfig = TrainConfig(),
    resume: bool = False,
    command: str | None = None,
    kind: str = "dflash",
) -> dict:
    """Train (or continue, `resume`) a `kind` (dflash | dspark) block drafter for `target` on a feature cache; it
    goes to `out` (default `default_out(target, kind)`), loadable by `--spec-type kind`. Returns its manifest."""
    trainer = {"dflash": DFlashTrainer, "dspark": DSparkTrainer}[kind]
    return trainer(target, cache_dir, out or default_out(target, kind), cfg, resume, command).run()
