"""Decoder-only transformer for every model family (`models/families/`): the layer recipe (norm placement, q/k
norms, activation, scales, soft-caps, sliding-window layers, rotary variants) comes from the config.

Parameter names mirror Hugging Face checkpoints, except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj` (see `fuse_projections`): fewer, larger matmuls.
Every forward takes a chunk of tokens per sequence, writes their K/V into a static cache at
the given positions and returns logits for the positions asked for.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.linear_attention import GatedDeltaNet
from specdec.models.rope import Rotary, apply_rotary
from specdec.runtime import kernels as K
from specdec.runtime import small_ops
from specdec.runtime.attention import attention
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.layer_kernel import LayerKernel, LayerParts, LayerStack, StepArgs, step_args
from specdec.runtime.recurrent import RecurrentStates


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight); offset 1 is Gemma's form (its weights are stored as weight - 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if not self.offset else self.offset + self.weight
        fast = small_ops.rms_norm(x, w, self.eps)
        if fast is not None:
            return fast
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.kv_heads, hd = cfg.attn_shape(layer)
        self.head_dim, self.kv_layer = hd, cfg.kv_layer(layer)
        self.q_size, self.kv_size = cfg.num_heads * hd, self.kv_heads * hd
        self.sliding = cfg.sliding(layer)  # attends to the last `cfg.sliding_window` positions only
        # what qkv_proj gives beside q: k and v; k alone where values are the keys (Gemma 4's full layers); nothing
        # where the layer reads another layer's K/V
        self.kv_parts = 0 if self.kv_layer != layer else 1 if cfg.k_eq_v and not self.sliding else 2
        q_rows = 2 * self.q_size if cfg.attn_gate else self.q_size  # Qwen3.5: each head's q rows, then its gate's
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_rows + self.kv_parts * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.rope = layer not in cfg.no_rope_layers
        if cfg.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))
        if cfg.qk_norm:  # "head": one norm shared by every head; "full": over all heads at once (OLMo 2)
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if full else hd, cfg.rms_norm_eps, cfg.norm_offset)
            if self.kv_parts:
                self.k_norm = RMSNorm(self.kv_size if full else hd, cfg.rms_norm_eps, cfg.norm_offset)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, H] -> (q, k, v [B, T, (heads | kv heads) * hd] side by side, q/k norms applied; k, v absent in a
        layer reading another's K/V), the output gate [B, T, heads * hd] or None."""
        c, hd = self.cfg, self.head_dim
        qkv = self.qkv_proj(x)  # [B, T, q + parts * kv]
        gate = None
        if c.attn_gate:  # [B, T, heads * 2 hd + 2 kv]: per head its q then its gate
            q_gate, kv = qkv.split([2 * self.q_size, 2 * self.kv_size], dim=-1)
            q, gate = q_gate.unflatten(-1, (c.num_heads, 2 * hd)).split(hd, dim=-1)
            qkv, gate = torch.cat([q.flatten(-2), kv], dim=-1), gate.flatten(-2)
        if self.kv_parts == 1:  # values are the keys' projection (normed apart below)
            qkv = torch.cat([qkv, qkv[..., self.q_size :]], dim=-1)
        if not c.qk_norm and not c.v_norm:
            return qkv, gate
        q = qkv[..., : self.q_size]
        k, v = qkv[..., self.q_size :].split(self.kv_size, dim=-1) if self.kv_parts else (None, None)
        heads = lambda t: t.unflatten(-1, (-1, hd))  # noqa: E731
        if c.qk_norm == "head":  # each head of q and k before rotary, as the C layer (`runtime/layer_kernel.py`)
            q = self.q_norm(heads(q)).flatten(-2)
            k = None if k is None else self.k_norm(heads(k)).flatten(-2)
        elif c.qk_norm == "full":  # all heads at once, before rotary
            q, k = self.q_norm(q), None if k is None else self.k_norm(k)
        if c.v_norm and v is not None:
            v = rms(heads(v), c.rms_norm_eps).flatten(-2)
        qkv = torch.cat([t for t in (q, k, v) if t is not None], dim=-1)  # (not in place: heads train through it)
        return qkv, gate

    def forward(self, x: torch.Tensor, batch: "Batch", cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        c, hd = self.cfg, self.head_dim
        qkv, gate = self._project(x)
        cos, sin = batch.rotary(self.sliding)
        heads = c.num_heads + (self.kv_heads if self.kv_parts else 0)
        roped = self.rope and small_ops.rope_(qkv, heads, hd, cos, sin)
        q = qkv[..., : self.q_size]
        q = q.reshape(B, T, c.num_heads, hd).transpose(1, 2)  # [B, heads, T, hd]
        if self.rope and not roped:
            q = apply_rotary(q, cos, sin)
        if self.kv_parts:
            k, v = qkv[..., self.q_size :].split(self.kv_size, dim=-1)
            k = k.reshape(B, T, self.kv_heads, hd).transpose(1, 2)  # [B, kv_heads, T, hd]
            v = v.reshape(B, T, self.kv_heads, hd).transpose(1, 2)
            if self.rope and not roped:
                k = apply_rotary(k, cos, sin)
            cache.write(self.layer, batch.slots, batch.cache_index, k, v, batch.write_span)
        keys, values = cache.read(self.kv_layer, batch.slots, batch.kv_len)  # [B, kv_heads, S, hd]
        mask = batch.local_mask if self.sliding and batch.local_mask is not None else batch.mask
        out = attention(q, keys, values, mask, c.attn_scale, c.attn_softcap, getattr(self, "sinks", None))
        out = out.reshape(B, T, c.num_heads * hd)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, without a weight (Gemma 4's value norm; as `RMSNorm` with weight 1, whose
    C form the C layer shares)."""
    fast = small_ops.rms_norm(x, torch.ones(x.shape[-1]), eps)
    if fast is not None:
        return fast
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        b, f = cfg.mlp_bias, width or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * f, bias=b)  # gate, up fused
        self.down_proj = nn.Linear(f, cfg.hidden_size, bias=b)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.gelu))


def gated(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """act(gate) * up of a fused [..., 2F] gate/up projection: SiLU (SwiGLU), or tanh-GELU (Gemma's GeGLU)."""
    act = small_ops.gelu_mul(gate_up) if gelu else small_ops.silu_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    return act


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of a fused [..., 2F] gate/up: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), where
    g = min(gate, limit)."""
    act = small_ops.swiglu_limit(gate_up, limit, alpha)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return act


class ExpertMath:
    """What every expert of a layer does around its two matrices: biases (gpt-oss; `gate_up_bias` [E, 2F] and
    `down_bias` [E, H], or None, set by the subclass) and the activation."""

    limit: float | None = None  # gpt-oss's clamped SwiGLU (`clamped_swiglu`), None: act(gate) * up
    alpha: float = 1.702
    gelu: bool = False  # act: tanh-GELU (Gemma 4), else SiLU

    def configure(self, cfg: ModelConfig) -> None:
        self.limit, self.alpha, self.gelu = cfg.swiglu_limit, cfg.swiglu_alpha, cfg.hidden_act == "gelu_tanh"

    def activate(self, expert: int, gate_up: torch.Tensor) -> torch.Tensor:
        """The expert's gate/up outputs [n, 2F] (plus its bias) -> the down projection's input [n, F]."""
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[expert]
        return gated(gate_up, self.gelu) if self.limit is None else clamped_swiglu(gate_up, self.limit, self.alpha)

    def finish(self, expert: int, y: torch.Tensor) -> torch.Tensor:
        """The down projection's output [n, H], plus the expert's bias."""
        return y if self.down_bias is None else y + self.down_bias[expert]

    def mixture(self, rows: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Rows [N, H] through their chosen experts [N, k], weighted [N, k], summed into zeros in ascending expert
        order -> [N, H]: a row's result does not depend on the rows beside it (`MoE`)."""
        out = torch.zeros_like(rows)
        if len(rows) == 1:  # a decode step: every chosen expert takes the one row (GGUF: their gate/up in one call)
            order = chosen[0].argsort()
            for y, w in zip(self.shared(chosen[0, order].tolist(), rows), weights[0, order]):
                out += y * w
            return out
        for e in chosen.unique().tolist():  # ascending
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self(e, rows[token]) * weights[token, slot, None])
        return out


