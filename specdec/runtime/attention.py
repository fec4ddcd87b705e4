"""Attention over the KV cache: the C kernel (`kernels/attention.c`) on the CPU in float32 for every row count
(decode, verification, prefill chunks), torch's fused attention elsewhere (bf16, GPU, training: the kernel has no
backward; and with fast prefill, `kernels.set_fast_prefill`, a sequence's chunks of more than 64 rows).

The kernel computes every query row on its own, keys in cache order, so a token's output is the same bits
decoded alone, verified among drafted tokens, or prefilled in a chunk of any size after any cached prefix: plain and
speculative greedy decoding stay token-identical, and so do a prompt asked alone, in a batch or after a cache hit,
even where int8-quantized activations (the GGUF kernels) would turn last-bit differences into flipped tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.runtime import kernels as K


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, T, hd], keys / values [B, kv_heads, S, hd], mask [B, 1, T, S] bool (True = attend) or None (every
    key) -> [B, T, H, hd]. Scores are q.k times `scale` (None: hd ** -0.5), then `softcap * tanh(s / softcap)` where
    a soft cap is given (Gemma 2); `sinks` [H]: a logit per head that joins each softmax and attends to nothing
    (gpt-oss). Where the kernel does not run, both with torch's own ops, as transformers computes them."""
    out = _kernel(q, keys, values, mask, scale, softcap, sinks)
    if out is not None:
        return out
    if softcap is not None or sinks is not None:
        return _written_out(q, keys, values, mask, q.shape[-1] ** -0.5 if scale is None else scale, softcap, sinks)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
    ).transpose(1, 2)


def _written_out(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with soft-capped scores or sink logits, written out: [B, H, T, hd] -> [B, T, H, hd]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    v = values.repeat_interleave(group, dim=1) if group > 1 else values
    s = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, H, T, S]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, dropped after the softmax
        s = torch.cat([s, sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s.float(), dim=-1)
    p = (p[..., :-1] if sinks is not None else p).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2)


def _kernel(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    B, H, T, hd = q.shape
    S, kvh = keys.shape[2], keys.shape[1]
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, keys, values, sinks))
    usable = (
        K.kernels_take(T)
        and not grad
        and q.device.type == "cpu"
        and keys.device.type == "cpu"
        and q.dtype == keys.dtype == values.dtype == torch.float32
        and keys.stride() == values.stride()
        and keys.stride(-1) == 1
        and keys.stride(-2) == hd
        and H % kvh == 0
    )
    lib = K.library() if usable else None
    if lib is None:
        return None
    qc = q if q.stride(-1) == 1 else q.contiguous()
    m = None if mask is None else mask.expand(B, 1, T, S).contiguous()
    sk = None if sinks is None else sinks.detach().float().contiguous()
    out = torch.empty(B, T, H, hd, dtype=torch.float32)
    rc = lib.gq_attention(
        qc.data_ptr(),
        *qc.stride()[:3],
        keys.data_ptr(),
        values.data_ptr(),
        None,
        keys.stride(0),
        keys.stride(1),
        None if m is None else m.data_ptr(),
        B,
        H,
        kvh,
        T,
        S,
        hd,
        1.0 / math.sqrt(hd) if scale is None else scale,
        softcap or 0.0,
        None if sk is None else sk.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
        K.requested_path(),
    )
    return out if rc == 0 else None
