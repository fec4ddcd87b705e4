"""A decoder layer in one C call (`kernels/layer.c`) for decode and verification steps: float32 activations on the
CPU, GGUF weights through the kernels. It runs the same C functions in the same order as the layer's Python code
(norm, q/k/v + bias, q/k/v norms, rotary, K/V write, attention, o_proj (+ norm) + residual, norm, gate/up, SiLU or
tanh-GELU * up, down (+ norm) + residual), so the result is the same bits; at a few rows the Python between
those calls is a large share of a step (Zen 3: ~0.5 ms of a layer's ~4 ms).

`LayerKernel.of(...)` describes a layer's weights once (None where the layer cannot run here: not GGUF, a recipe it
does not take, not on the CPU, no library); `step_args(...)` describes a forward's rows once for every layer;
`run(...)` returns the layer's output, or None where the C path does not take this step (the caller then runs the
Python layer)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from specdec.runtime import kernels as K
from specdec.runtime import small_ops
from specdec.runtime.gguf_linear import GGUFConcatLinear, GGUFLinear, matmul_args

i64, ptr = ctypes.c_int64, ctypes.c_void_p
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # rows [N, H] -> (weights, experts) [N, k] each


class _Linear(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("types", ptr), ("w", ptr), ("outs", ptr), ("bias", ptr)]


class _Moe(ctypes.Structure):
    _fields_ = [
        ("n", i64),
        ("inter", i64),
        ("gate_up_types", ptr),
        ("gate_up_w", ptr),
        ("down_types", ptr),
        ("down_w", ptr),
        ("gate_up_bias", ptr),
        ("down_bias", ptr),
        ("limit", ctypes.c_float),
        ("alpha", ctypes.c_float),
    ]


class _Router(ctypes.Structure):
    _fields_ = [
        ("w", ptr),
        ("bias", ptr),
        ("in_scale", ptr),
        ("expert_scale", ptr),
        ("k", i64),
        ("kind", i64),
        ("norm", i64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("hidden", i64),
        ("heads", i64),
        ("kv_heads", i64),
        ("head_dim", i64),
        ("inter", i64),
        ("eps", ctypes.c_float),
        ("norm1", ptr),
        ("norm2", ptr),
        ("attn_out_norm", ptr),
        ("mlp_out_norm", ptr),
        ("q_norm", ptr),
        ("k_norm", ptr),
        ("v_norm", ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("moe", _Moe),
        ("sinks", ptr),
        ("sliding", i64),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("gelu", i64),
        ("kv_parts", i64),
        ("out_scale", ptr),
        ("expert_in_norm", ptr),
        ("expert_out_norm", ptr),
        ("dense_out_norm", ptr),
        ("pl_gate", _Linear),
        ("pl_proj", _Linear),
        ("pl_norm", ptr),
        ("pl_index", i64),
        ("pl_dim", i64),
        ("router", _Router),
        ("rope_dim", i64),
        ("qk_full", i64),
        ("residual_scale", ctypes.c_float),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("B", i64),
        ("T", i64),
        ("S", i64),
        ("cos", ptr),
        ("sin", ptr),
        ("kc", ptr),
        ("vc", ptr),
        ("sb", i64),
        ("sh", i64),
        ("slots", ptr),
        ("index", ptr),
        ("mask", ptr),
        ("local_mask", ptr),
        ("cos_local", ptr),
        ("sin_local", ptr),
        ("per_layer", ptr),
        ("per_layer_stride", i64),
    ]


def _parts(module) -> tuple[list[GGUFLinear], torch.Tensor | None] | None:
    if isinstance(module, GGUFConcatLinear):
        return list(module.parts), module.bias
    if isinstance(module, GGUFLinear):
        return [module], None if module.bias is None else module.bias.data
    return None


@dataclass
class ExpertParts:
    """A mixture of experts as the C layer takes it: each expert's [gate, up] and each one's down (GGUF matrices), and
    gpt-oss's biases and clamped SwiGLU around them (`transformer.ExpertMath`)."""

    gate_ups: list[list[GGUFLinear]]
    downs: list[GGUFLinear]
    gate_up_bias: torch.Tensor | None = None  # [E, 2F]
    down_bias: torch.Tensor | None = None  # [E, H]
    limit: float | None = None  # None: SiLU(gate) * up
    alpha: float = 1.702