class Experts(ExpertMath, nn.Module):
    """A layer's experts as 3-D weights: gate_up_proj [E, 2F, H] (each expert's gate rows, then its up rows),
    down_proj [E, H, F] (transformers' Qwen3-MoE layout); gpt-oss's biases [E, 2F] and [E, H]."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self.gate_up_bias = None if gate_up_bias is None else nn.Parameter(gate_up_bias, requires_grad=False)
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias, requires_grad=False)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s MLP over rows x [n, H] -> [n, H]."""
        act = self.activate(expert, F.linear(x, self.gate_up_proj[expert]))
        return self.finish(expert, F.linear(act, self.down_proj[expert]))

    def shared(self, experts: list[int], x: torch.Tensor) -> list[torch.Tensor]:
        """Each of `experts` over the same rows x [n, H] -> [n, H] each."""
        return [self(e, x) for e in experts]

    def kernel_parts(self) -> None:
        """Dense experts: none for the C layer kernel (GGUF ones: `GGUFExperts.kernel_parts`)."""
        return None


def row_by_row(linear: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """A small dense projection (a router, a gate) of rows [N, H] -> [N, out], one matrix-vector product per row, so a
    row's result does not depend on the rows beside it (row counts can change a matmul's bits); a GGUF one
    (`GGUFLinear`, no .weight) goes through the block kernels, whose rows are independent already."""
    if not isinstance(linear, nn.Linear):
        return linear(rows)
    w = linear.weight
    out = torch.stack([torch.mv(w, r) for r in rows]) if len(rows) else rows.new_zeros(0, w.shape[0])
    return out if linear.bias is None else out + linear.bias


class MoE(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE): the router `gate` scores the experts of each token, the top
    `experts_per_token` of the softmax run, weighted (renormalised to 1 with `norm_topk`). Each chosen expert runs
    once over the rows that chose it, experts nobody chose are not touched, and each token sums its experts' outputs
    in expert order: its result does not depend on the rows beside it. Gemma 4's router ("scaled") scores the rows
    RMS-normalised times `scale` / sqrt(hidden) and weights each expert by its `per_expert_scale` too."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        e, f, h = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
        biases = (torch.empty(e, 2 * f), torch.empty(e, h)) if cfg.expert_bias else ()
        self.experts = Experts(torch.empty(e, 2 * f, h), torch.empty(e, h, f), *biases)
        self.experts.configure(cfg)
        self.top_k, self.norm_topk, self.router = cfg.experts_per_token, cfg.norm_topk, cfg.router
        if cfg.shared_expert_intermediate_size:  # Qwen3.5-MoE
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        if cfg.router == "scaled":
            self.scale = nn.Parameter(torch.ones(h))
            self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, expert_norm: nn.Module | None = None) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; `expert_norm`: the experts take expert_norm(x), the router x (Gemma 4)."""
        rows = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, chosen = self.route(rows)  # [N, k] each
        out = self.experts.mixture(rows if expert_norm is None else expert_norm(rows), weights, chosen)
        if hasattr(self, "shared_expert"):
            out = self._shared(rows) + out
        return out.reshape(x.shape)

    def _shared(self, rows: torch.Tensor) -> torch.Tensor:
        """The shared expert's output [N, H] times its gate, sigmoid(shared_expert_gate(row)), the sigmoid in float64
        (torch's vectorized float32 loop takes a tensor's tail another way; rounded to float32, a row's value does not
        depend on the rows beside it)."""
        g = row_by_row(self.shared_expert_gate, rows)  # [N, 1]
        return self.shared_expert(rows) * torch.sigmoid(g.double()).to(rows.dtype)

    def kernel_router(self) -> small_ops.RouterParts | None:
        """The router as `small_ops.route` and the C layer take it, or None where it runs in torch only (a
        GGUF-quantized one)."""
        gate = self.gate
        if not isinstance(gate, nn.Linear) or self.router not in small_ops.ROUTERS:
            return None
        bias = None if gate.bias is None else gate.bias.detach()
        parts = small_ops.RouterParts(gate.weight.detach(), bias, self.top_k, self.router, self.norm_topk)
        if self.router == "scaled":  # the products the torch path below multiplies by
            parts.in_scale = (self.scale * gate.in_features**-0.5).detach()
            parts.expert_scale, parts.eps = self.per_expert_scale.detach(), self.eps
        return parts

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in the rows' dtype, expert ids [N, k]) of each row's top-k experts."""
        scaled = self.router == "scaled"
        r = self.kernel_router()
        fast = None if r is None else small_ops.route(rows, r)
        if fast is not None:  # the C router, which the C layer runs too
            return fast
        logits = row_by_row(self.gate, rms(rows, self.eps) * (self.scale * rows.shape[-1] ** -0.5) if scaled else rows)
        if self.router == "topk_softmax":  # gpt-oss: the top k logits, softmaxed
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(rows.dtype), chosen
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if scaled:
            weights = weights * self.per_expert_scale[chosen]
        return weights.to(rows.dtype), chosen


