"""A static, position-indexed KV cache with one row ("slot") per sequence.

Nothing here tracks lengths: a sequence's valid length lives in its `Sequence` and rejecting
drafts is just moving that pointer back. Entries past it are stale and get overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime.recurrent import RecurrentStates


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [slots, kv_heads, max_len, head_dim] (max_len 0: a layer without K/V)
    v: list[torch.Tensor]  # per layer [slots, kv_heads, max_len, head_dim]
    states: RecurrentStates | None = None  # linear-attention layers' recurrent states (Qwen3.5)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_slots: int,
        kv_heads: int | list[int],
        max_len: int,
        head_dim: int | list[int],
        dtype: torch.dtype,
        device: torch.device | str | list = "cpu",
        states: RecurrentStates | None = None,
    ) -> "KVCache":
        """`kv_heads`, `head_dim`, `device`: one for every layer, or a list with each layer's (Gemma 4's full layers
        have their own sizes; a model split across devices); a layer of 0 K/V heads, or of `states`, keeps no K/V."""
        per_layer = lambda x: x if isinstance(x, list) else [x] * num_layers  # noqa: E731
        skip = () if states is None else states.layers
        shapes = [
            (num_slots, h, 0 if i in skip or h == 0 else max_len, d)
            for i, (h, d) in enumerate(zip(per_layer(kv_heads), per_layer(head_dim)))
        ]
        devices = per_layer(device)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=d) for shape, d in zip(shapes, devices)],
            [torch.zeros(shape, dtype=dtype, device=d) for shape, d in zip(shapes, devices)],
            states,
        )

    @property
    def max_len(self) -> int:
        return max(t.shape[2] for t in self.k)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def span(slots: torch.Tensor, index: torch.Tensor) -> tuple[int, int, int] | None:
        """(slot, start, end) when one sequence writes a contiguous run (the common case: a plain
        slice write); None otherwise. Computed once per forward, shared by every layer's `write`."""
        if slots.shape[0] == 1 and _is_contiguous_run(index):
            return int(slots[0]), int(index[0, 0]), int(index[0, -1]) + 1
        return None

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        index: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: tuple[int, int, int] | None = None,
    ) -> None:
        """slots [B], index [B, T] cache positions, k/v [B, kv_heads, T, head_dim]; `span` from `KVCache.span`."""
        if span is not None:
            s, start, end = span
            self.k[layer][s, :, start:end] = k[0]
            self.v[layer][s, :, start:end] = v[0]
            return
        rows = slots[:, None].expand_as(index)
        self.k[layer][rows, :, index] = k.transpose(1, 2)
        self.v[layer][rows, :, index] = v.transpose(1, 2)

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """First `length` positions of each slot: k, v [B, kv_heads, length, head_dim]."""
        if slots.shape[0] == 1:
            s = int(slots[0])
            return self.k[layer][s : s + 1, :, :length], self.v[layer][s : s + 1, :, :length]
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def read_span(self, slot: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one slot's positions start..end-1, on the CPU: per layer k, v [kv_heads, end - start, head_dim]."""
        return (
            [t[slot, :, start:end].to("cpu", copy=True) for t in self.k],
            [t[slot, :, start:end].to("cpu", copy=True) for t in self.v],
        )

    def write_span(self, slot: int, start: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Write per layer k, v [kv_heads, T, head_dim] at positions start..start+T-1 of one slot."""
        for cache, new in ((self.k, k), (self.v, v)):
            for t, x in zip(cache, new):
                t[slot, :, start : start + x.shape[1]] = x

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy entries at positions src -> dst in every layer (KV compaction after a tree verify)."""
        for t in self.k + self.v:
            s, d = torch.tensor(src, device=t.device), torch.tensor(dst, device=t.device)
            t[slot, :, d] = t[slot, :, s]


def _is_contiguous_run(index: torch.Tensor) -> bool:
    n = index.shape[1]
    return n == 1 or int(index[0, -1] - index[0, 0]) == n - 1 and bool((index[0, 1:] - index[0, :-1] == 1).all())
