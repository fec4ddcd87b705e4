"""ModelRunner: a model plus its KV cache, driven by (slot, start, tokens) chunks."""
from __future__ import annotations

import torch

from specdec.errors import SpecdecError
from specdec.models.transformer import Transformer
from specdec.runtime.kv_cache import KVCache

PREFILL_CHUNK = 512
HEADROOM = 1  # a spare cache row past the context: padding of ragged batches is written there


class ModelRunner:
    def __init__(self, model: Transformer, num_slots: int, context: int):
        cfg = model.config
        self.model, self.context = model, context
        dtype = model.model.embed_tokens.weight.dtype
        self.cache = KVCache.allocate(cfg.num_layers, num_slots, cfg.num_kv_heads, context + HEADROOM,
                                      cfg.head_dim, dtype, model.layer_devices)
        self.device = model.device  # inputs go here; logits come back on the CPU

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def forward(self, chunks: list[list[int]], starts: list[int], slots: list[int],
                last_only: bool = False) -> list[torch.Tensor]:
        """Feed chunk i of tokens at positions starts[i].. into slot slots[i].

        Chunks are padded to the longest; padding writes at most up to the spare row past the context, so
        a long draft beside a sequence near the end of its context stays inside the cache.
        Returns per sequence logits [T_i, V] (or [1, V] with last_only), float32.
        """
        lens = [len(c) for c in chunks]
        if any(s + n > self.context for s, n in zip(starts, lens)):
            raise SpecdecError(f"sequence exceeds the context of {self.context} tokens")
        T = max(lens)
        tokens = torch.zeros(len(chunks), T, dtype=torch.long)
        for i, c in enumerate(chunks):
            tokens[i, :len(c)] = torch.tensor(c)
        positions = torch.tensor(starts)[:, None] + torch.arange(T)[None, :]  # [B, T]
        cache_index = positions.clamp(max=self.cache.max_len - 1)  # real positions are below the context
        logits_index = torch.tensor([[n - 1] for n in lens]) if last_only else None
        logits, _ = self.model(tokens.to(self.device), positions.to(self.device), torch.tensor(slots).to(self.device),
                               self.cache, cache_index.to(self.device),
                               logits_index=None if logits_index is None else logits_index.to(self.device))
        logits = logits.cpu()
        if last_only:
            return [logits[i] for i in range(len(chunks))]
        return [logits[i, :n] for i, n in enumerate(lens)]

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        """Feed a long run of tokens in chunks; return the last position's logits [V]."""
        logits = None
        for off in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[off:off + PREFILL_CHUNK]
            logits = self.forward([chunk], [start + off], [slot], last_only=True)[0]
        return logits[-1]

    def verify_tree(self, slot: int, start: int, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One forward over [last committed token] + a draft tree.

        tokens [N+1] (tokens[0] committed, at position `start`), parents [N] for nodes 1..N (-1 = the
        committed token). Nodes are written to cache rows start..start+N, get RoPE position
        start + depth, and attend to the prefix plus their own ancestors. Returns logits [N+1, V].
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
        logits, _ = self.model(torch.tensor([tokens], device=self.device), positions.to(self.device),
                               torch.tensor([slot], device=self.device), self.cache,
                               cache_index=cache_index.to(self.device), mask=mask.to(self.device))
        return logits[0].cpu()

    def keep_path(self, slot: int, start: int, path: list[int]) -> None:
        """After a tree verify at `start`, move the accepted nodes' K/V (node indices `path`, in
        depth order) to rows start+1.. so the cache again holds one contiguous sequence."""
        src = [start + 1 + node for node in path]
        dst = list(range(start + 1, start + 1 + len(path)))
        moves = [(s, d) for s, d in zip(src, dst) if s != d]
        if moves:
            self.cache.move(slot, [s for s, _ in moves], [d for _, d in moves])
