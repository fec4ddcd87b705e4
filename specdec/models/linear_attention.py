"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (transformers: models/qwen3_5, `Qwen3_5GatedDeltaNet`).

    q, k, v = split(silu(causal_conv1d(in_proj_qkv(x))))      # depthwise, kernel K, over the token axis
    q, k = l2norm(q), l2norm(k); q /= sqrt(dk)                 # key heads repeated over the value heads
    g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias); beta = sigmoid(in_proj_b(x))
    S = S * exp(g); S += k (x) ((v - S^T k) * beta); o = S^T q  # per token, S [Hv, dk, dv]
    out = out_proj(rmsnorm(o) * silu(in_proj_z(x)))

Every token takes the recurrent form, one after another, prefill included (transformers' chunked form for long
runs gives other bits): a token's output is the same however its prompt was chunked or batched. The conv is
written out as K shifted products for the same reason, and the transcendental steps (SiLU, l2 norms, the decay and
beta gates, the gated norm) and the rule itself run in C (`small_ops`), whose arithmetic does not depend on how many
tokens share a call (torch's vectorized loops take a tensor's tail another way). States live in
`runtime.recurrent`, which rolls them back when drafts are rejected.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.config import ModelConfig
from specdec.runtime import small_ops
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.recurrent import Rows, State, delta_rule


class Placed(Protocol):
    """What the layer reads of a forward's `transformer.Batch`: each entry's slot [B] and cache rows [B, T]."""

    slots: torch.Tensor
    cache_index: torch.Tensor


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim, as transformers' `l2norm` (FLA's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        hk, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.channels = 2 * hk * dk + hv * dv  # the conv's: q, k, v
        self.kernel = cfg.linear_conv_kernel
        self.in_proj = nn.Linear(cfg.hidden_size, self.channels + hv * dv, bias=False)  # in_proj_qkv, in_proj_z
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * hv, bias=False)  # in_proj_b, in_proj_a
        self.conv1d = DepthwiseConv(self.channels, self.kernel)
        self.tiled = cfg.linear_tiled
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedNorm(dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(hv * dv, cfg.hidden_size, bias=False)

    @property
    def state_shape(self) -> tuple[int, int, int, int, int]:
        """`runtime.recurrent.LayerStates.shape`."""
        return self.kernel, self.channels, self.hv, self.dk, self.dv

    def forward(self, x: torch.Tensor, batch: Placed, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        hv, dv = self.hv, self.dv
        conv_in, z = self.in_proj(x).float().split([self.channels, hv * dv], dim=-1)
        b, a = self.in_proj_ba(x).float().chunk(2, dim=-1)  # [B, T, Hv] each
        states = cache.states
        layer = states[self.layer]
        outs = []
        for e in range(B):  # each sequence on its own: its bits do not depend on the others
            slot, pos = int(batch.slots[e]), int(batch.cache_index[e, 0])
            state = layer.begin(slot, pos, states.settle)
            seq = torch.cat([state.conv, conv_in[e]])  # [K - 1 + T, C]: the window, then this forward's inputs
            rows = Rows(conv_in[e], *self._inputs(self.conv1d(seq), a[e], b[e]))  # the conv's [T, C] before SiLU
            ssm, out = delta_rule(state.ssm, rows)
            layer.end(slot, rows, State(seq[-(self.kernel - 1) :], ssm))
            outs.append(out)
        o = self.norm(torch.stack(outs), z.reshape(B, T, hv, dv))  # [B, T, Hv, dv]
        return self.out_proj(o.reshape(B, T, hv * dv).to(x.dtype))

    def _inputs(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The conv's outputs before SiLU [T, C] and the gate projections a, b [T, Hv] -> q, k [T, Hv, dk] (normed,
        q scaled), v [T, Hv, dv], decay, beta [T, Hv]: in C where it runs (the same arithmetic at any T), else torch."""
        fast = small_ops.gdn_inputs(
            mixed, a, b, self.A_log, self.dt_bias, (self.hk, self.hv, self.dk, self.dv), self.tiled
        )
        if fast is not None:
            return fast
        T = mixed.shape[0]
        q, k, v = F.silu(mixed).split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q = self._per_value_head(l2norm(q.reshape(T, self.hk, self.dk))) * self.dk**-0.5
        k = self._per_value_head(l2norm(k.reshape(T, self.hk, self.dk)))
        decay = torch.exp(-self.A_log.float().exp() * F.softplus(a + self.dt_bias.float()))
        return q, k, v.reshape(T, self.hv, self.dv), decay, torch.sigmoid(b)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[T, Hk, dk] -> [T, Hv, dk]: each value head's key head, the value heads grouped by key head (HF) or tiled
        (the GGUF's)."""
        rep = self.hv // self.hk
        return x.repeat(1, rep, 1) if self.tiled else x.repeat_interleave(rep, dim=1)


class DepthwiseConv(nn.Module):
    """The causal conv over the token axis, each channel its own K taps (weight [C, K], HF's conv1d [C, 1, K]),
    written out as K shifted products: every output the same bits at any run length."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, kernel))

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """seq [K - 1 + T, C] (the window, then T inputs) -> [T, C]."""
        w = self.weight.float()
        K = w.shape[1]
        T = seq.shape[0] - K + 1
        out = seq[:T] * w[:, 0]
        for j in range(1, K):
            out = out + seq[j : j + T] * w[:, j]
        return out


class GatedNorm(nn.Module):
    """rmsnorm(x) * weight * silu(gate) over each head's dv channels, in float32 (`Qwen3_5RMSNormGated`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        fast = small_ops.gated_norm(x, gate, self.weight.float(), self.eps)
        if fast is not None:
            return fast
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * x * F.silu(gate)
