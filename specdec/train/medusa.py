"""`specdec train medusa`: Medusa-1 heads (specdec/models/medusa.py) trained on a feature cache
(specdec/train/data.py), the target frozen.

Row t of a conversation: the heads read h_t = norm(final[t]) (the target's final norm, as at inference); head k
(k = 1..K) learns token t+k+1. Labels: `soft` (default) = the target's distribution for that token,
softmax(norm(final[t+k]) @ its LM-head rows at the draft vocabulary), as `train.loop.Teacher` gives it;
`hard` = the data token. Only where token t+k+1 is a response token inside the draft vocabulary. The heads share
nothing, so their losses are summed unweighted (under Adam a per-head weight would only rescale its epsilon).
Validation on a held-out split: per-head top-1 accuracy against the data token (every response label counted),
greedy chain acceptance P(heads 1..k all right) and tau = 1 + sum_k of it, and the mean soft loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.medusa import MedusaConfig, MedusaHeads, save_heads
from specdec.paths import home
from specdec.train.data import FeatureCache
from specdec.train.loop import Batch, HeadTrainer, Loss, Segment, Teacher, TrainSettings, cut

LABELS = ("soft", "hard")


@dataclass(frozen=True)
class TrainConfig(TrainSettings):
    num_heads: int = 3
    num_layers: int = 1  # residual blocks per head
    labels: str = "soft"  # soft | hard
    epochs: int = 2
    lr: float = 1e-3
    warmup: float = 0.1
    clip: float = 1.0

    def check(self) -> None:
        super().check()
        if min(self.num_heads, self.num_layers) < 1:
            raise SpecdecError("heads and layers must be >= 1")
        if self.labels not in LABELS:
            raise SpecdecError(f"labels are {' | '.join(LABELS)}")


def default_out(target: str) -> Path:
    """Where `--spec-type medusa` looks first: $SPECDEC_HOME/heads/medusa-<target name>."""
    return home() / "heads" / f"medusa-{Path(target).name}"


def init_heads(target: nn.Module, ids: torch.Tensor, teacher: Teacher, cfg: TrainConfig) -> MedusaHeads:
    """Heads for the target over the vocabulary `ids`: blocks the identity, every LM head <- the target's rows."""
    c = target.config
    heads = MedusaHeads(MedusaConfig(cfg.num_heads, cfg.num_layers, c.hidden_size, c.vocab_size, len(ids)))
    heads.set_vocab(ids)
    heads.warm_start(teacher.rows)
    return heads


# -- batches -----------------------------------------------------------------------------------------------------


def segments(view: FeatureCache, num_heads: int, max_len: int) -> list[Segment]:
    """The view's conversations cut to `max_len`, pieces with no response label for any head left out."""
    out = []
    for i, row in enumerate(view.rows):
        mask = view[i]["loss_mask"]
        out += [s for s in cut(i, row.end - row.start, max_len) if mask[s.start + 2 : s.end + num_heads].any()]
    return out


