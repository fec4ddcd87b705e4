"""`specdec train eagle3`: an EAGLE-3 head (specdec/models/eagle3.py) trained on a feature cache
(specdec/train/data.py) with training-time test (TTT), as EAGLE-3 / SpecForge train it.

For row t of a packed sequence (data token[t], the target's aux[t] and final[t]):
- step 0 feeds (token[t+1], g[t] = fc(aux[t])) at RoPE position t with causal attention (within its segment),
  exactly the pairs the drafter feeds for committed tokens;
- step j >= 1 feeds (token[t+1+j], h_{j-1}[t]) at position t + j, h_{j-1} the previous step's pre-norm output;
  row t attends to the step-0 keys <= t and to its own keys of steps 1..j: what the drafter's cache holds when it
  drafts j tokens ahead (SpecForge's `cache_hidden`);
- step j predicts token[t+2+j]. Soft labels: the target's distribution from norm(final[t+1+j]) through its
  LM-head rows at the draft vocabulary (renormalised over it); weight 0.8**j; only where token[t+2+j] is a
  response token and the target's full-vocabulary argmax there lies in the draft vocabulary.
Validation (conversations answered greedily): per-step greedy acceptance (step j counts only if the head's argmax
matched the data token, the target's greedy one, at steps 0..j) and the mean acceptance length
tau = 1 + sum_j P(steps 0..j accepted).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_head
from specdec.paths import home
from specdec.train.data import FeatureCache
from specdec.train.loop import Batch, HeadTrainer, Loss, Segment, Teacher, TrainSettings, cut, save_atomic, segment_mask

STEP_WEIGHT = 0.8  # loss weight of TTT step j: STEP_WEIGHT ** j


@dataclass(frozen=True)
class TrainConfig(TrainSettings):
    intermediate: int | None = None  # the head's MLP width; None = the target's
    ttt: int = 7  # unrolled steps (training-time test)

    def check(self) -> None:
        super().check()
        if self.ttt < 1 or (self.intermediate is not None and self.intermediate < 1):
            raise SpecdecError("TTT steps and --intermediate must be >= 1")


def default_out(target: str) -> Path:
    """Where `--spec-type eagle3` looks first: $SPECDEC_HOME/heads/eagle3-<target name>."""
    return home() / "heads" / f"eagle3-{Path(target).name}"


# -- the head ----------------------------------------------------------------------------------------------------


def init_head(
    target: nn.Module, ids: torch.Tensor, teacher: Teacher, intermediate: int | None, aux_layers: tuple[int, ...]
) -> Eagle3Head:
    """A head shaped for the target, vocabulary `ids`, warm-started: lm_head <- the target's rows at `ids`,
    norm <- the target's final norm."""
    head = Eagle3Head(Eagle3Config.for_target(target.config, len(ids), intermediate, aux_layers))
    head.set_vocab(ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher.rows)
        head.norm.weight.copy_(teacher.norm.weight)
    return head


# -- what each conversation teaches ------------------------------------------------------------------------------


@dataclass
class Conv:
    """One conversation's labels beyond its tokens."""

    response: torch.Tensor  # bool [T]: response tokens (the loss mask)
    argmax: torch.Tensor  # long [T]: the target's greedy token for position n (from final[n-1]); -1 off the response


@torch.inference_mode()
def scan(target: nn.Module, cache: FeatureCache, progress: bool) -> dict[int, Conv]:
    """The target's full-vocabulary argmax at every response position of the cache, by prompt index."""
    from tqdm import tqdm

    out: dict[int, Conv] = {}
    for item in tqdm(
        cache,
        total=len(cache),
        unit="conv",
        desc="target argmax",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not progress,
    ):
        response = item["loss_mask"]
        argmax = torch.full(response.shape, -1, dtype=torch.long)
        at = response.nonzero().flatten()
        at = at[at > 0]
        if len(at):
            logits = target.logits(target.model.norm(item["final"][at - 1].float()))  # [n, V]
            argmax[at] = logits.argmax(-1)
        out[item["index"]] = Conv(response, argmax)
    return out


def segments(view: FeatureCache, convs: dict[int, Conv], max_len: int, greedy: bool = False) -> list[Segment]:
    """The view's conversations (`greedy`: only those with greedy responses, when there are any) cut to `max_len`,
    pieces with no response token to predict left out."""
    rows = list(enumerate(view.rows))
    if greedy:
        rows = [(i, r) for i, r in rows if not r.sampled] or rows
    return [
        s
        for i, row in rows
        for s in cut(i, row.end - row.start, max_len)
        if convs[row.index].response[s.start + 2 : s.end].any()
    ]


# -- packed batches and the unrolled steps -----------------------------------------------------------------------


