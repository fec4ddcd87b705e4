"""Recurrent states of linear-attention layers (Qwen3.5's gated DeltaNet), one per slot, rolled back by position.

A KV cache rolls back by moving a length pointer; a recurrent state cannot, since each token changes it. So each
slot keeps the state at one settled position (`base`) plus, for every token fed since, the inputs its update reads
(`Rows`). A forward at position p asks `begin(slot, p)`: the state at p is the state after the last forward (`tip`)
when p is where that forward ended, else the base replayed over the held rows up to p; rows from p on are dropped
(they were rejected drafts, or padding of a ragged batch). With `settle`, positions below p are final and p becomes
the base; a drafter's own drafting forwards do not settle, so a rejection can go back to any of their rows.

Memory per slot and layer: two states (value heads x key dim x value dim, float32) and the conv window, plus per
held row its conv input and update inputs (about 2 x key dim + 2 x value dim floats per value head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import SpecdecError
from specdec.runtime import small_ops


@dataclass
class Rows:
    """Inputs of the tokens fed to one layer since its base, one row each."""

    conv_in: torch.Tensor  # [n, C]: the conv's inputs (the fused q/k/v projection)
    q: torch.Tensor  # [n, Hv, dk] l2-normed and scaled queries (repeated per value head)
    k: torch.Tensor  # [n, Hv, dk] l2-normed keys
    v: torch.Tensor  # [n, Hv, dv]
    decay: torch.Tensor  # [n, Hv] exp(g)
    beta: torch.Tensor  # [n, Hv]

    def __len__(self) -> int:
        return self.conv_in.shape[0]

    def head(self, n: int) -> "Rows":
        return Rows(*(t[:n] for t in self.parts()))

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.conv_in, self.q, self.k, self.v, self.decay, self.beta

    def then(self, more: "Rows") -> "Rows":
        return Rows(*(torch.cat([a, b]) for a, b in zip(self.parts(), more.parts())))


@dataclass
class State:
    """One layer's state of one slot at some position."""

    conv: torch.Tensor  # [K - 1, C]: the last K - 1 conv inputs
    ssm: torch.Tensor  # [Hv, dk, dv]

    @classmethod
    def zeros(cls, kernel: int, channels: int, heads: int, dk: int, dv: int) -> "State":
        return cls(torch.zeros(kernel - 1, channels), torch.zeros(heads, dk, dv))


def delta_rule(ssm: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the rows, one token after another, from ssm [Hv, dk, dv] (not changed) -> (the
    state after them, outputs [n, Hv, dv]); the C kernel where it runs (`small_ops.delta_rule`), else torch."""
    fast = small_ops.delta_rule(ssm, rows.q, rows.k, rows.v, rows.decay, rows.beta)
    if fast is not None:
        return fast
    out = []
    for q, k, v, decay, beta in zip(rows.q, rows.k, rows.v, rows.decay, rows.beta):  # q, k [Hv, dk], v [Hv, dv]
        ssm = ssm * decay[:, None, None]
        remembered = (ssm * k[:, :, None]).sum(dim=1)  # [Hv, dv]
        ssm = ssm + k[:, :, None] * ((v - remembered) * beta[:, None])[:, None, :]
        out.append((ssm * q[:, :, None]).sum(dim=1))
    return ssm, torch.stack(out) if out else rows.v.new_zeros(rows.v.shape)


def replay(state: State, rows: Rows) -> State:
    """The state after feeding `rows` from `state`."""
    window = torch.cat([state.conv, rows.conv_in])[-state.conv.shape[0] :]
    return State(window, delta_rule(state.ssm, rows)[0])


@dataclass
class Slot:
    base: State
    base_pos: int = 0
    rows: Rows | None = None  # fed since the base, positions base_pos..
    tip: State | None = None  # the state after every held row


@dataclass
class LayerStates:
    """One linear-attention layer's states, per slot."""

    shape: tuple[int, int, int, int, int]  # conv kernel, conv channels, value heads, key dim, value dim
    slots: dict[int, Slot] = field(default_factory=dict)

    def begin(self, slot: int, pos: int, settle: bool) -> State:
        """The state at position `pos` of `slot` (zeros at 0); rows from `pos` on are dropped."""
        s = self.slots.get(slot)
        if pos == 0 or s is None:
            if pos:
                raise SpecdecError(f"no recurrent state for slot {slot} at position {pos}")
            s = self.slots[slot] = Slot(State.zeros(*self.shape))
            return s.base
        held = 0 if s.rows is None else len(s.rows)
        if not s.base_pos <= pos <= s.base_pos + held:
            raise SpecdecError(
                f"cannot roll a recurrent state back to position {pos} (it holds {s.base_pos}..{s.base_pos + held})"
            )
        n = pos - s.base_pos
        state = s.tip if n == held and s.tip is not None else replay(s.base, s.rows.head(n)) if n else s.base
        s.rows, s.tip = (None if n == 0 else s.rows.head(n)), None
        if settle:
            s.base, s.base_pos, s.rows = state, pos, None
        return state

    def end(self, slot: int, rows: Rows, tip: State) -> None:
        """After `begin`: the rows this forward fed, and the state after them."""
        s = self.slots[slot]
        s.rows = rows if s.rows is None else s.rows.then(rows)
        s.tip = tip


class RecurrentStates:
    """Every linear-attention layer's `LayerStates`, by layer index. `settle`: whether the forward under way makes
    the positions below its start final (`ModelRunner.forward` sets it)."""

    def __init__(self, layers: dict[int, tuple[int, int, int, int, int]]):
        self.layers = {i: LayerStates(shape) for i, shape in layers.items()}
        self.settle = True

    def __getitem__(self, layer: int) -> LayerStates:
        return self.layers[layer]
