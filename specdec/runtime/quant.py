"""Weight-only int8 (per output channel) and int4 (per group of 64 inputs) linears for draft models:
faster than bf16 at one row on CPU, where a draft model spends its time. Trained heads take Q8_0 blocks through
the GGUF kernels instead (`q8_0_`: on Zen 5 an EAGLE-3 head for the 1.5B target steps in 0.26 ms against 5.4 ms in
fp32, scripts/bench_head_step.py; torch's int8 kernel was slower than fp32 there).

Only drafters use this. Drafts are verified by the unquantized target, so the output stays
exactly the target's; a quantized draft only changes how often it is right.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime.cpu import release_free_memory

SMALL_BATCH = 4  # rows up to which the int8 kernel beats dequantize + bf16 matmul


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features, self.bias = linear.in_features, linear.out_features, linear.bias
        if linear.weight.is_meta:  # `first_outputs` sets the buffers
            return
        q, scale = int8_rows(linear.weight)  # [out, in], [out]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def first_outputs(self, n: int) -> "Int8Linear":
        """The first `n` outputs only (a draft's reduced vocabulary, `Transformer.keep_head_rows`)."""
        part = Int8Linear(nn.Linear(self.in_features, n, bias=False, device="meta"))
        part.register_buffer("qweight", self.qweight[:n])
        part.register_buffer("scale", self.scale[:n])
        part.bias = None if self.bias is None else self.bias[:n]
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] <= SMALL_BATCH:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        else:
            y = F.linear(x2, self.qweight.to(x.dtype) * self.scale[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)


class Int4Linear(nn.Module):
    """Asymmetric 4-bit groups of GROUP inputs (w ~ q * scale + min); one-row products use the packed int4
    kernel, larger ones dequantize (prefill)."""

    GROUP = 64

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features, self.bias = linear.in_features, linear.out_features, linear.bias
        if linear.weight.is_meta:  # `first_outputs` sets the buffers
            return
        w = linear.weight.detach().float()  # [out, in]
        out, inp = w.shape
        g = w.reshape(-1, self.GROUP)  # [out * in / GROUP, GROUP]
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        scale = (hi - lo).clamp(min=1e-6) / 15
        q = g.sub(lo).div(scale).round().clamp(0, 15).to(torch.int32).reshape(out, inp)  # [out, in] in 0..15
        self._pack(q, scale.reshape(out, -1).to(linear.weight.dtype), lo.reshape(out, -1).to(linear.weight.dtype))

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> None:
        """q [out, in] int32 in 0..15, scale and low [out, groups] -> the buffers both paths read."""
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        sz = torch.stack([scale, zero], 2).transpose(0, 1)  # [groups, out, 2]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8))
        self.register_buffer("nibbles", (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8))  # [out, in / 2]
        self.register_buffer("scales_zeros", sz.contiguous())
        self.register_buffer("scale", scale)  # [out, groups]
        self.register_buffer("low", low)  # [out, groups]

    def first_outputs(self, n: int) -> "Int4Linear":
        """The first `n` outputs, rounded up to 16 as the packed kernel needs (a draft's reduced vocabulary,
        `Transformer.keep_head_rows`)."""
        n = min(self.out_features, -(-n // 16) * 16)
        part = Int4Linear(nn.Linear(self.in_features, n, bias=False, device="meta"))
        nib = self.nibbles[:n].to(torch.int32)
        part._pack(torch.stack([nib >> 4, nib & 15], -1).reshape(n, -1), self.scale[:n], self.low[:n])
        part.bias = None if self.bias is None else self.bias[:n]
        return part

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return linear.in_features % Int4Linear.GROUP == 0 and linear.weight.dtype == torch.bfloat16

    def dequantize(self) -> torch.Tensor:
        q = torch.stack([self.nibbles >> 4, self.nibbles & 15], dim=-1).reshape(self.nibbles.shape[0], -1)  # [out, in]
        g = q.reshape(q.shape[0], -1, self.GROUP).to(self.scale.dtype)  # [out, groups, GROUP]
        return (g * self.scale[..., None] + self.low[..., None]).reshape(q.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] <= SMALL_BATCH:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.GROUP, self.scales_zeros)
        else:
            y = F.linear(x2, self.dequantize())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 [out, in], fp32 scales [out]): symmetric per output row, the largest magnitude at 127."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def q8_0_(module: nn.Module) -> nn.Module:
    """Every fp32 nn.Linear on the CPU in `module` whose inputs are whole Q8_0 blocks (32) as Q8_0 blocks through
    the GGUF kernels (x16 layout where the CPU runs it), in place. Drafters only: drafts are verified."""
    import gguf

    from specdec.runtime.gguf_linear import GGUFLinear, for_this_cpu

    def q8_0(lin: nn.Linear) -> nn.Module | None:
        if lin.weight.dtype != torch.float32 or lin.in_features % 32:
            return None
        blocks = gguf.quants.quantize(lin.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
        bias = None if lin.bias is None else lin.bias.detach()
        return for_this_cpu(GGUFLinear.from_blocks(blocks, "Q8_0", tuple(lin.weight.shape), bias))

    _replace_linears(module, q8_0)
    return module


def quantize_(model: nn.Module, kind: str) -> nn.Module:
    """Weight-only quantization of every nn.Linear on the CPU in `model`, in place: int8, or int4 where the
    layer allows it (bf16, inputs a multiple of 64; int8 otherwise); `none` leaves the model as it is."""
    if kind != "none":
        _replace_linears(
            model, lambda lin: Int4Linear(lin) if kind == "int4" and Int4Linear.supports(lin) else Int8Linear(lin)
        )
        release_free_memory()
    return model


def _replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> None:
    """Each nn.Linear on the CPU (GPU layers stay) inside `module` becomes `make(linear)`, in place, unless that is
    None."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
            new = make(child)
            if new is not None:
                setattr(module, name, new)
        else:
            _replace_linears(child, make)