@dataclass
class Packed:
    """A batch of rows, segments laid one after another (R = the longest row; S = steps)."""

    tokens: torch.Tensor  # [B, R + S] long, data tokens (0 past a row's end)
    aux: torch.Tensor  # [B, R, L, Ht] the target's features
    final: torch.Tensor  # [B, R, Ht] the target's pre-norm final state
    segment: torch.Tensor  # [B, R] long, segment number (-1 past a row's end)
    position: torch.Tensor  # [B, R] long, position within the segment
    response: torch.Tensor  # [B, R] bool, a response token
    trainable: torch.Tensor  # [B, R] bool, a response token whose target argmax is in the draft vocabulary

    @property
    def real_tokens(self) -> int:
        return int((self.segment >= 0).sum())


def assemble(
    view: FeatureCache, convs: dict[int, Conv], batch: Batch, steps: int, t2d: torch.Tensor, device: torch.device
) -> Packed:
    """The tensors of one batch of rows, on `device`; t2d [V] bool (CPU): the draft vocabulary."""
    B, R = len(batch), max(sum(map(len, row)) for row in batch)
    hidden = view.manifest["features"]["hidden_size"]
    tokens = torch.zeros(B, R + steps, dtype=torch.long)
    aux = torch.zeros(B, R, len(view.aux_layers), hidden, dtype=torch.bfloat16)
    final = torch.zeros(B, R, hidden, dtype=torch.bfloat16)
    segment = torch.full((B, R), -1, dtype=torch.long)
    position = torch.zeros(B, R, dtype=torch.long)
    response = torch.zeros(B, R, dtype=torch.bool)
    trainable = torch.zeros(B, R, dtype=torch.bool)
    number = 0
    for b, row in enumerate(batch):
        at = 0
        for s in row:
            item = view[s.conv]
            conv, span, n = convs[item["index"]], slice(s.start, s.end), len(s)
            tokens[b, at : at + n] = item["tokens"][span]
            aux[b, at : at + n] = item["aux"][span]
            final[b, at : at + n] = item["final"][span]
            segment[b, at : at + n], position[b, at : at + n] = number, torch.arange(n)
            response[b, at : at + n] = conv.response[span]
            trainable[b, at : at + n] = conv.response[span] & t2d[conv.argmax[span].clamp(min=0)]
            at, number = at + n, number + 1
    move = lambda t: t.to(device)  # noqa: E731
    return Packed(*map(move, (tokens, aux, final, segment, position, response, trainable)))


def reach(p: Packed, j: int, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] bool: rows t whose step-j label token[t + 2 + j] lies in t's segment and is marked in `mask` [B, R]."""
    k = 2 + j
    out = torch.zeros_like(mask)
    out[:, :-k] = mask[:, k:] & (p.segment[:, k:] == p.segment[:, :-k])
    return out


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    mask0: torch.Tensor,
    kd: list[torch.Tensor],
    vd: list[torch.Tensor],
) -> torch.Tensor:
    """Attention of TTT step j = len(kd): row t attends to the step-0 keys `mask0` allows and to the keys of steps
    1..j at row t itself. q [B, heads, R, hd]; k0, v0 and kd[i], vd[i] [B, kv_heads, R, hd]; mask0 [B, 1, R, R]
    -> [B, R, heads * hd]. Query head h reads KV head h // (heads / kv_heads), as grouped attention does. On the
    CPU, the step-0 part runs in torch's fused flash kernel (`_DiagonalFlash`); elsewhere, `dense_ttt_attention`."""
    B, heads, R, hd = q.shape
    rep = heads // k0.shape[1]
    expand = lambda t: t.repeat_interleave(rep, 1)  # noqa: E731
    if q.device.type != "cpu":
        return dense_ttt_attention(q, expand(k0), expand(v0), mask0, [expand(k) for k in kd], [expand(v) for v in vd])
    bias0 = torch.zeros(mask0.shape, dtype=q.dtype).masked_fill_(~mask0, float("-inf"))  # [B, 1, R, R]
    stack = lambda ts: torch.stack([expand(t) for t in ts]) if ts else q.new_zeros(0, *q.shape)  # noqa: E731
    out = _DiagonalFlash.apply(q, expand(k0), expand(v0), bias0, stack(kd), stack(vd))  # [B, heads, R, hd]
    return out.transpose(1, 2).reshape(B, R, heads * hd)