class DecoderLayer(nn.Module):
    """Attention then MLP, each `x + scale * after(f(before(x)))` with the family's norms around f (`cfg.norms`):
    pre (Llama): before = input_layernorm / post_attention_layernorm; sandwich (Gemma): also after =
    post_attention_layernorm / post_feedforward_layernorm, before the MLP pre_feedforward_layernorm; post (OLMo 2):
    after only. The names are the checkpoints'."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.linear = cfg.linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer)
        self.index = layer
        self.mlp = MoE(cfg) if cfg.moe(layer) and not cfg.moe_beside_mlp else MLP(cfg, cfg.mlp_size(layer))
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        if cfg.moe(layer) and cfg.moe_beside_mlp:  # Gemma 4: the experts beside the MLP, each with its norms
            self.moe = MoE(cfg)
            self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_2 = norm(), norm()
            self.post_feedforward_layernorm_1 = norm()
        if cfg.per_layer_dim:  # Gemma 4: gate(x) times this layer's per-layer input, projected back, added
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, cfg.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(cfg.per_layer_dim, cfg.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
        if cfg.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        if cfg.norms != "post":
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if cfg.norms == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if cfg.norms != "pre":
            self.post_feedforward_layernorm = norm()
        self.norms, self.residual_scale = cfg.norms, cfg.residual_scale
        self._layer_kernel: tuple | None = None  # see _kernel

    def forward(self, x: torch.Tensor, batch: "Batch", cache: KVCache) -> torch.Tensor:
        if batch.fast is not None:  # float32 on the CPU, any row count: the layer in one C call where it runs there
            lk = self._kernel()
            experts = self._experts()
            out = None if lk is None else lk.run(x, batch.fast, cache, None if experts is None else experts.route)
            if out is not None:
                return out
        get = lambda name: getattr(self, name, None)  # noqa: E731
        if self.norms == "pre":
            around = ((get("input_layernorm"), None), (self.post_attention_layernorm, None))
        else:
            around = (
                (get("input_layernorm"), self.post_attention_layernorm),
                (get("pre_feedforward_layernorm"), self.post_feedforward_layernorm),
            )
        mixer = self.linear_attn if self.linear else self.self_attn
        x = self._block(x, lambda h: mixer(h, batch, cache), *around[0])
        if hasattr(self, "moe"):
            x = self._block(x, self._mlp_and_experts, None, self.post_feedforward_layernorm)
        else:
            x = self._block(x, self.mlp, *around[1])
        if batch.per_layer is not None:
            h = gated(torch.cat([self.per_layer_input_gate(x), batch.per_layer[:, :, self.index]], dim=-1), gelu=True)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x if get("layer_scalar") is None else x * self.layer_scalar

    def _mlp_and_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's feed-forward of x [B, T, H]: the MLP and the experts (routed on x itself), each normed."""
        h = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        return h + self.post_feedforward_layernorm_2(self.moe(x, self.pre_feedforward_layernorm_2))

    def _block(self, x: torch.Tensor, f, before: nn.Module | None, after: nn.Module | None) -> torch.Tensor:
        h = f(x if before is None else before(x))
        h = h if after is None else after(h)
        return x + (h if self.residual_scale == 1.0 else h * self.residual_scale)

    def _experts(self) -> MoE | None:
        """The layer's mixture of experts: its MLP, or (Gemma 4) the one beside it; None for a dense MLP."""
        return self.mlp if isinstance(self.mlp, MoE) else getattr(self, "moe", None)

    def _kernel(self) -> LayerKernel | None:
        """This layer's C form (`runtime.layer_kernel`), described once; None where it cannot run here (a recipe the
        C layer does not take, or weights the kernels do not take)."""
        if self.linear:
            return None
        a, m, get = self.self_attn, self.mlp, lambda name: getattr(self, name, None)  # noqa: E731
        moe, experts = isinstance(m, MoE), self._experts()
        after = self.norms != "pre"  # norms after attention and the MLP (Gemma's sandwich, OLMo 2)
        parts = {
            "norm1": get("input_layernorm"),
            "norm2": get("pre_feedforward_layernorm") if after else self.post_attention_layernorm,
            "qkv": a.qkv_proj,
            "o": a.o_proj,
            "gate_up": None if moe else m.gate_up_proj,
            "down": None if moe else m.down_proj,
            "q_norm": getattr(a, "q_norm", None),
            "k_norm": getattr(a, "k_norm", None),
            "attn_out_norm": self.post_attention_layernorm if after else None,
            "mlp_out_norm": self.post_feedforward_layernorm if after else None,
            "experts": None if experts is None else experts.experts,
            "sinks": getattr(a, "sinks", None),
            "out_scale": get("layer_scalar"),
            "expert_in_norm": get("pre_feedforward_layernorm_2"),
            "expert_out_norm": get("post_feedforward_layernorm_2"),
            "dense_out_norm": get("post_feedforward_layernorm_1"),
            "pl_gate": get("per_layer_input_gate"),
            "pl_proj": get("per_layer_projection"),
            "pl_norm": get("post_per_layer_input_norm"),
            "router": None if experts is None else experts.gate,
        }
        built = self._layer_kernel  # (the modules it was built from, the C form or None)
        if built is None or any(x is not y for x, y in zip(built[0], parts.values())):  # first use, or one replaced
            experts = None if parts["experts"] is None else parts["experts"].kernel_parts()
            router = None if parts["router"] is None else self._experts().kernel_router()
            kernel = None
            if parts["experts"] is None or experts is not None:
                kernel = LayerKernel.of(
                    a.cfg, self.index, LayerParts(**{**parts, "experts": experts, "router": router})
                )
            built = self._layer_kernel = (tuple(parts.values()), kernel)
        return built[1]

    def _apply(self, fn, recurse=True):  # weights moved or converted: describe them again at the next step
        self._layer_kernel = None
        return super()._apply(fn, recurse)


