"""ModelRunner: a model plus its KV cache, driven by (slot, start, tokens) chunks.

Drafters that read the target's hidden states (EAGLE-3 heads, DFlash-style block drafters) get them from the
forwards that run anyway: set `ModelRunner.capture` once, then read `ModelRunner.features` after each call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.errors import SpecdecError
from specdec.runtime.cpu import keep_large_blocks
from specdec.runtime.kv_cache import KVCache

if TYPE_CHECKING:  # the runner drives a model; models import runtime parts, not the runner
    from specdec.models.transformer import Transformer
    from specdec.runtime.prefix_cache import PrefixStore

PREFILL_CHUNK = 512
HEADROOM = 1  # a spare cache row past the context: padding of ragged batches is written there


@dataclass(frozen=True)
class FeatureSpec:
    """Which target hidden states to capture on every forward.

    `layers`: decoder-layer indices i, 0 <= i < num_layers; feature i is the residual stream ENTERING layer i
    (the token embeddings for i = 0, else the output of layer i - 1), i.e. `hidden_states[i]` of Hugging
    Face's `output_hidden_states=True`. vLLM / SGLang EAGLE-3 `aux_hidden_state_layers` (default
    (2, N // 2, N - 3)) use this convention as is; ids given as "output of layer j" (HF `hidden_states[j + 1]`,
    e.g. DFlash `target_layer_ids`) map to j + 1, except j = N - 1: that one is `Features.final`.
    The final pre-norm hidden state (input of the final norm) is always captured as `Features.final`;
    `model.model.norm(final)` gives the post-norm one (HF's `hidden_states[N]`).
    """

    layers: tuple[int, ...] = ()

    def union(self, other: "FeatureSpec | None") -> "FeatureSpec":
        """Both specs' layers (what one capture must hold to serve two drafters)."""
        return self if other is None else FeatureSpec(tuple(sorted(set(self.layers) | set(other.layers))))

    @classmethod
    def eagle3(cls, num_layers: int) -> "FeatureSpec":
        """vLLM's default EAGLE-3 auxiliary layers for an N-layer target: (2, N // 2, N - 3)."""
        return cls((2, num_layers // 2, num_layers - 3))


@dataclass
class Features:
    """Target hidden states of the tokens one call processed, one row per token in input (node) order;
    on the CPU in the model's activation dtype."""

    layers: torch.Tensor  # [T, L, H], L = len(FeatureSpec.layers), in that order
    final: torch.Tensor  # [T, H] input of the final norm

    def __len__(self) -> int:
        return self.final.shape[0]

    def to(self, device: torch.device) -> "Features":
        return Features(self.layers.to(device), self.final.to(device))

    def rows(self, index: list[int]) -> "Features":
        """The given rows, in that order (a copy)."""
        idx = torch.tensor(index, dtype=torch.long)
        return Features(self.layers.index_select(0, idx), self.final.index_select(0, idx))

    def accepted(self, path: list[int]) -> "Features":
        """From the features of a verify over [last committed token] + draft: the rows of the tokens now
        committed, row 0 (the last committed token) then the accepted draft nodes of `path` in path order.

        `path`: node indices as `keep_path` takes them (tree: node j = tokens[j + 1] of `verify_tree`; chain:
        the first k draft tokens are path range(k)). The bonus/correction token has no row (not processed yet).
        Returns len(path) + 1 rows.
        """
        return self.rows([0] + [1 + node for node in path])

    def columns(self, layers: tuple[int, ...], captured: tuple[int, ...]) -> "Features":
        """The features of `layers` only, from a capture of `captured` (a superset, in its own order)."""
        if layers == captured:
            return self
        return Features(self.layers[:, [captured.index(i) for i in layers]], self.final)

    @staticmethod
    def cat(parts: list["Features"]) -> "Features":
        """Rows of several calls, one after another."""
        return Features(torch.cat([p.layers for p in parts]), torch.cat([p.final for p in parts]))


class ModelRunner:
    def __init__(self, model: Transformer, num_slots: int, context: int):
        cfg = model.config
        self.model, self.context = model, context
        model.use_context(context)
        dtype = model.model.embed_tokens.weight.dtype
        shapes = [cfg.attn_shape(i) if cfg.owns_kv(i) else (0, cfg.head_dim) for i in range(cfg.num_layers)]
        self.cache = KVCache.allocate(
            cfg.num_layers,
            num_slots,
            [heads for heads, _ in shapes],
            context + HEADROOM,
            [dim for _, dim in shapes],
            dtype,
            model.layer_devices,
            model.recurrent_states(),
        )
        self.device = model.device  # inputs go here; logits come back on the CPU
        self._capture: FeatureSpec | None = None
        self.features: list[Features] | None = None  # per sequence, from the last forward call (see `capture`)
        self.prefix: PrefixStore | None = None  # this model's part of a shared prefix cache (`--cache-mb`)
        keep_large_blocks()  # prefill chunks' outputs reuse freed heap instead of fresh pages

    def sharing_cache(self, model: Transformer) -> "ModelRunner":
        """A runner of `model`, a view of this runner's model made of its first layers (`first_layers`), on this
        runner's own KV cache: what it writes in those layers sits past the committed tokens, where the next
        target forward writes again before anything reads it. No prefix cache of its own: the target's fills it."""
        runner = copy.copy(self)
        runner.model, runner._capture, runner.features, runner.prefix = model, None, None, None
        return runner

    @property
    def capture(self) -> FeatureSpec | None:
        """Hidden states every forward path captures; None (default) = none, at no cost.

        With a spec set, after `forward` (per sequence: its real rows, not padding, also with last_only),
        `prefill` (one entry: every chunk's rows concatenated) and `verify_tree` (one entry: rows in node
        order), `features` holds one `Features` per sequence of that call, for every token it processed.
        """
        return self._capture

    @capture.setter
    def capture(self, spec: FeatureSpec | None) -> None:
        n = self.model.config.num_layers
        if spec is not None and not all(0 <= i < n for i in spec.layers):
            raise SpecdecError(f"feature layers {spec.layers} outside 0..{n - 1}")
        self._capture, self.features = spec, None

    def _hidden_layers(self) -> tuple[int, ...]:
        """Indices for `Transformer.forward`: the captured layers, then the final norm's input."""
        return () if self._capture is None else self._capture.layers + (self.model.config.num_layers,)

    def _collect(self, hidden: dict[int, torch.Tensor], where: list[tuple[int, int, int]]) -> list[Features] | None:
        """Per sequence its rows of the captured states (hidden i: [B, T, H]): where = (entry b, first row t,
        rows n)."""
        if self._capture is None:
            return None
        final = hidden[self.model.config.num_layers]
        parts = [hidden[i].to(final.device) for i in self._hidden_layers()]
        stacked = torch.stack(parts, dim=2).cpu()  # [B, T, L+1, H]
        return [Features(stacked[b, t : t + n, :-1], stacked[b, t : t + n, -1]) for b, t, n in where]

    @property
    def recurrent(self) -> bool:
        """Whether the model has recurrent layers (Qwen3.5): one state per sequence, so drafts are verified as
        chains (`Draft.as_chain`)."""
        return self.cache.states is not None

    @property
    def head_device(self) -> torch.device:
        """Where the final norm and LM head sit (the last part of a model split by `-ngl`): trained heads, which
        share them, run there."""
        return self.model.model.norm.weight.device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def forward(
        self,
        chunks: list[list[int]],
        starts: list[int],
        slots: list[int],
        last_only: bool = False,
        resume: list[torch.Tensor] | None = None,
        resume_layer: int = 0,
        settle: bool = True,
    ) -> list[torch.Tensor]:
        """Feed chunk i of tokens at positions starts[i].. into slot slots[i].

        Ragged chunks go one row per entry where the model runs every layer in C (`Transformer.layers_in_c`: no
        padding computed), else padded to the longest; padding writes at most up to the spare row past the
        context, so a long draft beside a sequence near the end of its context stays inside the cache.
        resume: per chunk [T_i, H], the residual stream entering layer `resume_layer` for its tokens (their K/V
        below that layer already cached): the forward starts there (`Draft.resume`; no `capture` then).
        settle: the positions before each start are final (a drafter's own drafting forwards pass False): recurrent
        states (`runtime.recurrent`) drop what they kept to roll back below them.
        Returns per sequence logits [T_i, V] (or [1, V] with last_only), float32; sets `features` (`capture`).
        """
        lens = [len(c) for c in chunks]
        if any(s + n > self.context for s, n in zip(starts, lens)):
            raise SpecdecError(f"sequence exceeds the context of {self.context} tokens")
        if resume is not None and self._capture is not None:
            raise SpecdecError("a resumed forward cannot capture target features")
        if self.recurrent:
            self.cache.states.settle = settle
        flat = len(set(lens)) > 1 and self.model.layers_in_c(sum(lens))
        tokens, positions, row_slots, x = (_one_row_each if flat else _padded)(chunks, starts, slots, resume)
        cache_index = positions.clamp(max=self.cache.max_len - 1)  # real positions are below the context
        # where sequence i's rows are: (entry, first row, rows) of the [B, T, ...] outputs
        where = (
            [(0, off, n) for off, n in zip(_offsets(lens), lens)] if flat else [(b, 0, n) for b, n in enumerate(lens)]
        )
        T = tokens.shape[1]
        logits_index = torch.tensor([[b * T + t + n - 1] for b, t, n in where]) if last_only else None  # [B', 1]
        dev = self.device
        logits, hidden = self.model(
            tokens.to(dev),
            positions.to(dev),
            row_slots.to(dev),
            self.cache,
            cache_index.to(dev),
            logits_index=None if logits_index is None else logits_index.to(dev),
            hidden_layers=self._hidden_layers(),
            resume=None if x is None else x.to(dev),
            resume_layer=resume_layer,
        )
        if flat:  # [N, 1, ...] -> [1, N, ...]
            hidden = {i: h.transpose(0, 1) for i, h in hidden.items()}
            logits = logits if last_only else logits.transpose(0, 1)
        self.features = self._collect(hidden, where)
        logits = logits.cpu()
        if last_only:
            return [logits[i] for i in range(len(chunks))]
        return [logits[b, t : t + n] for b, t, n in where]

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        """Feed a long run of tokens in chunks; return the last position's logits [V].
        With `capture`, `features` is one entry with a row per token of the whole run."""
        logits, parts = None, []
        for off in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[off : off + PREFILL_CHUNK]
            logits = self.forward([chunk], [start + off], [slot], last_only=True)[0]
            if self.features is not None:
                parts.append(self.features[0])
        if len(parts) > 1:  # one chunk: forward already set it
            self.features = [Features.cat(parts)]
        return logits[-1]

    def verify_tree(self, slot: int, start: int, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One forward over [last committed token] + a draft tree.

        tokens [N+1] (tokens[0] committed, at position `start`), parents [N] for nodes 1..N (-1 = the
        committed token). Nodes are written to cache rows start..start+N, get RoPE position
        start + depth, and attend to the prefix plus their own ancestors. Returns logits [N+1, V];
        sets `features` (`capture`): one entry, rows in node order (row 0 = the committed token).
        """
        n = len(tokens)
        depth, anc = [0] * n, torch.eye(n, dtype=torch.bool)  # anc[i, j]: j is i or an ancestor of i
        for i, p in enumerate(parents, start=1):
            depth[i] = depth[p + 1] + 1
            anc[i] |= anc[p + 1]
        cache_index = torch.arange(start, start + n)[None]  # [1, N+1]
        if start + n > self.context:
            raise SpecdecError(f"sequence exceeds the context of {self.context} tokens")
        mask = torch.ones(1, 1, n, start + n, dtype=torch.bool)  # [1, 1, N+1, S]
        mask[0, 0, :, start:] = anc
        positions = torch.tensor([start + d for d in depth])[None]  # [1, N+1]
        logits, hidden = self.model(
            torch.tensor([tokens], device=self.device),
            positions.to(self.device),
            torch.tensor([slot], device=self.device),
            self.cache,
            cache_index=cache_index.to(self.device),
            mask=mask.to(self.device),
            hidden_layers=self._hidden_layers(),
        )
        self.features = self._collect(hidden, [(0, 0, n)])
        return logits[0].cpu()

    def keep_path(self, slot: int, start: int, path: list[int]) -> None:
        """After a tree verify at `start`, move the accepted nodes' K/V (node indices `path`, in
        depth order) to rows start+1.. so the cache again holds one contiguous sequence."""
        src = [start + 1 + node for node in path]
        dst = list(range(start + 1, start + 1 + len(path)))
        moves = [(s, d) for s, d in zip(src, dst) if s != d]
        if moves:
            self.cache.move(slot, [s for s, _ in moves], [d for _, d in moves])


def _offsets(lens: list[int]) -> list[int]:
    """Where each of runs of these lengths starts when they are laid end to end."""
    return [sum(lens[:i]) for i in range(len(lens))]


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]  # tokens, positions [B, T], slots [B], x


def _padded(chunks: list[list[int]], starts: list[int], slots: list[int], resume: list[torch.Tensor] | None) -> Rows:
    """One entry per chunk, padded to the longest: tokens, positions [B, T], slots [B], resume [B, T, H] or None."""
    T = max(len(c) for c in chunks)
    tokens = torch.zeros(len(chunks), T, dtype=torch.long)
    for i, c in enumerate(chunks):
        tokens[i, : len(c)] = torch.tensor(c)
    positions = torch.tensor(starts)[:, None] + torch.arange(T)[None, :]
    x = None
    if resume is not None:
        x = resume[0].new_zeros(len(chunks), T, resume[0].shape[-1])
        for i, h in enumerate(resume):
            x[i, : len(h)] = h
    return tokens, positions, torch.tensor(slots), x


def _one_row_each(
    chunks: list[list[int]], starts: list[int], slots: list[int], resume: list[torch.Tensor] | None
) -> Rows:
    """One entry per token, no padding: tokens, positions [N, 1], slots [N], resume [N, 1, H] or None."""
    tokens = torch.tensor([t for c in chunks for t in c])[:, None]
    positions = torch.tensor([s + j for c, s in zip(chunks, starts) for j in range(len(c))])[:, None]
    row_slots = torch.tensor([slot for c, slot in zip(chunks, slots) for _ in c])
    x = None if resume is None else torch.cat(resume)[:, None]
    return tokens, positions, row_slots, x