def dense_ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    mask0: torch.Tensor,
    kd: list[torch.Tensor],
    vd: list[torch.Tensor],
) -> torch.Tensor:
    """`ttt_attention` with every score materialised; k/v already expanded to the query heads."""
    B, heads, R, hd = q.shape
    scale = hd**-0.5
    s0 = (q @ k0.transpose(-1, -2)).float() * scale  # [B, heads, R, R]
    diag = [(q * k).sum(-1, keepdim=True).float() * scale for k in kd]  # [B, heads, R, 1] each
    p = torch.softmax(torch.cat([s0.masked_fill(~mask0, float("-inf")), *diag], dim=-1), dim=-1)
    out = p[..., :R] @ v0.float()  # [B, heads, R, hd]
    for i, v in enumerate(vd):
        out = out + p[..., R + i : R + i + 1] * v
    return out.transpose(1, 2).reshape(B, R, heads * hd).to(q.dtype)


class _DiagonalFlash(torch.autograd.Function):
    """Softmax attention over the step-0 keys (torch's fused CPU flash kernel, additive mask bias0) and the
    per-row keys kd/vd [j, B, heads, R, hd], merged by log-sum-exp. Backward: the flash kernel's own, given the
    merged output and log-sum-exp (its probabilities and row sums are then the merged ones), plus the diagonal
    terms by hand."""

    @staticmethod
    def forward(ctx, q, k0, v0, bias0, kd, vd):
        scale = q.shape[-1] ** -0.5
        out0, lse0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k0, v0, attn_mask=bias0, scale=scale
        )  # lse0 [B, heads, R]
        sd = (q.float() * kd.float()).sum(-1) * scale  # [j, B, heads, R]
        lse = torch.logsumexp(torch.cat([lse0[None], sd]), dim=0)  # [B, heads, R]
        pd = (sd - lse).exp()  # [j, B, heads, R]
        out = (lse0 - lse).exp()[..., None] * out0.float() + (pd[..., None] * vd.float()).sum(0)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, bias0, kd, vd, out, lse, pd)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, bias0, kd, vd, out, lse, pd = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        grad = grad.to(q.dtype).contiguous()
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k0, v0, out, lse, 0.0, False, attn_mask=bias0, scale=scale
        )
        g = grad.float()
        ds = pd * ((g * vd.float()).sum(-1) - (g * out.float()).sum(-1))  # [j, B, heads, R]
        dq = dq.float() + (ds[..., None] * kd.float()).sum(0) * scale
        dkd = ds[..., None] * q.float() * scale
        dvd = pd[..., None] * g
        return dq.to(q.dtype), dk0, dv0, None, dkd.to(kd.dtype), dvd.to(vd.dtype)