@dataclass
class LayerParts:
    """A decoder layer's modules as the C layer takes them (norms: `RMSNorm`s; linear layers: GGUF matrices), None
    where the layer has none."""

    norm1: nn.Module | None  # before attention (OLMo 2: none)
    norm2: nn.Module | None  # before the MLP
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module | None = None  # None: experts
    down: nn.Module | None = None
    q_norm: nn.Module | None = None  # each head of q / k (Qwen3, Gemma 3), or all heads at once (OLMo 2)
    k_norm: nn.Module | None = None
    attn_out_norm: nn.Module | None = None  # after attention / after the MLP (Gemma's sandwich norms, OLMo 2's)
    mlp_out_norm: nn.Module | None = None
    experts: ExpertParts | None = None  # in place of gate_up and down, or (Gemma 4) beside them
    sinks: torch.Tensor | None = None  # [heads] gpt-oss's
    out_scale: torch.Tensor | None = None  # [1] Gemma 4's layer scalar
    expert_in_norm: nn.Module | None = None  # Gemma 4's experts beside the MLP: normed before and after, the MLP after
    expert_out_norm: nn.Module | None = None
    dense_out_norm: nn.Module | None = None
    pl_gate: nn.Module | None = None  # Gemma 4's per-layer input: its gate, projection and norm
    pl_proj: nn.Module | None = None
    pl_norm: nn.Module | None = None
    router: small_ops.RouterParts | None = None  # the experts' router where it runs in C: the layer in one call


def _recipe_runs(cfg, layer: int) -> bool:
    """Whether the C layer takes this layer's recipe: any of the norm placements (pre, sandwich, post), SiLU or
    tanh-GELU, q/k norms per head, over all heads or none, partial or no rotary, a residual scale; not Qwen3.5's gated
    and linear attention."""
    return cfg.hidden_act in ("silu", "gelu_tanh") and not cfg.attn_gate and not cfg.linear(layer)


def _weight(norm: nn.Module) -> torch.Tensor:
    """An `RMSNorm`'s multiplier as its forward computes it (Gemma's offset + weight)."""
    w = norm.weight.detach()
    return (norm.offset + w if norm.offset else w).contiguous()