@dataclass
class Rows:
    """A batch flattened: per segment, its rows followed by up to K + 1 rows past its end (labels only)."""

    final: torch.Tensor  # [M, H] the target's pre-norm final state
    tokens: torch.Tensor  # [M] long, data tokens
    label: torch.Tensor  # [M] bool, a response token
    draft: torch.Tensor  # [M] long, the token's draft-vocabulary index (-1 outside)
    source: torch.Tensor  # [M] bool, a row the heads read (inside its segment)
    end: torch.Tensor  # [M] long, where the row's window ends (exclusive, flat index)

    @property
    def real_tokens(self) -> int:
        return int(self.source.sum())

    def pairs(self, k: int, in_vocab: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(source rows i, label rows i + k + 2) for 0-based head k: the label a response token in the window
        (and in the draft vocabulary when `in_vocab`)."""
        i = torch.arange(len(self.tokens), device=self.tokens.device)
        j = (i + k + 2).clamp(max=len(i) - 1)
        ok = self.source & (i + k + 2 < self.end) & self.label[j]
        if in_vocab:
            ok &= self.draft[j] >= 0
        src = i[ok]
        return src, src + k + 2


def gather(view: FeatureCache, batch: Batch, num_heads: int, index: torch.Tensor, device: torch.device) -> Rows:
    """The rows of one batch on `device`; index [V] long (CPU): target id -> draft index, -1 outside."""
    parts: list[tuple[torch.Tensor, ...]] = []
    at = 0
    for row in batch:
        for s in row:
            item = view[s.conv]
            e = min(s.end + num_heads + 1, len(item["tokens"]))
            n, tokens = e - s.start, item["tokens"][s.start : e]
            source = torch.arange(n) < len(s)
            parts.append(
                (
                    item["final"][s.start : e],
                    tokens,
                    item["loss_mask"][s.start : e],
                    index[tokens],
                    source,
                    torch.full((n,), at + n),
                )
            )
            at += n
    return Rows(*(torch.cat(col).to(device) for col in zip(*parts)))


# -- losses and metrics ------------------------------------------------------------------------------------------


def head_losses(heads: MedusaHeads, teacher: Teacher, r: Rows, labels: str) -> list[torch.Tensor | None]:
    """Per head, the mean cross-entropy over its labels (None where it has none)."""
    x = teacher.norm(r.final.float())  # [M, H] the heads' input
    pairs = [r.pairs(k, in_vocab=True) for k in range(heads.config.num_heads)]
    if labels == "soft":  # the target's distribution of token u + 1 from row u, for the rows some label needs
        need = torch.zeros(len(x), dtype=torch.bool, device=x.device)
        for _, dst in pairs:
            need[dst - 1] = True
        slot = torch.full((len(x),), -1, dtype=torch.long, device=x.device)
        slot[need] = torch.arange(int(need.sum()), device=x.device)
        probs = teacher.probs(r.final[need])  # [n, Vd]
    out: list[torch.Tensor | None] = []
    for k, (src, dst) in enumerate(pairs):
        if not len(src):
            out.append(None)
            continue
        logp = heads.head(x[src], k).float().log_softmax(-1)  # [n_k, Vd]
        if labels == "soft":
            out.append(-(probs[slot[dst - 1]] * logp).sum(-1).mean())
        else:
            out.append(nn.functional.nll_loss(logp, r.draft[dst]))
    return out


@torch.no_grad()
def chain_hits(heads: MedusaHeads, teacher: Teacher, r: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Greedy chains on one batch: (rows whose heads 1..k all matched the data token [K], top-1 hits [K], labels per
    head [K], rows counted: those whose head-1 label is a response token)."""
    x = teacher.norm(r.final.float())
    K = heads.config.num_heads
    alive = torch.zeros(len(r.tokens), dtype=torch.bool, device=x.device)
    alive[r.pairs(0, in_vocab=False)[0]] = True
    counted = int(alive.sum())
    chain, hits, labels = (torch.zeros(K, dtype=torch.long) for _ in range(3))
    for k in range(K):
        src, dst = r.pairs(k, in_vocab=False)
        right = heads.token_map[heads.head(x[src], k).argmax(-1)] == r.tokens[dst]
        ok = torch.zeros_like(alive)
        ok[src[right]] = True
        alive &= ok
        chain[k], hits[k], labels[k] = int(alive.sum()), int(right.sum()), len(src)
    return chain, hits, labels, counted


# -- the run -----------------------------------------------------------------------------------------------------


class MedusaTrainer(HeadTrainer):
    """One training run: `MedusaTrainer(target, cache, out, cfg, resume).run()` -> the heads' manifest."""

    kind = "medusa"
    embed = False

    def build(self, model: nn.Module) -> MedusaHeads:
        heads = init_heads(model, self.vocab, self.teacher, self.cfg)
        self.index = torch.full((heads.config.vocab_size,), -1, dtype=torch.long)  # target id -> draft index
        self.index[self.vocab] = torch.arange(len(self.vocab))
        return heads

    def batches(self) -> tuple[list[list[Batch]], list[Batch]]:
        cfg = self.cfg
        return self.pack_epochs(
            segments(self.train_view, cfg.num_heads, cfg.max_len), segments(self.val_view, cfg.num_heads, cfg.max_len)
        )

    def _rows(self, view: FeatureCache, batch: Batch) -> Rows:
        return gather(view, batch, self.cfg.num_heads, self.index, self.device)

    def loss(self, batch: Batch) -> Loss:
        """The heads' summed loss (each head's gradient is its own loss's: they share nothing); shown: their mean."""
        r = self._rows(self.train_view, batch)
        losses = [x for x in head_losses(self.head, self.teacher, r, self.cfg.labels) if x is not None]
        shown = sum(float(x.detach()) for x in losses) / len(losses) if losses else float("nan")
        return Loss(sum(losses) if losses else None, {"loss": shown}, r.real_tokens)

    def evaluate(self) -> dict:
        """On the validation split: per-head top-1 accuracy, greedy chain acceptance per depth, tau, soft loss."""
        K = self.cfg.num_heads
        chain, hits, labels = (torch.zeros(K, dtype=torch.long) for _ in range(3))
        counted, loss, batches = 0, 0.0, 0
        for batch in self.val_batches:
            r = self._rows(self.val_view, batch)
            c, h, n, m = chain_hits(self.head, self.teacher, r)
            losses = [x for x in head_losses(self.head, self.teacher, r, "soft") if x is not None]
            chain, hits, labels, counted = chain + c, hits + h, labels + n, counted + m
            if losses:
                loss, batches = loss + float(sum(losses)) / len(losses), batches + 1
        accept = (chain.double() / max(counted, 1)).tolist()
        top1 = (hits.double() / labels.clamp(min=1)).tolist()
        return {
            "positions": counted,
            "heads": K,
            "top1": [round(a, 4) for a in top1],
            "accept": [round(a, 4) for a in accept],
            "tau": round(1 + sum(accept), 4),
            "loss": round(loss / max(batches, 1), 4),
        }

    def save_head(self, head: nn.Module, out: Path, manifest: dict) -> None:
        save_heads(head, out, manifest)

    def describe(self) -> dict:
        c = self.head.config
        return {
            "head": {
                "num_heads": c.num_heads,
                "num_layers": c.num_layers,
                "hidden_size": c.hidden_size,
                "warm_start": [
                    "blocks <- identity (zero weights and biases)",
                    "lm_heads <- target LM-head rows at token_map",
                ],
            },
            "training": {"labels": self.cfg.labels},
        }


def train(
    target: str,
    cache_dir: Path | str,
    out: Path | str | None = None,
    cfg: TrainConfig = TrainConfig(),
    resume: bool = False,
    command: str | None = None,
) -> dict:
    """Train (or continue, `resume`) Medusa heads for `target` on a feature cache; the heads, loadable by
    `--spec-type medusa`, go to `out` (default `default_out(target)`). Returns their manifest."""
    return MedusaTrainer(target, cache_dir, out or default_out(target), cfg, resume, command).run()
