"""The small operations of a decoder layer through the C library (`kernels/small_ops.c`): RMS norm, rotary
embedding of q and k in place, SiLU(gate) * up, tanh-GELU(gate) * up, Qwen3.5's gated delta rule with its inputs and
gated norm, one call each where torch takes 3 to 8 (at one row, their dispatch costs more than their arithmetic). Each
returns None (or False) where the C path does not apply: no library, not float32 on the CPU, or gradients wanted; the
caller then runs torch's operations. And each logit row's best token and its lead over the next (`top2`), which runs
torch's own where the C path does not apply, and a mixture of experts' router (`route`: logits, softmax and top k in
one call, which the C decoder layer runs too). A row's result is the same bits however many rows share the call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime import kernels as K


def _usable(*ts: torch.Tensor) -> bool:
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    return not grad and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., dim] -> weight * x / sqrt(mean(x^2) + eps), or None."""
    dim = x.shape[-1]
    lib = K.library() if _usable(x, weight) and dim % 8 == 0 else None
    if lib is None:
        return None
    xc = x.contiguous()
    out = torch.empty_like(xc)
    lib.gq_rmsnorm(xc.data_ptr(), weight.contiguous().data_ptr(), eps, xc.numel() // dim, dim, out.data_ptr())
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first `heads` heads of each row of qkv [B, T, width] (q's heads then k's) in place by cos, sin
    [B, 1, T, R], R <= head_dim (partial rotary: the first R channels of each head); False (nothing done) where the C
    path does not apply."""
    B, T, width = qkv.shape
    R = cos.shape[-1]
    lib = K.library() if _usable(qkv, cos, sin) and qkv.is_contiguous() and R <= head_dim else None
    if lib is None:
        return False
    c, s = cos.reshape(B * T, R).contiguous(), sin.reshape(B * T, R).contiguous()
    return lib.gq_rope(qkv.data_ptr(), width, c.data_ptr(), s.data_ptr(), B * T, heads, head_dim, R) == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [..., 2 * inter] (gate, then up) -> silu(gate) * up [..., inter], or None."""
    return _gated(gate_up, lambda lib, *args: lib.gq_silu_mul(*args))


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [..., 2 * inter] (gate, then up) -> tanh-GELU(gate) * up [..., inter] (Gemma's GeGLU), or None."""
    return _gated(gate_up, lambda lib, *args: lib.gq_gelu_mul(*args))


def swiglu_limit(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor | None:
    """gate_up [..., 2 * inter] (gate, then up) -> gpt-oss's (clamp(up, +-limit) + 1) * g * sigmoid(alpha g) with
    g = min(gate, limit) [..., inter], or None."""
    return _gated(gate_up, lambda lib, gu, rows, inter, out: lib.gq_swiglu_limit(gu, rows, inter, limit, alpha, out))


def _gated(gate_up: torch.Tensor, call) -> torch.Tensor | None:
    """An activation kernel of a fused gate/up, `call(lib, gate_up, rows, inter, out)` with addresses, or None."""
    inter = gate_up.shape[-1] // 2
    lib = K.library() if _usable(gate_up) and inter % 8 == 0 else None
    if lib is None:
        return None
    gu = gate_up.contiguous()
    out = torch.empty(*gu.shape[:-1], inter, dtype=torch.float32)
    call(lib, gu.data_ptr(), gu.numel() // (2 * inter), inter, out.data_ptr())
    return out


def gdn_inputs(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    heads: tuple[int, int, int, int],
    tiled: bool,
) -> tuple[torch.Tensor, ...] | None:
    """The gated delta rule's inputs from the conv's outputs before SiLU x [T, C] and the gate projections a, b
    [T, Hv], heads = (Hk, Hv, dk, dv): q, k [T, Hv, dk] (l2-normed, q scaled), v [T, Hv, dv], decay, beta [T, Hv];
    or None."""
    hk, hv, dk, dv = heads
    ok = _usable(x, a, b, a_log, dt_bias) and dk % 8 == 0 and dv % 8 == 0
    lib = K.library() if ok else None
    if lib is None:
        return None
    T = x.shape[0]
    q, k, v = torch.empty(T, hv, dk), torch.empty(T, hv, dk), torch.empty(T, hv, dv)
    decay, beta = torch.empty(T, hv), torch.empty(T, hv)
    ins = [t.contiguous() for t in (x, a, b, a_log, dt_bias)]
    outs = (q, k, v, decay, beta)
    lib.gq_gdn_inputs(*(t.data_ptr() for t in ins), T, hk, hv, dk, dv, int(tiled), *(t.data_ptr() for t in outs))
    return outs


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """rmsnorm(o) * weight * silu(z) over the last dim of o, z [..., dv], or None."""
    dv = o.shape[-1]
    lib = K.library() if _usable(o, z, weight) and dv % 8 == 0 else None
    if lib is None:
        return None
    o, z = o.contiguous(), z.contiguous()
    out = torch.empty_like(o)
    lib.gq_gated_norm(
        o.data_ptr(), z.data_ptr(), weight.contiguous().data_ptr(), eps, o.numel() // dv, dv, out.data_ptr()
    )
    return out


def delta_rule(
    ssm: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gated delta rule over T tokens from state ssm [Hv, dk, dv] (not changed): q, k [T, Hv, dk], v [T, Hv, dv],
    decay, beta [T, Hv] -> (the state after them, outputs [T, Hv, dv]), or None."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    lib = K.library() if _usable(ssm, q, k, v, decay, beta) and dv % 8 == 0 and dv <= 512 else None
    if lib is None:
        return None
    state = ssm.clone()
    out = torch.empty(T, H, dv)
    q, k, v, decay, beta = (t.contiguous() for t in (q, k, v, decay, beta))
    args = (state, q, k, v, decay, beta)
    lib.gq_delta_rule(*(t.data_ptr() for t in args), T, H, dk, dv, out.data_ptr())
    return state, out


@dataclass
class RouterParts:
    """A mixture of experts' router as `route` and the C layer take it: weight [E, H] and bias [E], k, the
    `ModelConfig.router` kind and whether the top k are renormalised; Gemma 4's in_scale [H] (the rows RMS-normed
    with eps, times it, are scored) and expert_scale [E] (each chosen expert's weight times it)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    k: int
    router: str
    norm: bool
    in_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None
    eps: float = 0.0

    def tensors(self) -> list[torch.Tensor | None]:
        """weight, bias, in_scale, expert_scale as the C router reads them (None where absent)."""
        ts = (self.weight, self.bias, self.in_scale, self.expert_scale)
        return [None if t is None else t.detach().contiguous() for t in ts]


ROUTERS = {"softmax_topk": 0, "topk_softmax": 1, "scaled": 0}  # `ModelConfig.router`s the C router takes: its kind
ROUTER_MAX = 1024  # experts it scores at most (small_ops.c)


def router_runs(router: RouterParts) -> bool:
    """Whether the C router takes this router: its tensors float32 on the CPU, hidden a multiple of 8."""
    E, H = router.weight.shape
    tensors = [t.detach() for t in (router.weight, router.bias, router.in_scale, router.expert_scale) if t is not None]
    return _usable(*tensors) and router.router in ROUTERS and H % 8 == 0 and 0 < router.k <= E <= ROUTER_MAX


def route(rows: torch.Tensor, router: RouterParts) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A mixture of experts' router: rows [N, H] -> each row's k experts' weights [N, k] and ids [N, k] (int64),
    largest first: "softmax_topk" the softmax's top k (renormalised where `norm`), "topk_softmax" (gpt-oss) the top k
    logits softmaxed, "scaled" (Gemma 4) as the first over the rows RMS-normed times `in_scale`, each weight times its
    expert's `expert_scale`; or None."""
    E, H = router.weight.shape
    lib = K.library() if _usable(rows) and rows.shape[-1] == H and router_runs(router) else None
    if lib is None:
        return None
    x, tensors = rows.contiguous(), router.tensors()
    w, b, scale, expert_scale = (None if t is None else t.data_ptr() for t in tensors)
    weights, chosen = torch.empty(len(x), router.k), torch.empty(len(x), router.k, dtype=torch.int64)
    kind, norm = ROUTERS[router.router], int(router.norm)
    out = (chosen.data_ptr(), weights.data_ptr())
    lib.gq_route(x.data_ptr(), w, b, scale, router.eps, expert_scale, len(x), H, E, router.k, kind, norm, *out)
    return weights, chosen


def top2(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """logits [n, V] -> per row, the index of the largest value (the first if several) and its lead over the largest
    of the others (0 where the best value occurs twice): torch's argmax and topk(2) in one pass."""
    rows = logits.reshape(-1, logits.shape[-1])
    lib = K.library() if _usable(rows) and rows.stride(-1) == 1 else None
    if lib is None:
        top = rows.topk(2, dim=-1).values  # [n, 2]; its indices need not be the first of equal bests
        return rows.argmax(-1).tolist(), (top[:, 0] - top[:, 1]).float().tolist()
    best = torch.empty(len(rows), dtype=torch.int64)
    gap = torch.empty(len(rows), dtype=torch.float32)
    lib.gq_top2(rows.data_ptr(), len(rows), rows.shape[1], rows.stride(0), best.data_ptr(), gap.data_ptr())
    return best.tolist(), gap.tolist()