class LayerKernel:
    """One decoder layer's weights as `gq_decoder_layer` takes them (the tensors and arrays kept alive here)."""

    def __init__(self, spec: _Layer, keep: list, kv_layer: int):
        self.spec, self.keep, self.kv_layer = spec, keep, kv_layer  # kv_layer: the layer whose K/V it reads

    @property
    def moe(self) -> bool:
        return self.spec.moe.n > 0

    @property
    def routed(self) -> bool:
        """Whether the layer's experts are routed in C: the whole layer is one call."""
        return bool(self.spec.router.w)

    @classmethod
    def of(cls, cfg, layer: int, parts: LayerParts) -> "LayerKernel | None":
        """The C layer for layer `layer`'s parts, or None where it cannot run them (the caller keeps its Python
        path)."""
        kv_heads, hd = cfg.attn_shape(layer)
        sliding, kv_layer = cfg.sliding(layer), cfg.kv_layer(layer)
        rope_dim = 0 if layer in cfg.no_rope_layers else cfg.rope_dim_of(sliding)
        kv_parts = 0 if kv_layer != layer else 1 if cfg.k_eq_v and not sliding else 2
        mlp = [] if parts.gate_up is None else [parts.gate_up, parts.down]
        beside = [parts.expert_in_norm, parts.expert_out_norm, parts.dense_out_norm]
        pl = [] if parts.pl_norm is None else [parts.pl_gate, parts.pl_proj]
        lins = [_parts(m) for m in [parts.qkv, parts.o, *mlp, *pl]]
        norms = [parts.norm1, parts.norm2, parts.attn_out_norm, parts.mlp_out_norm, parts.q_norm, parts.k_norm]
        tensors = [n.weight for n in norms + beside + [parts.pl_norm] if n is not None]
        tensors += [t for t in (parts.sinks, parts.out_scale) if t is not None]
        if (
            K.library() is None
            or not _recipe_runs(cfg, layer)
            or bool(cfg.qk_norm) != (parts.q_norm is not None)
            or bool(cfg.qk_norm and kv_parts) != (parts.k_norm is not None)
            or (cfg.norms == "post") != (parts.norm1 is None or parts.norm2 is None)
            or (pl and (parts.experts is not None or cfg.per_layer_dim % 8))
            or (cfg.norms != "pre") != (parts.attn_out_norm is not None and parts.mlp_out_norm is not None)
            or (cfg.moe(layer) and cfg.moe_beside_mlp) != all(n is not None for n in beside + mlp)
            or (parts.experts is None and not mlp)
            or any(x is None for x in lins)
            or hd % 16
            or rope_dim % 2
            or rope_dim > hd
            or any(t.dtype != torch.float32 or not t.is_cpu for t in tensors)
            or any(p.qweight.device.type != "cpu" for ps, _ in lins for p in ps)
            or (parts.experts is not None and not _experts_run(parts.experts))
        ):
            return None
        keep: list = [None if n is None else _weight(n) for n in norms]
        keep.append(torch.ones(hd) if cfg.v_norm else None)
        keep += [None if t is None else t.detach().contiguous() for t in (parts.sinks, parts.out_scale)]
        keep += [None if n is None else _weight(n) for n in beside + [parts.pl_norm]]
        addr = [None if t is None else t.data_ptr() for t in keep]
        structs = []
        none = [([], None)]
        for ps, bias in lins[:2] + (lins[2:4] or none * 2) + (lins[4:] or none * 2):  # no MLP / per-layer input
            n, types, weights, outs, _ = args = matmul_args(ps)
            b = None if bias is None else bias.detach().float().contiguous()
            keep += [args, b]
            structs.append(
                _Linear(n, *[ctypes.cast(a, ptr) for a in (types, weights, outs)], None if b is None else b.data_ptr())
            )
        spec = _Layer(
            cfg.hidden_size,
            cfg.num_heads,
            kv_heads,
            hd,
            cfg.mlp_size(layer),
            cfg.rms_norm_eps,
            *addr[:7],
            *structs[:4],
            _Moe() if parts.experts is None else _moe(parts.experts, keep),
            addr[7],
            int(sliding),
            1.0 / math.sqrt(hd) if cfg.attn_scale is None else cfg.attn_scale,
            cfg.attn_softcap or 0.0,
            int(cfg.hidden_act == "gelu_tanh"),
            kv_parts,
            *addr[8:12],
            *structs[4:],
            addr[12],
            layer,
            cfg.per_layer_dim,
            _router(parts.router, cfg.hidden_size, 0 if parts.experts is None else len(parts.experts.downs), keep),
            rope_dim,
            int(cfg.qk_norm == "full"),
            cfg.residual_scale,
        )
        return cls(spec, keep, kv_layer)

    def run(self, x: torch.Tensor, step: "StepArgs | None", cache, route: Route | None = None) -> torch.Tensor | None:
        """x [B, T, hidden] -> the layer's output, its K/V written to `cache`; None where the C path does not apply.
        A mixture of experts whose router does not run in C (a GGUF-quantized one): the attention half in C, `route`
        (the layer's router, in Python) on its MLP input (Gemma 4: on the attention half's output), then the experts
        in C."""
        if step is None or not x.is_contiguous():  # step: None where the kernels do not take these rows
            return None
        kc, vc = cache.k[self.kv_layer], cache.v[self.kv_layer]
        if kc.dtype != torch.float32 or not kc.is_cpu or kc.stride() != vc.stride() or kc.stride(-1) != 1:
            return None
        s = step.spec
        s.kc, s.vc, s.sb, s.sh = kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1)
        out, lib, threads, path = torch.empty_like(x), K.library(), torch.get_num_threads(), K.requested_path()
        spec, step_spec = ctypes.byref(self.spec), ctypes.byref(s)
        if not self.moe or self.routed:
            rc = lib.gq_decoder_layer(spec, step_spec, x.data_ptr(), out.data_ptr(), threads, path)
            return out if rc >= 0 else None
        h = torch.empty_like(x)
        if (
            route is None
            or lib.gq_attention_half(spec, step_spec, x.data_ptr(), out.data_ptr(), h.data_ptr(), threads, path) < 0
        ):
            return None
        routed = out if self.spec.expert_in_norm else h
        weights, chosen = route(routed.reshape(-1, x.shape[-1]))  # [rows, k] each
        return out if _moe_experts(self.spec, h.reshape(-1, x.shape[-1]), weights, chosen, out) >= 0 else None