def unroll(head: Eagle3Head, embed: nn.Embedding, p: Packed, steps: int) -> list[torch.Tensor]:
    """The pre-norm outputs h_j [B, R, H] of TTT steps j = 0..steps-1 (module docstring)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    R = p.segment.shape[1]
    mask0 = segment_mask(p.segment)
    g = head.fuse(p.aux)  # [B, R, H]
    kd: list[torch.Tensor] = []
    vd: list[torch.Tensor] = []
    hs: list[torch.Tensor] = []
    for j in range(steps):
        emb = embed(p.tokens[:, 1 + j : 1 + j + R])  # [B, R, H] token[t+1+j]
        cos, sin = head.rotary.tables(p.position + j, torch.float32)
        q, k, v = attn.project(layer.inputs(emb, g), cos, sin)
        q, k = q.to(v.dtype), k.to(v.dtype)  # RoPE in fp32; attention in the autocast dtype
        if j == 0:
            k0, v0 = k, v
        else:
            kd.append(k)
            vd.append(v)
        g = layer.finish(g, attn.o_proj(ttt_attention(q, k0, v0, mask0, kd, vd)))
        hs.append(g)
    return hs


def ttt_loss(
    head: Eagle3Head, teacher: Teacher, p: Packed, hs: list[torch.Tensor]
) -> tuple[torch.Tensor | None, float]:
    """Weighted soft-label cross-entropy over the steps (None when the batch has no label) and step 0's top-1
    accuracy against the data token."""
    src = torch.zeros_like(p.trainable)  # rows whose next token is a label: the teacher's rows
    src[:, :-1] = p.trainable[:, 1:]
    slot = torch.full(src.shape, -1, dtype=torch.long, device=src.device)
    slot[src] = torch.arange(int(src.sum()), device=src.device)
    probs = teacher.probs(p.final[src])  # [M, Vd]
    total, acc0 = None, float("nan")
    for j, h in enumerate(hs):
        b, t = reach(p, j, p.trainable).nonzero(as_tuple=True)
        if not len(b):
            continue
        logits = head.lm_head(head.norm(h[b, t])).float()  # [M_j, Vd]
        loss = F.cross_entropy(logits, probs[slot[b, t + 1 + j]])  # soft labels
        total = loss * STEP_WEIGHT**j if total is None else total + loss * STEP_WEIGHT**j
        if j == 0:
            acc0 = float((head.draft_to_target[logits.argmax(-1)] == p.tokens[b, t + 2]).float().mean())
    return total, acc0


@torch.no_grad()
def acceptance(head: Eagle3Head, embed: nn.Embedding, p: Packed, steps: int) -> tuple[torch.Tensor, int]:
    """Greedy acceptance on one batch: (rows whose steps 0..j all matched the data token, for each j [steps],
    rows counted: those whose first label is a response token)."""
    alive = reach(p, 0, p.response)
    counted = int(alive.sum())
    hits = torch.zeros(steps, dtype=torch.long)
    for j, h in enumerate(unroll(head, embed, p, steps)):
        b, t = (alive & reach(p, j, p.response)).nonzero(as_tuple=True)
        pred = head.draft_to_target[head.lm_head(head.norm(h[b, t])).argmax(-1)]
        keep = pred == p.tokens[b, t + 2 + j]
        alive = torch.zeros_like(alive)
        alive[b[keep], t[keep]] = True
        hits[j] = int(keep.sum())
    return hits, counted


# -- the run -----------------------------------------------------------------------------------------------------


class Eagle3Trainer(HeadTrainer):
    """One training run: `Eagle3Trainer(target, cache, out, cfg, resume).run()` -> the head's manifest."""

    kind = "eagle3"
    betas = (0.9, 0.95)

    def build(self, model: nn.Module) -> Eagle3Head:
        self.convs = self._targets(model)
        head = init_head(model, self.vocab, self.teacher, self.cfg.intermediate, self.cache.aux_layers)
        self.t2d = head.t2d.clone()  # on the CPU, for `assemble`
        return head

    def batches(self) -> tuple[list[list[Batch]], list[Batch]]:
        val = segments(self.val_view, self.convs, self.cfg.max_len, greedy=True)  # data token = the target's choice
        self.val_conversations = len({s.conv for s in val})
        return self.pack_epochs(segments(self.train_view, self.convs, self.cfg.max_len), val)

    def _targets(self, model: nn.Module) -> dict[int, Conv]:
        """`scan` once per cache (kept beside the checkpoint)."""
        path = self.state_dir / "targets.pt"
        key = {"cache": str(self.cache.dir.resolve()), "shards": self.cache.manifest["shards"]}
        if path.is_file():
            stored = torch.load(path, weights_only=False)
            if stored["key"] == key:
                return stored["convs"]
        convs = scan(model, self.cache, self.cfg.progress)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        save_atomic({"key": key, "convs": convs}, path)
        return convs

    def _packed(self, view: FeatureCache, batch: Batch) -> Packed:
        return assemble(view, self.convs, batch, self.cfg.ttt, self.t2d, self.device)

    def loss(self, batch: Batch) -> Loss:
        p = self._packed(self.train_view, batch)
        loss, acc0 = ttt_loss(self.head, self.teacher, p, unroll(self.head, self.teacher.embed, p, self.cfg.ttt))
        return Loss(loss, {"loss": float("nan") if loss is None else loss.item(), "acc0": acc0}, p.real_tokens)

    def evaluate(self) -> dict:
        """Greedy acceptance on the validation split: P(steps 0..j accepted) per j, and tau."""
        hits, counted = torch.zeros(self.cfg.ttt, dtype=torch.long), 0
        for batch in self.val_batches:
            h, n = acceptance(self.head, self.teacher.embed, self._packed(self.val_view, batch), self.cfg.ttt)
            hits, counted = hits + h, counted + n
        accept = (hits.double() / max(counted, 1)).tolist()
        return {
            "conversations": self.val_conversations,
            "positions": counted,
            "depth": self.cfg.ttt,
            "accept": [round(a, 4) for a in accept],
            "tau": round(1 + sum(accept), 4),
        }

    def save_head(self, head: nn.Module, out: Path, manifest: dict) -> None:
        save_head(head, out, manifest)

    def describe(self) -> dict:
        c = self.head.config
        return {
            "head": {
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "aux_layers": list(c.aux_layers),
                "warm_start": ["lm_head <- target LM-head rows", "norm <- target final norm"],
            },
            "training": {"ttt": self.cfg.ttt},
        }


def train(
    target: str,
    cache_dir: Path | str,
    out: Path | str | None = None,
    cfg: TrainConfig = TrainConfig(),
    resume: bool = False,
    command: str | None = None,
) -> dict:
    """Train (or continue, `resume`) an EAGLE-3 head for `target` on a feature cache; the head, loadable by
    `--spec-type eagle3`, goes to `out` (default `default_out(target)`). Returns its manifest."""
    return Eagle3Trainer(target, cache_dir, out or default_out(target), cfg, resume, command).run()
