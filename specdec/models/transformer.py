"""Decoder-only transformer for the Llama / Mistral / Qwen2 / Qwen3 families.

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
from specdec.models.rope import Rotary, apply_rotary
from specdec.runtime import small_ops
from specdec.runtime.attention import attention
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.layer_kernel import LayerKernel, LayerStack, StepArgs, step_args


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = small_ops.rms_norm(x, self.weight, self.eps)
        if fast is not None:
            return fast
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)  # q, k, v fused
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: "Batch", cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        c, hd = self.cfg, self.cfg.head_dim
        qkv = self.qkv_proj(x)  # [B, T, q + 2 kv]
        roped = not c.qk_norm and small_ops.rope_(qkv, c.num_heads + c.num_kv_heads, hd, batch.cos, batch.sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(B, T, c.num_heads, hd)
        k = k.reshape(B, T, c.num_kv_heads, hd)
        v = v.reshape(B, T, c.num_kv_heads, hd)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        if not roped:
            q, k = apply_rotary(q, batch.cos, batch.sin), apply_rotary(k, batch.cos, batch.sin)
        cache.write(self.layer, batch.slots, batch.cache_index, k, v, batch.write_span)
        keys, values = cache.read(self.layer, batch.slots, batch.kv_len)  # [B, kv_heads, S, hd]
        out = attention(q, keys, values, batch.mask)  # [B, T, heads, hd]
        return self.o_proj(out.reshape(B, T, c.num_heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = cfg.mlp_bias
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=b)  # gate, up fused
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = small_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._layer_kernel: tuple | None = None  # see _kernel

    def forward(self, x: torch.Tensor, batch: "Batch", cache: KVCache) -> torch.Tensor:
        if batch.fast is not None:  # decode / verification on the CPU: the whole layer in one C call, same bits
            lk = self._kernel()
            out = None if lk is None else lk.run(x, batch.fast, self.self_attn.layer, cache)
            if out is not None:
                return out
        x = x + self.self_attn(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _kernel(self) -> LayerKernel | None:
        """This layer's C form (`runtime.layer_kernel`), described once; None where it cannot run here."""
        a, m = self.self_attn, self.mlp
        modules = (self.input_layernorm, self.post_attention_layernorm, a.qkv_proj, a.o_proj, m.gate_up_proj,
                   m.down_proj)
        built = self._layer_kernel  # (the modules it was built from, the C form or None)
        if built is None or any(x is not y for x, y in zip(built[0], modules)):  # first use, or a module replaced
            built = self._layer_kernel = (modules, LayerKernel.of(a.cfg, *modules))
        return built[1]

    def _apply(self, fn, recurse=True):  # weights moved or converted: describe them again at the next step
        self._layer_kernel = None
        return super()._apply(fn, recurse)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class Batch:
    """Per-forward inputs shared by every layer."""
    slots: torch.Tensor        # [B] cache row of each sequence
    cache_index: torch.Tensor  # [B, T] where each token's K/V is written
    cos: torch.Tensor          # [B, 1, T, hd]
    sin: torch.Tensor          # [B, 1, T, hd]
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool (True = attend), None = attend to all
    kv_len: int                # keys read per sequence
    write_span: tuple[int, int, int] | None  # (slot, start, end) for a contiguous single-sequence write
    fast: StepArgs | None = None  # the step as the C decoder layers take it (`layer_kernel.step_args`)

    def to(self, device: torch.device) -> "Batch":
        """The same batch with its tensors on `device` (a model split across devices)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(move(self.slots), move(self.cache_index), move(self.cos), move(self.sin), move(self.mask),
                     self.kv_len, self.write_span)


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Rewrite a Hugging Face state dict in place to the fused names this module uses."""
    for i in range(num_layers):
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):  # tables are built on the host even when the model is created on meta
            self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.split = False  # layers on more than one device (`place`)

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
            self.lm_head = nn.Linear(head.in_features, n, bias=False, device=head.weight.device, dtype=head.weight.dtype)
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
        self.rotary.cos, self.rotary.sin = self.rotary.cos.to(self.device), self.rotary.sin.to(self.device)
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
        float32 on the CPU, GGUF weights, not split, at most the kernels' row count. There each row's result is
        independent of how rows are grouped into sequences, so ragged chunks can go one row per entry."""
        if self.split or self.device.type != "cpu" or self.model.embed_tokens.weight.dtype != torch.float32:
            return False
        return all(k is not None and k.takes(rows) for k in self._kernels())

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
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                cache_index: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                logits_index: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                resume: torch.Tensor | None = None,
                resume_layer: int = 0) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
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
        x = self.model.embed_tokens(tokens) if resume is None else resume
        cos, sin = self.rotary.tables(positions, x.dtype)
        batch = Batch(slots, cache_index, cos, sin, mask, kv_len, KVCache.span(slots, cache_index))
        batch.fast = None if self.split else step_args(x, batch)
        hidden: dict[int, torch.Tensor] = {}
        batches = {x.device: batch}
        stack = self._stack(cache) if batch.fast is not None and resume is None and not any(
            i < len(self.model.layers) for i in hidden_layers) else None
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
        return self.lm_head(x).float(), hidden
