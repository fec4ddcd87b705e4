"""`specdec train mtp`: one MTP block (specdec/models/mtp.py) trained after the fact on a frozen target, from a
feature cache (specdec/train/data.py), as DeepSeek-V3's MTP loss and FastMTP train it.

Row t of a packed sequence feeds the pair (token[t+1], g[t]), g[t] = the target's post-norm final state, at RoPE
position t (causal within its segment): what the drafter feeds for committed tokens. The block's logits (through the
target's own LM head, shared and frozen) learn token[t+2]: soft labels = the target's full-vocabulary distribution
there, softmax(norm(final[t+1]) @ lm_head), only where token[t+2] is a response token. The drafter chains the
block on its own output; only its first step is trained here (the recursion is what EAGLE-3's training-time test
adds). Validation (conversations answered greedily): top-1 accuracy against the data token, the target's greedy
choice, which is the first draft token's acceptance; tau = 1 + it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.mtp import MtpConfig, MtpHead, save_head
from specdec.paths import home
from specdec.train.data import FeatureCache
from specdec.train.loop import Batch, HeadTrainer, Loss, Segment, TrainSettings, cut, segment_mask


@dataclass(frozen=True)
class TrainConfig(TrainSettings):
    draft_vocab: int | None = None  # the block shares the target's LM head: its whole vocabulary
    intermediate: int | None = None  # the block's MLP width; None = the target's
    epochs: int = 3
    lr: float = 3e-4

    def check(self) -> None:
        if self.draft_vocab is not None:
            raise SpecdecError("--draft-vocab: an MTP block shares the target's LM head and its whole vocabulary")
        super().check()
        if self.intermediate is not None and self.intermediate < 1:
            raise SpecdecError("--intermediate must be >= 1")


def default_out(target: str) -> Path:
    """Where `--spec-type mtp` looks for a trained block: $SPECDEC_HOME/heads/mtp-<target name>."""
    return home() / "heads" / f"mtp-{Path(target).name}"


class SharedHead(nn.Module):
    """The target's LM head from the teacher's rows (not a parameter of the block; moves with the teacher)."""

    def __init__(self, teacher: nn.Module):
        super().__init__()
        self.__dict__["teacher"] = teacher

    def __deepcopy__(self, memo: dict) -> SharedHead:
        return self  # the target's, never copied with the block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]"""
        return x @ self.teacher.rows.T.to(x.dtype)


@dataclass
class Row:
    """One packed row (R tokens, segments one after another)."""

    tokens: torch.Tensor  # [R + 1] long: data tokens, one past the row (0 there)
    final: torch.Tensor  # [R, H] the target's pre-norm final state
    segment: torch.Tensor  # [R] long, segment number
    position: torch.Tensor  # [R] long, position within the segment
    label: torch.Tensor  # [R] bool: token[t+2] is a response token of t's segment


def segments(view: FeatureCache, max_len: int, greedy: bool = False) -> list[Segment]:
    """The view's conversations (`greedy`: only those with greedy responses, when there are any) cut to `max_len`,
    pieces with no response token to predict left out."""
    rows = [(i, r) for i, r in enumerate(view.rows) if not (greedy and r.sampled)] or list(enumerate(view.rows))
    return [
        s for i, r in rows for s in cut(i, r.end - r.start, max_len) if view[i]["loss_mask"][s.start + 2 : s.end].any()
    ]


def assemble(view: FeatureCache, row: list[Segment], device: torch.device) -> Row:
    parts = []
    for number, s in enumerate(row):
        item = view[s.conv]
        n = len(s)
        response = item["loss_mask"][s.start : s.end]
        label = torch.zeros(n, dtype=torch.bool)
        label[:-2] = response[2:]
        parts.append(
            (
                item["tokens"][s.start : s.end],
                item["final"][s.start : s.end],
                torch.full((n,), number),
                torch.arange(n),
                label,
            )
        )
    tokens, final, segment, position, label = (torch.cat(col) for col in zip(*parts))
    tokens = torch.cat([tokens, tokens.new_zeros(1)])
    return Row(*(t.to(device) for t in (tokens, final, segment, position, label)))


class MtpTrainer(HeadTrainer):
    """One training run: `MtpTrainer(target, cache, out, cfg, resume).run()` -> the block's manifest."""

    kind = "mtp"

    def build(self, model: nn.Module) -> MtpHead:
        head = MtpHead(MtpConfig.for_target(model.config, self.cfg.intermediate))
        with torch.no_grad():
            head.blocks[0].norm.weight.copy_(self.teacher.norm.weight)  # warm start: the target's final norm
        return head.share(SharedHead(self.teacher))

    def batches(self) -> tuple[list[list[Batch]], list[Batch]]:
        return self.pack_epochs(
            segments(self.train_view, self.cfg.max_len), segments(self.val_view, self.cfg.max_len, greedy=True)
        )

    def _logits(self, r: Row) -> torch.Tensor:
        """The block's logits for every row of `r` [R, V] (fp32)."""
        emb = self.teacher.embed(r.tokens[1:])[None]  # [1, R, H] token[t+1]
        g = self.teacher.norm(r.final.float())[None]  # [1, R, H] post-norm state of t
        return self.head.packed(emb, g, r.position[None], segment_mask(r.segment[None]))[0][0]

    def loss(self, batch: Batch) -> Loss:
        total, n, tokens = None, 0, 0
        for row in batch:
            r = assemble(self.train_view, row, self.device)
            tokens += len(r.segment)
            at = r.label.nonzero().flatten()
            if not len(at):
                continue
            loss = F.cross_entropy(self._logits(r)[at], self.teacher.probs(r.final[at + 1]), reduction="sum")
            total, n = (loss if total is None else total + loss), n + len(at)
        value = total / n if total is not None else None
        return Loss(value, {"loss": float("nan") if value is None else value.item()}, tokens)

    def evaluate(self) -> dict:
        """Top-1 accuracy of the block against the data token on the greedy validation conversations; tau."""
        hits, counted = 0, 0
        for batch in self.val_batches:
            for row in batch:
                r = assemble(self.val_view, row, self.device)
                at = r.label.nonzero().flatten()
                if len(at):
                    hits += int((self._logits(r)[at].argmax(-1) == r.tokens[at + 2]).sum())
                    counted += len(at)
        accept = hits / max(counted, 1)
        return {"positions": counted, "accept": [round(accept, 4)], "tau": round(1 + accept, 4)}

    def save_head(self, head: nn.Module, out: Path, manifest: dict) -> None:
        save_head(head, out, self.target, manifest)

    def describe(self) -> dict:
        c = self.head.config
        return {
            "head": {
                "blocks": c.num_blocks,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.layer.intermediate_size,
                "shared": ["embed_tokens and lm_head: the target's (not stored)"],
                "warm_start": ["norm <- target final norm"],
            },
            "training": {"steps_trained": 1},
        }


def train(
    target: str,
    cache_dir: Path | str,
    out: Path | str | None = None,
    cfg: TrainConfig = TrainConfig(),
    resume: bool = False,
    command: str | None = None,
) -> dict:
    """Train (or continue, `resume`) a post-hoc MTP block for `target` on a feature cache; the block, loadable by
    `--spec-type mtp`, goes to `out` (default `default_out(target)`). Returns its manifest."""
    return MtpTrainer(target, cache_dir, out or default_out(target), cfg, resume, command).run()
