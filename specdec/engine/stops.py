"""Stop strings, scanned incrementally: an Aho-Corasick automaton over a request's stop strings, so that
finding a stop string in new text, and how much of the text could still grow into one, costs time in
the new characters only (amortized), whatever the number and length of the stop strings."""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class _Automaton:
    """Trie of the stop strings with failure links; node 0 is the root (the empty string)."""

    def __init__(self, stops: tuple[str, ...]):
        self.goto: dict[tuple[int, str], int] = {}
        self.depth = [0]  # length of the prefix a node stands for
        self.fail = [0]  # node of its longest proper suffix that is in the trie
        self.longest = [0]  # length of the longest stop string ending at the node (0: none)
        children: list[list[tuple[str, int]]] = [[]]
        for s in stops:
            node = 0
            for ch in s:
                nxt = self.goto.get((node, ch))
                if nxt is None:
                    nxt = self.goto[(node, ch)] = len(self.depth)
                    self.depth.append(self.depth[node] + 1)
                    self.fail.append(0)
                    self.longest.append(0)
                    children.append([])
                    children[node].append((ch, nxt))
                node = nxt
            self.longest[node] = len(s)
        queue = deque(v for _, v in children[0])
        while queue:  # breadth first: a node's failure link is known before its children's
            u = queue.popleft()
            for ch, v in children[u]:
                self.fail[v] = self.next(self.fail[u], ch) if u else 0
                self.longest[v] = self.longest[v] or self.longest[self.fail[v]]
                queue.append(v)

    def next(self, node: int, ch: str) -> int:
        while node and (node, ch) not in self.goto:
            node = self.fail[node]
        return self.goto.get((node, ch), 0)

    def walk(self, prefix: str) -> int:
        """The node of a prefix of a stop string."""
        node = 0
        for ch in prefix:
            node = self.goto[(node, ch)]
        return node


@lru_cache(maxsize=64)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    return _Automaton(stops)


class StopScan:
    """One commit's scan of a sequence's new text. It resumes from `held`, the tail of the text so far
    that is a proper prefix of a stop string: the part a stream holds back (`StopScan.held` of the
    previous scan), so no state has to live between commits."""

    def __init__(self, stops: list[str], held: str):
        self.auto = _automaton(tuple(stops))
        self.node = self.auto.walk(held)

    def find(self, text: str, start: int) -> int | None:
        """Feed text[start:]; where the earliest stop string that ends in it begins, or None."""
        best = None
        for i in range(start, len(text)):
            self.node = self.auto.next(self.node, text[i])
            n = self.auto.longest[self.node]
            if n and (best is None or i + 1 - n < best):
                best = i + 1 - n
        return best

    @property
    def held(self) -> int:
        """Characters at the end of the text fed so far that could still grow into a stop string."""
        return self.auto.depth[self.node]
