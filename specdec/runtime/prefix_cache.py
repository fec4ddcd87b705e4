"""A prefix cache shared across requests: the KV of recent prompt prefixes, block by block.

Blocks hold BLOCK tokens and are keyed by a hash chain over token ids (a block's key hashes its parent's key
and its own tokens, so equal keys mean equal prefixes; the tokens and the parent are kept and compared, so a
hash collision is a miss, never wrong KV). One index serves several models ("stores": the target and a draft
model): a block carries each store's K/V for its tokens, and the budget counts them all.

Reuse copies a matched chain into a sequence's KV slot (`ModelRunner.reuse_prefix`); storing copies the KV of
a slot's full blocks out (`ModelRunner.keep_prefix`). A block's `refs` counts its cached children plus the
sequences holding it (the last block of the chain each reused), and only blocks with no refs are evicted, least
recently used first: a block in use, or the parent of a cached block, is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from specdec.runtime.kv_cache import KVCache

BLOCK = 16  # tokens per block
# `specdec serve`'s budget unless --cache-mb says otherwise (as llama-server keeps a slot's prompt and vLLM caches
# prefixes by default): Qwen2.5-1.5B's K/V in float32 is 56 KiB per token, so 512 MiB hold ~9,000 prompt tokens
SERVE_BUDGET_MB = 512

KV = tuple[list[torch.Tensor], list[torch.Tensor]]  # per layer k, v [kv_heads, BLOCK, head_dim]


@dataclass(eq=False)
class Block:
    key: int
    parent: Block | None
    tokens: tuple[int, ...]  # [BLOCK]
    kv: dict[str, KV] = field(default_factory=dict)  # store name -> this block's K/V in that model
    refs: int = 0  # cached children + sequences holding it
    nbytes: int = 0


@dataclass
class CacheStats:
    """One store's lookups."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    tokens_saved: int = 0  # tokens whose K/V was copied instead of computed


class PrefixCache:
    """Blocks of prefix KV within `budget` bytes, LRU-evicted; see the module docstring."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # key -> block, least recently used first
        self.stats: dict[str, CacheStats] = {}  # store name -> its lookups
        self.evicted = 0  # blocks

    def clear(self) -> None:
        """Forget every block (between benchmark runs; no sequence may hold one)."""
        self.blocks.clear()
        self.used = 0

    def chain(self, tokens: list[int], salt: Hashable = None) -> list[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of each full block of `tokens`; `salt` starts the chain (caches apart per salt)."""
        out, key = [], hash(("prefix", salt))
        for i in range(len(tokens) // BLOCK):
            part = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            key = hash((key, part))
            out.append((key, part))
        return out

    def lookup(self, tokens: list[int], store: str, limit: int, salt: Hashable = None) -> list[Block]:
        """The longest cached chain of full blocks of `tokens[:limit]` that `store` has K/V for, touched; the
        caller holds its last block until `release`. Counts the lookup (a hit if any block matched)."""
        found: list[Block] = []
        for key, part in self.chain(tokens[:limit], salt):
            b = self.blocks.get(key)
            if b is None or b.tokens != part or b.parent is not (found[-1] if found else None) or store not in b.kv:
                break
            found.append(b)
        for b in found:
            self.blocks.move_to_end(b.key)
        if found:
            found[-1].refs += 1
        st = self.stats.setdefault(store, CacheStats())
        st.lookups += 1
        st.hits += bool(found)
        st.tokens_saved += len(found) * BLOCK
        return found

    @staticmethod
    def release(held: Block | None) -> None:
        """A sequence is done with the chain ending at `held` (the last block `lookup` returned)."""
        if held is not None:
            held.refs -= 1

    def insert(self, tokens: list[int], store: str, read: Callable[[int, int], KV], salt: Hashable = None) -> int:
        """Cache `store`'s K/V of the full blocks of `tokens`, read(start, end) giving the positions' K/V;
        blocks already cached are touched. Stops at a block that cannot fit. Returns the blocks cached."""
        parent: Block | None = None
        n = 0
        for i, (key, part) in enumerate(self.chain(tokens, salt)):
            b = self.blocks.get(key)
            if b is not None and (b.tokens != part or b.parent is not parent):
                break  # a hash collision: leave the cached block alone
            if b is None:
                b = self._add(key, parent, part)
                if b is None:
                    break
            self.blocks.move_to_end(key)
            if store not in b.kv and not self._fill(b, store, read(i * BLOCK, (i + 1) * BLOCK)):
                break
            parent, n = b, n + 1
        return n

    def _add(self, key: int, parent: Block | None, part: tuple[int, ...]) -> Block | None:
        """A new, empty block under `parent` (which it pins)."""
        if self.budget <= 0:
            return None
        b = Block(key, parent, part)
        if parent is not None:
            parent.refs += 1
        self.blocks[key] = b
        return b

    def _fill(self, b: Block, store: str, kv: KV) -> bool:
        """Give block `b` the K/V of `store`, evicting others to fit; False (and `b` dropped if empty) if not."""
        nbytes = sum(t.numel() * t.element_size() for t in kv[0] + kv[1])
        b.refs += 1  # not itself a candidate while making room
        fits = self._make_room(nbytes)
        b.refs -= 1
        if not fits:
            if not b.kv:
                self._evict(b)
            return False
        b.kv[store] = kv
        b.nbytes += nbytes
        self.used += nbytes
        return True

    def _make_room(self, nbytes: int) -> bool:
        """Evict unreferenced blocks, least recently used first, until `nbytes` more fit in the budget."""
        if nbytes > self.budget:
            return False
        while self.used + nbytes > self.budget:
            victim = next((b for b in self.blocks.values() if b.refs == 0), None)
            if victim is None:
                return False
            self._evict(victim)
            self.evicted += 1
        return True

    def _evict(self, b: Block) -> None:
        del self.blocks[b.key]
        self.used -= b.nbytes
        if b.parent is not None:
            b.parent.refs -= 1


@dataclass
class PrefixStore:
    """One model's view of a shared `PrefixCache`: reuse into and keep from its KV slots under `name`."""

    cache: PrefixCache
    name: str  # "target", "draft"
    kv: KVCache

    def reuse(self, slot: int, tokens: list[int], salt: Hashable = None) -> tuple[int, Block | None]:
        """Copy the K/V of the longest cached prefix of `tokens` (all but the last token, whose logits the caller
        needs) into `slot`. Returns (tokens reused, the block to `release` when the sequence ends)."""
        blocks = self.cache.lookup(tokens, self.name, len(tokens) - 1, salt)
        if not blocks:
            return 0, None
        parts = [b.kv[self.name] for b in blocks]
        layers = range(len(parts[0][0]))
        self.kv.write_span(
            slot,
            0,
            [torch.cat([p[0][i] for p in parts], dim=1) for i in layers],
            [torch.cat([p[1][i] for p in parts], dim=1) for i in layers],
        )
        return len(blocks) * BLOCK, blocks[-1]

    def keep(self, slot: int, tokens: list[int], salt: Hashable = None) -> int:
        """Cache the full blocks of `tokens`, whose K/V sit at positions 0.. of `slot`; returns the blocks cached."""
        return self.cache.insert(tokens, self.name, lambda s, e: self.kv.read_span(slot, s, e), salt)

    def release(self, held: Block | None) -> None:
        self.cache.release(held)
