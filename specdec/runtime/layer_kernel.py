"""A decoder layer in one C call (`kernels/layer.c`) for decode and verification steps: float32 activations on the
CPU, GGUF weights through the kernels. It runs the same C functions in the same order as the layer's Python code
(norm, q/k/v + bias, per-head q/k norms, rotary, K/V write, attention, o_proj + residual, norm, gate/up, SiLU * up,
down + residual), so the result is the same bits; at a few rows the Python between those calls is a large share of a
step (Zen 3: ~0.5 ms of a layer's ~4 ms).

`LayerKernel.of(...)` describes a layer's weights once (None where the layer cannot run here: not GGUF, OLMo 2's q/k
norms, not on the CPU, no library); `step_args(...)` describes a forward's rows once for every layer; `run(...)`
returns the layer's output, or None where the C path does not take this step (the caller then runs the Python
layer)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from specdec.runtime import kernels as K
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
        ("q_norm", ptr),
        ("k_norm", ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("moe", _Moe),
        ("sinks", ptr),
        ("sliding", i64),
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


class LayerKernel:
    """One decoder layer's weights as `gq_decoder_layer` takes them (the tensors and arrays kept alive here)."""

    def __init__(self, spec: _Layer, keep: list):
        self.spec, self.keep = spec, keep

    @property
    def moe(self) -> bool:
        return self.spec.moe.n > 0

    @classmethod
    def of(
        cls,
        cfg,
        norm1,
        norm2,
        qkv,
        o,
        gate_up,
        down,
        q_norm=None,
        k_norm=None,
        experts: ExpertParts | None = None,
        sinks: torch.Tensor | None = None,
        sliding: bool = False,
    ) -> "LayerKernel | None":
        """The C layer for these modules (q_norm, k_norm: per-head norms or None; experts: a mixture of experts in
        place of gate_up and down; sinks: gpt-oss's [heads]; sliding: a sliding-window layer), or None where it
        cannot run them (the caller keeps its Python path)."""
        mlp = [] if experts is not None else [gate_up, down]
        lins = [_parts(m) for m in [qkv, o, *mlp]]
        norms = tuple(n.weight for n in (norm1, norm2, q_norm, k_norm) if n is not None)
        if (
            K.library() is None
            or cfg.qk_norm not in ("", "head")
            or (cfg.qk_norm == "head") != (len(norms) == 4)
            or any(x is None for x in lins)
            or cfg.head_dim % 16
            or any(n.dtype != torch.float32 or not n.is_cpu for n in norms)
            or any(p.qweight.device.type != "cpu" for ps, _ in lins for p in ps)
            or (experts is not None and not _experts_run(experts))
            or (sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_cpu))
        ):
            return None
        keep: list = [n.detach().contiguous() for n in norms]
        sink = None if sinks is None else sinks.detach().contiguous()
        qk = [n.data_ptr() for n in keep[2:]] or [None, None]
        structs = []
        for ps, bias in lins + [([], None)] * (2 - len(mlp)):  # a mixture of experts: no dense gate_up, down
            n, types, weights, outs, _ = args = matmul_args(ps)
            b = None if bias is None else bias.detach().float().contiguous()
            keep += [args, b]
            structs.append(
                _Linear(n, *[ctypes.cast(a, ptr) for a in (types, weights, outs)], None if b is None else b.data_ptr())
            )
        spec = _Layer(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            norm1.eps,
            keep[0].data_ptr(),
            keep[1].data_ptr(),
            *qk,
            *structs,
            _Moe() if experts is None else _moe(experts, keep),
            None if sink is None else sink.data_ptr(),
            int(sliding),
        )
        return cls(spec, keep + [sink])

    def run(
        self, x: torch.Tensor, step: "StepArgs | None", layer: int, cache, route: Route | None = None
    ) -> torch.Tensor | None:
        """x [B, T, hidden] -> the layer's output, its K/V written to `cache`; None where the C path does not apply.
        A mixture of experts: the attention half in C, `route` (the layer's router, in Python) on its MLP input,
        then the experts in C."""
        if step is None or not x.is_contiguous():  # step: None where the kernels do not take these rows
            return None
        kc, vc = cache.k[layer], cache.v[layer]
        if kc.dtype != torch.float32 or not kc.is_cpu or kc.stride() != vc.stride() or kc.stride(-1) != 1:
            return None
        s = step.spec
        s.kc, s.vc, s.sb, s.sh = kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1)
        out, lib, threads, path = torch.empty_like(x), K.library(), torch.get_num_threads(), K.requested_path()
        spec, step_spec = ctypes.byref(self.spec), ctypes.byref(s)
        if not self.moe:
            rc = lib.gq_decoder_layer(spec, step_spec, x.data_ptr(), out.data_ptr(), threads, path)
            return out if rc >= 0 else None
        h = torch.empty_like(x)
        if (
            route is None
            or lib.gq_attention_half(spec, step_spec, x.data_ptr(), out.data_ptr(), h.data_ptr(), threads, path) < 0
        ):
            return None
        rows = h.reshape(-1, h.shape[-1])
        weights, chosen = route(rows)  # [rows, k] each
        w, idx = weights.float().contiguous(), chosen.to(torch.int64).contiguous()
        rc = lib.gq_moe_experts(
            spec,
            rows.data_ptr(),
            rows.shape[0],
            idx.shape[1],
            idx.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            threads,
            path,
        )
        return out if rc >= 0 else None


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


