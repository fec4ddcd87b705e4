"""What head trainers share: conversations cut and packed into batches, the learning-rate schedule, the
autocast choice, atomic checkpoint files, the draft vocabulary, the frozen teacher, and the run itself
(`HeadTrainer`: resume, schedule, validation, checkpoints, the manifest)."""

from __future__ import annotations

import copy
import math
import os
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.state import store_int8
from specdec.runtime.cpu import has_bf16
from specdec.train.data import FeatureCache

STATE_DIR = "train-state"  # inside the head's directory: checkpoint and per-cache scans
SAVE_DTYPES = ("fp32", "bf16", "int8")  # int8: weight matrices stored in int8 with fp32 per-row scales
HEAD_FILES = ("model.safetensors", "config.json", "manifest.json")  # replaced in this order (manifest last)


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of conversation `conv` (an index into a `FeatureCache` view)."""

    conv: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


Row = list[Segment]  # segments laid one after another in one batch row
Batch = list[Row]


def cut(conv: int, length: int, max_len: int) -> list[Segment]:
    """A conversation of `length` tokens as pieces of at most `max_len` tokens."""
    return [Segment(conv, a, min(a + max_len, length)) for a in range(0, length, max_len)]


def pack(segments: list[Segment], max_len: int, rows_per_batch: int, seed: int | None) -> list[Batch]:
    """Segments (shuffled with `seed`; None keeps their order) laid into rows of at most `max_len` tokens (a
    segment goes to the current row when it fits, else opens a new one), `rows_per_batch` rows per batch."""
    order = list(segments)
    if seed is not None:
        random.Random(seed).shuffle(order)
    rows: list[Row] = []
    for s in order:
        if rows and sum(map(len, rows[-1])) + len(s) <= max_len:
            rows[-1].append(s)
        else:
            rows.append([s])
    return [rows[i : i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


def segment_mask(segment: torch.Tensor) -> torch.Tensor:
    """segment [B, R] long (a packed row's segment numbers) -> [B, 1, R, R] bool: causal within a segment."""
    R = segment.shape[1]
    causal = torch.ones(R, R, dtype=torch.bool, device=segment.device).tril()
    return (causal & (segment[:, :, None] == segment[:, None, :]))[:, None]


def learning_rate(progress: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first `warmup` share of training, then cosine to zero; progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """bf16 | fp32 | auto (bf16 on a GPU or a CPU with native bf16 instructions) -> the autocast dtype (None =
    plain fp32)."""
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" or (device.type == "cpu" and has_bf16()) else "fp32"
    return torch.bfloat16 if choice == "bf16" else None


def save_atomic(obj: object, path: Path) -> None:
    """torch.save to a temporary file, then rename over `path` (a killed run leaves the old file whole)."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# -- what every head learns from ---------------------------------------------------------------------------------


def choose_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent prediction targets (counts [V]), as sorted target ids [size]."""
    return counts.topk(min(size, counts.numel())).indices.sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the counted response tokens inside the vocabulary `ids`."""
    return float(counts[ids].sum() / counts.sum().clamp(min=1))


def dense_weight(m: nn.Module) -> torch.Tensor:
    """[out, in] float32 weight of an embedding or linear layer, GGUF blocks dequantized."""
    from specdec.models.gguf_quantized import GGUFEmbedding
    from specdec.runtime.gguf_linear import GGUFLinear

    if isinstance(m, GGUFEmbedding):
        m = m.table
    if isinstance(m, GGUFLinear):
        return m.dequantize(torch.float32)
    return m.weight.detach().float()


class Teacher(nn.Module):
    """The target's parts a head learns from, frozen: final norm, LM-head rows of the draft vocabulary, and (when
    `embed`) the token embeddings."""

    def __init__(self, target: nn.Module, ids: torch.Tensor, embed: bool = True):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(dense_weight(target.model.embed_tokens)) if embed else None  # [V, H]
        self.norm = copy.deepcopy(target.model.norm).float().requires_grad_(False)
        self.register_buffer("rows", dense_weight(target.lm_head)[ids])  # [Vd, H]

    @torch.no_grad()
    def probs(self, final: torch.Tensor) -> torch.Tensor:
        """Pre-norm final states [M, H] -> the target's next-token distribution over the draft vocabulary [M, Vd]."""
        return torch.softmax((self.norm(final.float()) @ self.rows.T).float(), dim=-1)


def check_cache(cache: FeatureCache, model: nn.Module, target: str) -> None:
    """The cache must come from a model shaped like `target`."""
    c, t = model.config, cache.manifest["target"]
    if (t["vocab_size"], t["hidden_size"], t["num_layers"]) != (c.vocab_size, c.hidden_size, c.num_layers):
        raise SpecdecError(
            f"the feature cache was made from {t['name']} (vocabulary {t['vocab_size']}, hidden "
            f"{t['hidden_size']}, {t['num_layers']} layers), not {target}"
        )


# -- one training run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSettings:
    """What every head trainer takes; a trainer's own config adds its shape and may change these defaults."""

    draft_vocab: int | None = 16384  # None: the target's whole vocabulary
    epochs: int = 3
    lr: float = 3e-4
    warmup: float = 0.03
    clip: float = 0.5
    max_len: int = 1024  # tokens per packed row
    batch_tokens: int = 2048  # tokens per optimizer step (rows of max_len)
    max_hours: float | None = None  # over every run of this checkpoint; the schedule decays to zero by then
    device: str = "cpu"
    autocast: str = "auto"  # auto | bf16 | fp32
    val_share: float = 0.05
    seed: int = 0
    checkpoint_minutes: float = 10.0
    save_dtype: str = "fp32"  # the saved head's weights: fp32 | bf16 | int8 (per-row scales)
    progress: bool = True

    def check(self) -> None:
        if min(self.draft_vocab or 1, self.epochs, self.max_len, self.batch_tokens) < 1:
            raise SpecdecError("draft vocabulary, epochs, max length and batch tokens must be >= 1")
        if self.lr <= 0 or self.clip <= 0 or (self.max_hours is not None and self.max_hours <= 0):
            raise SpecdecError("--lr, --clip and --max-hours must be > 0")
        if not 0 < self.val_share < 1 or not 0 <= self.warmup < 1:
            raise SpecdecError("the validation share must be in (0, 1), warmup in [0, 1)")
        if self.autocast not in ("auto", "bf16", "fp32") or self.save_dtype not in SAVE_DTYPES:
            raise SpecdecError(f"autocast is auto|bf16|fp32, save dtype {'|'.join(SAVE_DTYPES)}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise SpecdecError("--device cuda: no CUDA device here")


@dataclass
class Progress:
    """Where training stands (saved in checkpoints)."""

    step: int = 0
    epoch: int = 0  # epochs finished
    batch: int = 0  # batches of the current epoch done
    tokens: int = 0  # row tokens trained on, every step counted (padding not)
    seconds: float = 0.0  # wall time over every run, evaluation included
    train_seconds: float = 0.0  # optimizer steps only
    curve: list[list[float]] = field(default_factory=list)  # [tokens, validation tau]
    validation: dict | None = None


@dataclass
class Loss:
    """One batch's result: the loss to backpropagate (None: the batch has no label), what the bar shows, tokens."""

    value: torch.Tensor | None
    shown: dict[str, float]
    tokens: int


class HeadTrainer:
    """The run every head shares: load the cache, split it, choose the draft vocabulary, build the head and its
    optimizer (or resume them), train with a warmup + cosine schedule, validate and checkpoint every
    `checkpoint_minutes`, save the head and its manifest atomically. A trainer supplies `kind`, `betas`,
    `embed` (whether its Teacher keeps the token embeddings), `build`, `batches`, `loss`, `evaluate`, `save_head`
    and `describe`. `Trainer(target, cache, out, cfg, resume).run()` -> the head's manifest."""

    kind = ""
    betas = (0.9, 0.999)
    embed = True

    def __init__(
        self,
        target: str,
        cache_dir: Path | str,
        out: Path | str,
        cfg: TrainSettings,
        resume: bool = False,
        command: str | None = None,
    ):
        from specdec.api import load_model

        cfg.check()
        self.target, self.out, self.command = target, Path(out), command or " ".join(sys.argv)
        self.state_dir = self.out / STATE_DIR
        saved = self._saved(resume)
        if saved is not None:  # the checkpoint's shape and recipe; this call's budget and placement
            cfg = replace(
                type(cfg)(**saved["config"]),
                epochs=cfg.epochs,
                max_hours=cfg.max_hours,
                device=cfg.device,
                progress=cfg.progress,
                checkpoint_minutes=cfg.checkpoint_minutes,
            )
        self.cfg, self.device = cfg, torch.device(cfg.device)
        self.cache = FeatureCache(cache_dir)
        self.train_view, self.val_view = self.cache.split(cfg.val_share, cfg.seed)
        if not len(self.train_view) or not len(self.val_view):
            raise SpecdecError(
                f"{cache_dir}: {len(self.cache)} conversations are too few for a training and a validation split"
            )
        model = load_model(target, "auto", "fp32", progress=cfg.progress)[0]
        check_cache(self.cache, model, target)
        counts = self.train_view.token_counts()
        self.vocab = saved["vocab"] if saved is not None else choose_vocab(counts, cfg.draft_vocab or len(counts))
        self.coverage = {
            "train": coverage(counts, self.vocab),
            "validation": coverage(self.val_view.token_counts(), self.vocab),
        }
        self.teacher = Teacher(model, self.vocab, self.embed)
        self.head = self.build(model)
        del model
        if saved is not None:
            self.head.load_state_dict(saved["head"])
        self.head.to(self.device).train()
        self.teacher.to(self.device)
        self.amp = autocast_dtype(cfg.autocast, self.device)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, betas=self.betas, weight_decay=0.0)
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])
        self.progress = Progress(**saved["progress"]) if saved is not None else Progress()
        self.plan, self.val_batches = self.batches()
        self.total_steps = sum(map(len, self.plan))

    # what a trainer supplies
    def build(self, model: nn.Module) -> nn.Module:
        """The untrained head for the target `model` (self.vocab, self.teacher set)."""
        raise NotImplementedError

    def batches(self) -> tuple[list[list[Batch]], list[Batch]]:
        """Every epoch's training batches (a function of the seed) and the validation batches."""
        raise NotImplementedError

    def loss(self, batch: Batch) -> Loss:
        """One training batch's loss (under autocast)."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        """Validation metrics with at least "tau" (the head in eval mode, no gradients needed)."""
        raise NotImplementedError

    def save_head(self, head: nn.Module, out: Path, manifest: dict) -> None:
        """Write HEAD_FILES of `head` to `out`."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The manifest's "head" section and the trainer's own "training" entries: {"head": ..., "training": ...}."""
        raise NotImplementedError

    # the shared run
    def pack_epochs(self, train: list[Segment], val: list[Segment]) -> tuple[list[list[Batch]], list[Batch]]:
        """Every epoch's batches of `train` (shuffled per epoch, a function of the seed) and `val`'s, in order."""
        cfg = self.cfg
        rows = max(1, cfg.batch_tokens // cfg.max_len)
        plan = [pack(train, cfg.max_len, rows, cfg.seed * 1_000_003 + e) for e in range(cfg.epochs)]
        return plan, pack(val, cfg.max_len, rows, None)

    def _saved(self, resume: bool) -> dict | None:
        ckpt = self.state_dir / "checkpoint.pt"
        if resume and not ckpt.is_file():
            raise SpecdecError(f"--resume: no checkpoint in {self.state_dir}")
        if not resume and ckpt.is_file():
            raise SpecdecError(f"{self.out} holds a training checkpoint: --resume to continue it, or another --out")
        return torch.load(ckpt, map_location="cpu", weights_only=False) if resume else None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None)

    def run(self) -> dict:
        """Train to the end (or to --max-hours), evaluating and saving every `checkpoint_minutes`; the manifest."""
        from tqdm import tqdm

        pr, cfg = self.progress, self.cfg
        start, last_save = time.perf_counter() - pr.seconds, time.perf_counter()
        if not pr.curve:
            self._validate()
        bar = tqdm(
            total=self.total_steps,
            initial=pr.step,
            unit="step",
            desc=self.kind,
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not cfg.progress,
        )
        while pr.epoch < cfg.epochs and not self._time_up(start):
            batches = self.plan[pr.epoch]
            while pr.batch < len(batches) and not self._time_up(start):
                shown = self._step(batches[pr.batch], start)
                pr.step, pr.batch = pr.step + 1, pr.batch + 1
                bar.update(1)
                bar.set_postfix(
                    **{k: f"{v:.3f}" for k, v in shown.items()}, tok_s=f"{pr.tokens / pr.train_seconds:.0f}"
                )
                if time.perf_counter() - last_save > 60 * cfg.checkpoint_minutes:
                    pr.seconds = time.perf_counter() - start
                    self._validate()
                    self._save(finished=False)
                    last_save = time.perf_counter()
            if pr.batch == len(batches):
                pr.epoch, pr.batch = pr.epoch + 1, 0
        bar.close()
        pr.seconds = time.perf_counter() - start
        self._validate()
        return self._save(finished=pr.epoch == cfg.epochs)

    def _time_up(self, start: float) -> bool:
        return self.cfg.max_hours is not None and time.perf_counter() - start >= 3600 * self.cfg.max_hours

    def _step(self, batch: Batch, start: float) -> dict[str, float]:
        """One optimizer step -> what the progress bar shows."""
        pr, cfg = self.progress, self.cfg
        t = time.perf_counter()
        done = (pr.step + 1) / self.total_steps
        if cfg.max_hours is not None:
            done = max(done, (t - start) / (3600 * cfg.max_hours))
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(min(done, 1.0), cfg.lr, cfg.warmup)
        with self.autocast():
            result = self.loss(batch)
        if result.value is not None:
            result.value.backward()
            nn.utils.clip_grad_norm_(self.head.parameters(), cfg.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        pr.tokens += result.tokens
        pr.train_seconds += time.perf_counter() - t
        return result.shown

    def _validate(self) -> None:
        self.head.eval()
        with self.autocast(), torch.no_grad():
            v = self.progress.validation = self.evaluate()
        self.head.train()
        self.progress.curve.append([self.progress.tokens, v["tau"]])

    def _save(self, finished: bool) -> dict:
        """The checkpoint, then the head and its manifest (each file replaced atomically, the manifest last)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        save_atomic(
            {
                "config": asdict(self.cfg),
                "vocab": self.vocab,
                "head": self.head.state_dict(),
                "optimizer": self.opt.state_dict(),
                "progress": asdict(self.progress),
            },
            self.state_dir / "checkpoint.pt",
        )
        manifest = self.manifest(finished)
        dtype = torch.bfloat16 if self.cfg.save_dtype == "bf16" else torch.float32
        tmp = self.state_dir / f"head.tmp-{os.getpid()}"
        self.save_head(copy.deepcopy(self.head).to("cpu", dtype), tmp, manifest)
        if self.cfg.save_dtype == "int8":
            store_int8(tmp / HEAD_FILES[0])
        for name in HEAD_FILES:
            os.replace(tmp / name, self.out / name)
        tmp.rmdir()
        return manifest

    def manifest(self, finished: bool) -> dict:
        pr, cfg, m = self.progress, self.cfg, self.cache.manifest
        epochs = pr.epoch + (pr.batch / len(self.plan[pr.epoch]) if pr.epoch < cfg.epochs else 0)
        own = self.describe()
        return {
            "kind": self.kind,
            "target": self.target,
            "finished": finished,
            "head": {
                **own["head"],
                "storage": cfg.save_dtype,
                "parameters": sum(p.numel() for p in self.head.parameters()),
            },
            "draft_vocab": {"size": len(self.vocab), "coverage": {k: round(v, 4) for k, v in self.coverage.items()}},
            "data": {
                "cache": str(self.cache.dir),
                "cache_command": m.get("command"),
                "cache_hours": m.get("throughput", {}).get("hours"),
                "sources": m["sources"],
                "counts": m["counts"],
                "rules": m["rules"],
                "generation": m["generation"],
                "target_runtime": m["target"]["runtime"],
                "conversations": {"train": len(self.train_view), "validation": len(self.val_view)},
            },
            "training": {
                "tokens": pr.tokens,
                "epochs": round(epochs, 3),
                "epochs_planned": cfg.epochs,
                "steps": pr.step,
                "hours": round(pr.seconds / 3600, 4),
                "tok_s": round(pr.tokens / max(pr.train_seconds, 1e-9), 1),
                **own["training"],
                "lr": cfg.lr,
                "warmup": cfg.warmup,
                "max_len": cfg.max_len,
                "batch_tokens": cfg.batch_tokens,
                "device": cfg.device,
                "autocast": str(self.amp).removeprefix("torch.") if self.amp else "fp32",
                "threads": torch.get_num_threads(),
                "max_hours": cfg.max_hours,
            },
            "validation": pr.validation,
            "learning_curve": pr.curve,  # [tokens, validation tau]
            "command": self.command,
        }