class Embedding(nn.Embedding):
    """nn.Embedding without its random init on the meta device (where a model is built before its weights are
    loaded): there torch's normal_ imports torch._dynamo, 0.85 s a process (`with torch.device("meta"):
    nn.Embedding(1000, 64)`), which nothing else needs."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if cfg.per_layer_dim:  # Gemma 4's per-layer inputs (`Transformer.per_layer_inputs`)
            n = cfg.num_layers * cfg.per_layer_dim
            self.embed_tokens_per_layer = Embedding(cfg.per_layer_vocab, n)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, n, bias=False)
            self.per_layer_projection_norm = RMSNorm(cfg.per_layer_dim, cfg.rms_norm_eps, cfg.norm_offset)


@dataclass
class Batch:
    """Per-forward inputs shared by every layer."""

    slots: torch.Tensor  # [B] cache row of each sequence
    cache_index: torch.Tensor  # [B, T] where each token's K/V is written
    cos: torch.Tensor  # [B, 1, T, hd]
    sin: torch.Tensor  # [B, 1, T, hd]
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool (True = attend), None = attend to all
    kv_len: int  # keys read per sequence
    write_span: tuple[int, int, int] | None  # (slot, start, end) for a contiguous single-sequence write
    fast: StepArgs | None = None  # the step as the C decoder layers take it (`layer_kernel.step_args`)
    local_mask: torch.Tensor | None = None  # [B, 1, T, kv_len] the mask of sliding-window layers, where it differs
    cos_local: torch.Tensor | None = None  # [B, 1, T, hd] sliding layers' own rotary tables (Gemma 3), or None
    sin_local: torch.Tensor | None = None
    per_layer: torch.Tensor | None = None  # [B, T, layers, per_layer_dim] Gemma 4's per-layer inputs, or None

    def rotary(self, sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for a layer: its own tables where sliding layers have them."""
        return (self.cos_local, self.sin_local) if sliding and self.cos_local is not None else (self.cos, self.sin)

    def to(self, device: torch.device) -> "Batch":
        """The same batch with its tensors on `device` (a model split across devices)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(
            move(self.slots),
            move(self.cache_index),
            move(self.cos),
            move(self.sin),
            move(self.mask),
            self.kv_len,
            self.write_span,
            None,
            move(self.local_mask),
            move(self.cos_local),
            move(self.sin_local),
            move(self.per_layer),
        )


FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "linear_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
}


# per-layer tensors named apart from the checkpoints' (gpt-oss's router and its sinks, which the GGUF names give a
# .weight suffix) -> our names
RENAMED = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.bias": "mlp.gate.bias",
    "self_attn.sinks.weight": "self_attn.sinks",
    "linear_attn.dt_proj.bias": "linear_attn.dt_bias",
    "router.proj.weight": "moe.gate.weight",  # Gemma 4's router and experts beside its MLP
    "router.scale": "moe.scale",
    "router.per_expert_scale": "moe.per_expert_scale",
    "experts.gate_up_proj": "moe.experts.gate_up_proj",
    "experts.down_proj": "moe.experts.down_proj",
    "layer_scalar.weight": "layer_scalar",  # ... as a GGUF names them
    "router.proj.scale": "moe.scale",
    "experts.down_proj.scale": "moe.per_expert_scale",
    "experts.gate_up_proj.weight": "moe.experts.gate_up_proj.weight",
    "experts.down_proj.weight": "moe.experts.down_proj.weight",
}


def our_name(name: str) -> str:
    """A checkpoint's parameter name as this module names it (`RENAMED`)."""
    head, _, rest = name.partition(".layers.")
    layer, _, sub = rest.partition(".")
    return f"{head}.layers.{layer}.{RENAMED[sub]}" if sub in RENAMED else name


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Rewrite a Hugging Face state dict in place to the fused names this module uses."""
    for name in [n for n in state if our_name(n) != n]:
        state[our_name(name)] = state.pop(name)
    for i in range(num_layers):
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                if all(n in state for n in names) or (fused == "self_attn.qkv_proj" and names[0] in state):
                    # (attention without its own v or k and v: Gemma 4's full and K/V-sharing layers)
                    state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names if n in state])
        for where in ("mlp", "moe"):
            _fuse_experts(state, f"model.layers.{i}.{where}.experts.")
        conv = f"model.layers.{i}.linear_attn.conv1d.weight"
        if conv in state and state[conv].dim() == 3:  # HF's Conv1d [C, 1, K] -> [C, K]
            state[conv] = state[conv][:, 0]
    return state


def _fuse_experts(state: dict[str, torch.Tensor], prefix: str) -> None:
    """Experts as `Experts` holds them: per-expert matrices (`experts.{e}.gate_proj.weight`, checkpoints on the hub),
    3-D ones (`experts.gate_proj.weight` and `.bias`, a GGUF's) or gpt-oss's (`experts.gate_up_proj` [E, H, 2F], gate
    and up interleaved, with `_bias`) -> `experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F] and the
    biases."""
    if f"{prefix}gate_up_proj_bias" in state:  # gpt-oss's layout
        w, b = state.pop(f"{prefix}gate_up_proj"), state.pop(f"{prefix}gate_up_proj_bias")
        state[f"{prefix}gate_up_proj"] = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        state[f"{prefix}gate_up_bias"] = torch.cat([b[..., ::2], b[..., 1::2]], dim=-1)
        state[f"{prefix}down_proj"] = state.pop(f"{prefix}down_proj").transpose(1, 2).contiguous()
        state[f"{prefix}down_bias"] = state.pop(f"{prefix}down_proj_bias")
        return
    for part in ("gate_proj", "up_proj", "down_proj"):
        ends = f".{part}.weight"
        per = sorted(
            (int(e), k)
            for k in state
            if k.startswith(prefix) and k.endswith(ends) and (e := k[len(prefix) : -len(ends)]).isdigit()
        )
        if per:
            state[f"{prefix}{part}.weight"] = torch.stack([state.pop(k) for _, k in per])
    if f"{prefix}gate_up_proj.weight" in state:  # fused and 3-D already, as a GGUF names them (Gemma 4)
        for part in ("gate_up_proj", "down_proj"):
            state[f"{prefix}{part}"] = state.pop(f"{prefix}{part}.weight")
    if f"{prefix}gate_proj.weight" in state:
        gate, up = state.pop(f"{prefix}gate_proj.weight"), state.pop(f"{prefix}up_proj.weight")
        state[f"{prefix}gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[f"{prefix}down_proj"] = state.pop(f"{prefix}down_proj.weight")
    if f"{prefix}gate_proj.bias" in state:
        gate, up = state.pop(f"{prefix}gate_proj.bias"), state.pop(f"{prefix}up_proj.bias")
        state[f"{prefix}gate_up_bias"] = torch.cat([gate, up], dim=1)
        state[f"{prefix}down_bias"] = state.pop(f"{prefix}down_proj.bias")


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.use_context(cfg.max_position_embeddings)
        with torch.device("cpu"):  # tables are built on the host even when the model is created on meta
            self.rotary_local = (
                None
                if cfg.rope_local_theta is None
                else Rotary(cfg.rope_dim_of(True), cfg.rope_local_theta, None, cfg.max_position_embeddings)
            )
        self.split = False  # layers on more than one device (`place`)

    def use_context(self, context: int) -> None:
        """Rotary tables for a model that runs at `context` tokens (longrope picks its factors by it)."""
        c = self.config
        with torch.device("cpu"):
            rotary = Rotary(
                c.rope_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, c.rope_freq_factors, context
            )
        old = getattr(self, "rotary", None)
        if old is None or not torch.equal(rotary.inv_freq, old.inv_freq):
            self.rotary = rotary

    def recurrent_states(self) -> RecurrentStates | None:
        """Empty states for this model's linear-attention layers (None: it has none)."""
        shapes = {i: layer.linear_attn.state_shape for i, layer in enumerate(self.model.layers) if layer.linear}
        return RecurrentStates(shapes) if shapes else None

    def keep_head_rows(self, n: int) -> None:
        """Compute logits for the first `n` token ids only, 0: all of them again (a draft model's reduced
        vocabulary: its LM head reads n rows per token; the embedding table keeps every row)."""
        if not hasattr(self, "_whole_head"):
            self._whole_head = [self.lm_head]  # a list: not a second registered module
        head = self._whole_head[0]
        if n == 0 or n >= head.out_features:
            self.lm_head = head
        elif hasattr(head, "first_outputs"):  # GGUF blocks, int8 / int4 (runtime.quant)
            self.lm_head = head.first_outputs(n)
        else:
            self.lm_head = nn.Linear(
                head.in_features, n, bias=False, device=head.weight.device, dtype=head.weight.dtype
            )
            self.lm_head.weight = nn.Parameter(head.weight[:n], requires_grad=False)

    def place(self, devices: dict[str, str]) -> "Transformer":
        """Move parts to devices: {"model.embed_tokens" | "model.layers.i" | "model.norm" | "lm_head": device}
        (`runtime.placement.Placement.module_devices`). Hidden states cross devices once per split."""
        embed = self.model.embed_tokens.weight
        tied = getattr(self.lm_head, "weight", None) is embed  # (a GGUF head has no weight)
        if tied and devices.get("lm_head") != devices.get("model.embed_tokens"):
            # a tied head on another device: its own copy first (moving a shared parameter moves it for both)
            self.lm_head.weight = nn.Parameter(embed.detach().clone(), requires_grad=False)
        for name, device in devices.items():
            self.get_submodule(name).to(device)
        head = self.model.norm.weight.device  # the final norm goes with the LM head
        for rotary in (self.rotary, self.rotary_local):
            if rotary is not None:
                rotary.cos, rotary.sin = rotary.cos.to(self.device), rotary.sin.to(self.device)
        self.split = len({str(d) for d in self.layer_devices} | {str(self.device), str(head)}) > 1
        return self

    def first_layers(self, n: int) -> "Transformer":
        """A view of this model with its first `n` decoder layers only, then the same final norm and LM head
        (every weight shared, nothing copied): the early-exit draft model."""
        backbone = copy.copy(self.model)
        backbone._modules = dict(self.model._modules)
        backbone.layers = self.model.layers[:n]
        view = copy.copy(self)
        view._modules = dict(self._modules)
        view.model, view.config = backbone, replace(self.config, num_layers=n)
        return view

    @property
    def device(self) -> torch.device:
        """Where inputs go: the token embeddings' device."""
        return self.model.embed_tokens.weight.device

    @property
    def layer_devices(self) -> list[torch.device]:
        return [next(layer.parameters()).device for layer in self.model.layers]

    def layers_in_c(self, rows: int) -> bool:
        """Whether a forward of `rows` query rows in all runs every decoder layer in one C call (`layer_kernel`):
        float32 on the CPU, GGUF weights, not split (with fast prefill: up to its kernel rows). There each row's result
        is independent of how rows are grouped into sequences, so ragged chunks can go one row per entry."""
        if self.split or self.device.type != "cpu" or self.model.embed_tokens.weight.dtype != torch.float32:
            return False
        return K.kernels_take(rows) and all(k is not None for k in self._kernels())

    def _kernels(self) -> list[LayerKernel | None]:
        """Each decoder layer's C form (`DecoderLayer._kernel`), None where a layer has none."""
        return [layer._kernel() for layer in self.model.layers]

    def _stack(self, cache: KVCache) -> LayerStack | None:
        """Every decoder layer in one C call (`layer_kernel.LayerStack`), rebuilt when a layer or the cache changed;
        None where a layer cannot run in C."""
        kernels = self._kernels()
        stack = self.__dict__.get("_layer_stack")
        if stack is None or not stack.serves(kernels, cache):
            stack = self._layer_stack = LayerStack.of(kernels, cache)
        return stack

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        cache_index: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        resume: torch.Tensor | None = None,
        resume_layer: int = 0,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run a chunk of tokens through the model.

        tokens, positions: [B, T]; slots: [B]; cache_index: [B, T] (defaults to positions);
        mask: [B, 1, T, S] bool, default causal over cache positions; logits_index: [B', T'] which
        rows to project to logits (indices b * T + t into the B * T rows; default all).
        Returns logits [B', T', V] ([B, T, V] by default) in float32 and {i: hidden [B, T, H]} for i in
        `hidden_layers`, all T rows: hidden i = the residual stream entering decoder layer i (0 = the token
        embeddings, i = output of layer i - 1), and i = num_layers = the input of the final norm (the last
        hidden state, pre-norm).
        The tensors are the forward's own activations (no copies).
        resume [B, T, H]: the residual stream entering layer `resume_layer`, computed before (with the K/V of the
        layers below it in the cache already): the forward starts there, and `hidden_layers` below it are absent.
        """
        cache_index = positions if cache_index is None else cache_index
        kv_len = int(cache_index.max()) + 1
        if mask is None and tokens.numel() > 1:
            key_pos = torch.arange(kv_len, device=tokens.device)
            mask = (key_pos[None, None, :] <= cache_index[:, :, None]).unsqueeze(1)
        x = self.embed(tokens) if resume is None else resume
        cos, sin = self.rotary.tables(positions, x.dtype)
        batch = Batch(slots, cache_index, cos, sin, mask, kv_len, KVCache.span(slots, cache_index))
        batch.local_mask = self._local_mask(positions, mask, kv_len)
        if self.rotary_local is not None:
            batch.cos_local, batch.sin_local = self.rotary_local.tables(positions, x.dtype)
        if self.config.per_layer_dim:
            batch.per_layer = self.per_layer_inputs(tokens, self.embed(tokens) if resume is not None else x)
        batch.fast = None if self.split else step_args(x, batch)
        hidden: dict[int, torch.Tensor] = {}
        batches = {x.device: batch}
        stack = (
            self._stack(cache)
            if batch.fast is not None and resume is None and not any(i < len(self.model.layers) for i in hidden_layers)
            else None
        )
        out = None if stack is None else stack.run(x, batch.fast)
        for i, layer in enumerate(self.model.layers[resume_layer:] if out is None else (), start=resume_layer):
            if self.split:
                dev = cache.k[i].device
                x = x.to(dev)
                batch = batches.setdefault(dev, batch.to(dev))
            if i in hidden_layers:
                hidden[i] = x
            x = layer(x, batch, cache)
        x = x if out is None else out
        if self.split:
            x = x.to(self.lm_head.weight.device)
            logits_index = None if logits_index is None else logits_index.to(x.device)
        if len(self.model.layers) in hidden_layers:
            hidden[len(self.model.layers)] = x
        x = self.model.norm(x)
        if logits_index is not None:
            x = x.reshape(-1, x.shape[-1])[logits_index]
        return self.logits(x), hidden

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> the residual stream entering layer 0 [B, T, H] (token embeddings, times the family's
        scale)."""
        x = self.model.embed_tokens(tokens)
        scale = self.config.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [B, T, layers, P] of tokens [B, T] with embeddings x [B, T, H]: the token's row
        of the per-layer table (times sqrt(P)) and the normed projection of x (times 1 / sqrt(H)), averaged times
        sqrt(2)."""
        m, c = self.model, self.config
        split = lambda t: t.unflatten(-1, (c.num_layers, c.per_layer_dim))  # noqa: E731
        own = split(m.embed_tokens_per_layer(tokens) * torch.tensor(c.per_layer_dim**0.5, dtype=x.dtype))
        projected = m.per_layer_projection_norm(split(m.per_layer_model_projection(x) * c.hidden_size**-0.5))
        return (projected + own) * 2**-0.5

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [..., H] -> float32 logits [..., V] (the family's divisor and soft cap)."""
        c = self.config
        out = self.lm_head(x).float()
        if c.logit_divisor != 1.0:
            out = out / c.logit_divisor
        if c.final_softcap:
            out = torch.tanh(out / c.final_softcap) * c.final_softcap
        return out

    def _local_mask(self, positions: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
        """Sliding-window layers' mask [B, 1, T, kv_len]: `mask` (None: every key) and keys within the window of each
        query's position; None where no query reaches past its window (then `mask` serves every layer). A key's
        position is its cache slot (equal for committed tokens; a draft's slot is never below its position)."""
        w = self.config.sliding_window
        if w is None or int(positions.max()) < w:
            return None
        key_pos = torch.arange(kv_len, device=positions.device)
        near = (key_pos[None, None, :] > positions[:, :, None] - w).unsqueeze(1)  # [B, 1, T, kv_len]
        return near if mask is None else near & mask