class LayerStack:
    """Every decoder layer in one C call (`gq_decoder_stack`), where each would run in C on its own (`LayerKernel.run`):
    the layers' descriptions and their caches' addresses, built once per model and cache; at a few rows the Python
    around 28 layer calls is a measurable share of a decode step."""

    def __init__(self, kernels: list[LayerKernel], cache):
        n = len(kernels)
        self.kernels, self.cache = kernels, cache
        self.specs = (ptr * n)(*[ctypes.addressof(k.spec) for k in kernels])
        self.kc, self.vc = ((ptr * n)(*[t.data_ptr() for t in ts]) for ts in (cache.k, cache.v))

    @classmethod
    def of(cls, kernels: list, cache) -> "LayerStack | None":
        k0 = cache.k[0]
        if (
            not kernels
            or any(k is None or k.moe for k in kernels)  # experts: routed in Python between two calls
            or len(cache.k) != len(kernels)
            or k0.stride(-1) != 1
            or any(t.dtype != torch.float32 or not t.is_cpu or t.stride() != k0.stride() for t in cache.k + cache.v)
        ):
            return None
        return cls(kernels, cache)

    def serves(self, kernels: list, cache) -> bool:
        """Whether this stack was built for these layers and this cache, as they are now."""
        return (
            cache is self.cache
            and len(kernels) == len(self.kernels)
            and all(a is b for a, b in zip(kernels, self.kernels))
            and all(t.data_ptr() == p for ts, ps in ((cache.k, self.kc), (cache.v, self.vc)) for t, p in zip(ts, ps))
        )

    def run(self, x: torch.Tensor, step: "StepArgs | None") -> torch.Tensor | None:
        """x [B, T, hidden] -> the last layer's output, every layer's K/V written; None where the C path does not
        take this step (the caller then runs the layers one by one, which write the same K/V again)."""
        if step is None or not x.is_contiguous():  # step: None where the kernels do not take these rows
            return None
        s, k0 = step.spec, self.cache.k[0]
        s.sb, s.sh = k0.stride(0), k0.stride(1)
        out, tmp = torch.empty_like(x), torch.empty_like(x)
        rc = K.library().gq_decoder_stack(
            self.specs,
            len(self.kernels),
            ctypes.byref(s),
            self.kc,
            self.vc,
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
        hd = batch.cos.shape[-1]
        self.keep = [
            batch.cos.reshape(B * T, hd).contiguous(),
            batch.sin.reshape(B * T, hd).contiguous(),
            batch.slots.to(torch.int64).contiguous(),
            batch.cache_index.to(torch.int64).contiguous(),
            None if batch.mask is None else batch.mask.expand(B, 1, T, batch.kv_len).contiguous(),
            None if batch.local_mask is None else batch.local_mask.expand(B, 1, T, batch.kv_len).contiguous(),
        ]
        c, s, slots, index, mask, local = self.keep
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