class ExpertKernel:
    """A layer's experts in one C call (`gq_moe_experts`) where the rest of the layer runs Python (Qwen3.5-MoE), or a
    step the C layer does not take: the calls and order of `ExpertMath.mixture`, at one Python call per layer."""

    def __init__(self, spec: _Layer, keep: list):
        self.spec, self.keep = spec, keep

    @classmethod
    def of(cls, experts: ExpertParts, hidden: int, gelu: bool) -> "ExpertKernel | None":
        """The C form of these experts over rows of `hidden`, or None where the kernels do not take them."""
        if K.library() is None or not _experts_run(experts):
            return None
        keep: list = []
        spec = _Layer(hidden=hidden, gelu=int(gelu))
        spec.moe = _moe(experts, keep)
        return cls(spec, keep)

    def run(self, rows: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """rows [N, H], their experts chosen [N, k] weighted [N, k] -> the weighted sum [N, H], or None where the C
        path does not apply (not float32 on the CPU, gradients wanted)."""
        if rows.dtype != torch.float32 or not rows.is_cpu or torch.is_grad_enabled() or not K.kernels_take(len(rows)):
            return None
        x = rows.contiguous()
        out = torch.zeros_like(x)
        return out if _moe_experts(self.spec, x, weights, chosen, out) >= 0 else None


def _moe_experts(
    spec: _Layer, rows: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor
) -> int:
    """`gq_moe_experts`: out [N, H] += the layer's experts over contiguous rows [N, H], each row's chosen [N, k]
    weighted [N, k] (and Gemma 4's rest of the MLP half); the kernels' path or a negative error."""
    w, idx = weights.float().contiguous(), chosen.to(torch.int64).contiguous()
    return K.library().gq_moe_experts(
        ctypes.byref(spec),
        rows.data_ptr(),
        len(rows),
        idx.shape[1],
        idx.data_ptr(),
        w.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
        K.requested_path(),
    )


def _experts_run(experts: ExpertParts) -> bool:
    """Whether the C layer takes these experts: GGUF matrices on the CPU, float32 biases there, widths its activation
    kernels take (as `small_ops.silu_mul` and `small_ops.swiglu_limit`, whose bits the Python path has)."""
    parts = [p for gu in experts.gate_ups for p in gu] + list(experts.downs)
    biases = [b for b in (experts.gate_up_bias, experts.down_bias) if b is not None]
    return (
        all(len(gu) == 2 for gu in experts.gate_ups)
        and all(p.qweight.device.type == "cpu" and p.bias is None for p in parts)
        and all(b.dtype == torch.float32 and b.is_cpu for b in biases)
        and experts.gate_ups[0][0].out_features % 8 == 0
    )


def _moe(experts: ExpertParts, keep: list) -> _Moe:
    """The experts as `moe_t`: arrays of each one's gate and up, and of each one's down, their biases (kept alive in
    `keep`)."""
    flat = [p for gu in experts.gate_ups for p in gu]
    downs = experts.downs
    arrays = [
        (ctypes.c_int * len(flat))(*[p.qtype for p in flat]),
        (ptr * len(flat))(*[p.qweight.data_ptr() for p in flat]),
        (ctypes.c_int * len(downs))(*[p.qtype for p in downs]),
        (ptr * len(downs))(*[p.qweight.data_ptr() for p in downs]),
    ]
    biases = [None if b is None else b.detach().contiguous() for b in (experts.gate_up_bias, experts.down_bias)]
    keep += arrays + biases
    return _Moe(
        len(downs),
        flat[0].out_features,
        *[ctypes.cast(a, ptr) for a in arrays],
        *[None if b is None else b.data_ptr() for b in biases],
        experts.limit or 0.0,
        experts.alpha,
    )


def _router(router: small_ops.RouterParts | None, hidden: int, n: int, keep: list) -> _Router:
    """The router as `router_t` (its tensors kept alive in `keep`), or all zeros where it does not run in C."""
    if router is None or tuple(router.weight.shape) != (n, hidden) or not small_ops.router_runs(router):
        return _Router()
    tensors = router.tensors()
    keep += tensors
    addr = [None if t is None else t.data_ptr() for t in tensors]
    return _Router(*addr, router.k, small_ops.ROUTERS[router.router], router.norm)


def _read(kernels: list[LayerKernel], cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K and V cache tensors each layer reads (its own, or the layer's whose K/V it shares)."""
    return [cache.k[k.kv_layer] for k in kernels], [cache.v[k.kv_layer] for k in kernels]


class LayerStack:
    """Every decoder layer in one C call (`gq_decoder_stack`), where each would run in C on its own (`LayerKernel.run`)
    and routes its experts, if any, in C:
    the layers' descriptions and their caches' addresses, built once per model and cache; at a few rows the Python
    around 28 layer calls is a measurable share of a decode step."""

    def __init__(self, kernels: list[LayerKernel], cache):
        n = len(kernels)
        self.kernels, self.cache = kernels, cache
        self.specs = (ptr * n)(*[ctypes.addressof(k.spec) for k in kernels])
        ks, vs = _read(kernels, cache)
        self.kc, self.vc = ((ptr * n)(*[t.data_ptr() for t in ts]) for ts in (ks, vs))
        self.sb, self.sh = ((i64 * n)(*[t.stride(d) for t in ks]) for d in (0, 1))

    @classmethod
    def of(cls, kernels: list, cache) -> "LayerStack | None":
        if (
            not kernels
            or any(k is None or (k.moe and not k.routed) for k in kernels)  # routed in Python between two calls
            or len(cache.k) != len(kernels)
            or any(k.stride() != v.stride() for k, v in zip(cache.k, cache.v))
            or any(t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1 for t in cache.k + cache.v)
        ):
            return None
        return cls(kernels, cache)

    def serves(self, kernels: list, cache) -> bool:
        """Whether this stack was built for these layers and this cache, as they are now."""
        return (
            cache is self.cache
            and len(kernels) == len(self.kernels)
            and all(a is b for a, b in zip(kernels, self.kernels))
            and all(
                t.data_ptr() == p for ts, ps in zip(_read(kernels, cache), (self.kc, self.vc)) for t, p in zip(ts, ps)
            )
        )

    def run(self, x: torch.Tensor, step: "StepArgs | None") -> torch.Tensor | None:
        """x [B, T, hidden] -> the last layer's output, every layer's K/V written; None where the C path does not
        take this step (the caller then runs the layers one by one, which write the same K/V again)."""
        if step is None or not x.is_contiguous():  # step: None where the kernels do not take these rows
            return None
        out, tmp = torch.empty_like(x), torch.empty_like(x)
        rc = K.library().gq_decoder_stack(
            self.specs,
            len(self.kernels),
            ctypes.byref(step.spec),
            self.kc,
            self.vc,
            self.sb,
            self.sh,
            x.data_ptr(),
            out.data_ptr(),
            tmp.data_ptr(),
            torch.get_num_threads(),
            K.requested_path(),
        )
        return out if rc >= 0 else None


class StepArgs:
    """A forward's rows as `gq_decoder_layer` takes them: the same for every layer (the cache pointers are set
    per layer)."""

    def __init__(self, batch, B: int, T: int):
        self.batch, self.B, self.T = batch, B, T

    @cached_property
    def spec(self) -> _Step:
        """Built at the first layer that runs in C (a model whose layers cannot pays nothing)."""
        batch, B, T = self.batch, self.B, self.T
        rows = lambda t: None if t is None else t.reshape(B * T, t.shape[-1]).contiguous()  # noqa: E731
        self.keep = [
            rows(batch.cos),
            rows(batch.sin),
            batch.slots.to(torch.int64).contiguous(),
            batch.cache_index.to(torch.int64).contiguous(),
            None if batch.mask is None else batch.mask.expand(B, 1, T, batch.kv_len).contiguous(),
            None if batch.local_mask is None else batch.local_mask.expand(B, 1, T, batch.kv_len).contiguous(),
            rows(batch.cos_local),
            rows(batch.sin_local),
            None if batch.per_layer is None else batch.per_layer.reshape(B * T, -1).contiguous(),
        ]
        c, s, slots, index, mask, local, c_local, s_local, per_layer = self.keep
        return _Step(
            B,
            T,
            batch.kv_len,
            c.data_ptr(),
            s.data_ptr(),
            None,
            None,
            0,
            0,
            slots.data_ptr(),
            index.data_ptr(),
            None if mask is None else mask.data_ptr(),
            None if local is None else local.data_ptr(),
            None if c_local is None else c_local.data_ptr(),
            None if s_local is None else s_local.data_ptr(),
            None if per_layer is None else per_layer.data_ptr(),
            0 if per_layer is None else per_layer.shape[1],
        )


def step_args(x: torch.Tensor, batch) -> StepArgs | None:
    """The step's description for the C layers, or None where they cannot take it (not float32 on the CPU,
    gradients wanted, more rows than fast prefill leaves to the kernels)."""
    B, T = x.shape[0], x.shape[1]
    if (
        x.dtype != torch.float32
        or not x.is_cpu
        or not K.kernels_take(B * T)
        or torch.is_grad_enabled()
        or batch.cos.dtype != torch.float32
        or K.library() is None
    ):
        return None
    return StepArgs(batch, B, T)
