"""Run a model from a GGUF file's quantized tensors as they are (no 16/32-bit weight copies).

`quantize_from_gguf(model, path)` takes a `Transformer` built for the file's config (typically on the meta
device, so it holds no weights) and gives it the file's tensors: every projection whose GGUF tensor is Q4_1, Q4_K,
Q5_0, Q6_K, Q8_0 or MXFP4 (gpt-oss's experts) becomes a `GGUFLinear` over a view of the file's memory map (fused
q/k/v and gate/up stay fused: a `GGUFConcatLinear`, one kernel call for all parts); the token embedding
becomes a `GGUFEmbedding` that dequantizes only the looked-up rows (and is the LM head's weight too when
the model ties them); norms and biases (F32 in the file) and any tensor of another type are loaded dense in
`dtype`. Resident memory stays near the file's size (the mapped pages are shared with the page cache).

    model, tok = load_gguf_quantized(Path("model.gguf"), torch.bfloat16)

The target's `--quant gguf` (`LLM(quant="gguf")`) loads through `load_gguf_quantized`; `describe(model)` says
which path runs (reported in `--json` stats and bench metadata).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.gguf_convert import config_from_gguf, gguf_tokenizer, hf_names, open_gguf, permuted, unpermute
from specdec.models.transformer import FUSED, ExpertMath, Experts, MoE, Transformer, our_name
from specdec.runtime import kernels as K
from specdec.runtime.gguf_linear import GGUFConcatLinear, GGUFLinear, for_this_cpu, kernel_matmul
from specdec.runtime.layer_kernel import ExpertKernel, ExpertParts


class GGUFEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks; a lookup dequantizes only the rows it returns."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype
        # what the rest of the code reads from an embedding's .weight: its dtype and device (no data)
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = [self.table.dequantize(self.dtype, slice(t, t + 1)) for t in tokens.reshape(-1).tolist()]
        return torch.cat(rows).reshape(*tokens.shape, self.table.in_features)


class GGUFExperts(ExpertMath, nn.Module):
    """A layer's experts kept as GGUF blocks (the file's 3-D gate/up/down tensors, one 2-D slice per expert): each
    expert's gate and up in one `GGUFConcatLinear`; `forward` as `transformer.Experts`'."""

    def __init__(self, gate_up: list[GGUFConcatLinear], down: list[GGUFLinear], like: ExpertMath):
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.limit, self.alpha, self.gelu = like.limit, like.alpha, like.gelu
        self.gate_up_bias, self.down_bias = like.gate_up_bias, like.down_bias  # placeholders the file's biases fill
        self._kernel: tuple | None = None  # (the gate_up it was built for, its ExpertKernel or None): see mixture

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s MLP over rows x [n, H] -> [n, H]."""
        return self.finish(expert, self.down[expert](self.activate(expert, self.gate_up[expert](x))))

    def kernel_parts(self) -> ExpertParts:
        """Each expert's [gate, up] and each one's down, with the biases and activation, as the C layer takes them."""
        biases = (None if b is None else b.data for b in (self.gate_up_bias, self.down_bias))
        return ExpertParts([_gate_and_up(gu) for gu in self.gate_up], list(self.down), *biases, self.limit, self.alpha)

    def mixture(self, rows: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """As `ExpertMath.mixture`, in one C call where the kernels take these rows and experts (`ExpertKernel`:
        the same functions in the same order, so the same bits)."""
        if self._kernel is None or self._kernel[0] is not self.gate_up:  # first use, or the experts replaced
            self._kernel = (self.gate_up, ExpertKernel.of(self.kernel_parts(), rows.shape[-1], self.gelu))
        out = None if self._kernel[1] is None else self._kernel[1].run(rows, weights, chosen)
        return super().mixture(rows, weights, chosen) if out is None else out

    def _apply(self, fn, recurse=True):  # weights moved or converted: describe them again at the next use
        self._kernel = None
        return super()._apply(fn, recurse)

    def shared(self, experts: list[int], x: torch.Tensor) -> list[torch.Tensor]:
        """Each of `experts` over the same rows x [n, H] -> [n, H] each: their gate/up in one kernel call (the
        activations quantized once; each part's outputs the bits a call of its own gives), then each one's down."""
        gate_up = kernel_matmul([p for e in experts for p in self.gate_up[e].parts], x, keep=False)
        if gate_up is None:
            return [self(e, x) for e in experts]
        width = gate_up.shape[-1] // len(experts)
        return [
            self.finish(e, self.down[e](self.activate(e, gate_up[:, j * width : (j + 1) * width].contiguous())))
            for j, e in enumerate(experts)
        ]


def _gate_and_up(gate_up: GGUFConcatLinear) -> list[GGUFLinear]:
    """An expert's gate and up: its two parts, or the two halves of a fused one (Gemma 4's), sharing its blocks (in
    the x16 layout only where each half is whole groups of 16 outputs)."""
    parts = list(gate_up.parts)
    p = parts[0]
    f = p.out_features // 2
    if len(parts) != 1 or p.bias is not None or (p.qtype & K.X16 and f % 16):
        return parts
    return [GGUFLinear(p.qweight[a : a + f], p.qtype, p.in_features, f, None) for a in (0, f)]


def _linear(t, cfg: ModelConfig, reader, bias: torch.Tensor | None = None) -> GGUFLinear:
    out, inp = int(t.shape[1]), int(t.shape[0])  # GGUF lists ne0 (the row length) first
    data = t.data.reshape(out, -1)
    if permuted(t.name, cfg):
        data = np.ascontiguousarray(unpermute(data, cfg.num_heads if "attn_q" in t.name else cfg.num_kv_heads))
    lin, copied = _blocks(data, int(t.tensor_type), inp, out, bias)
    if copied:
        _release(reader, t)
    return lin


def _blocks(data: np.ndarray, qtype: int, inp: int, out: int, bias: torch.Tensor | None) -> tuple[GGUFLinear, bool]:
    """A `GGUFLinear` over `data` ([out, bytes per row] of the file's blocks) and whether it copied them (a layout
    repacked for this CPU)."""
    blocks = torch.from_numpy(data) if data.flags.writeable else _readonly_view(data)
    lin = for_this_cpu(GGUFLinear(blocks, qtype, inp, out, bias))
    return lin, lin.qweight.data_ptr() != blocks.data_ptr()


def _experts(gate_up_parts: list, down, reader, like: ExpertMath) -> GGUFExperts:
    """`GGUFExperts` from a layer's 3-D expert tensors (GGUF ne: gate and up [H, F, E], or one fused gate/up
    [H, 2F, E] (Gemma 4); down [F, H, E])."""
    f, h, n = (int(x) for x in down.shape)
    copied = False
    gate_up, downs = [], []
    for e in range(n):
        parts = []
        for t in gate_up_parts:
            rows = int(t.shape[1])
            lin, c = _blocks(t.data[e].reshape(rows, -1), int(t.tensor_type), h, rows, None)
            parts.append(lin)
            copied |= c
        lin, c = _blocks(down.data[e].reshape(h, -1), int(down.tensor_type), f, h, None)
        gate_up.append(GGUFConcatLinear(parts))
        downs.append(lin)
        copied |= c
    if copied:
        for t in (*gate_up_parts, down):
            _release(reader, t)
    return GGUFExperts(gate_up, downs, like)


def _release(reader, t) -> None:
    """Drop tensor t's file pages from this process once a repacked copy replaced them (they stay in the page
    cache; were they touched again they would be read back), so loading never holds the file and its copy whole."""
    mm = getattr(getattr(reader, "memmap", reader.data), "_mmap", None)  # the mmap under the reader's numpy.memmap
    if mm is None:
        return
    start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)
    except (OSError, ValueError, AttributeError):  # no madvise here: the pages go when the file is closed
        pass


def _readonly_view(a: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only memory map without copying (torch warns about non-writable arrays; the
    kernels never write to weights)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _dense(t, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    from specdec.models.gguf_convert import _dequantize

    return torch.from_numpy(np.array(_dequantize(t, cfg))).to(dtype)  # a writable copy (norms, biases: small)


def in_blocks(t) -> bool:
    """Whether a GGUF tensor (or None) is of a type the block kernels take as it is."""
    return t is not None and int(t.tensor_type) in K.BLOCK


def load_layers(
    root: nn.Module, prefix: str, tensors: dict, cfg: ModelConfig, reader, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Give the decoder layers under `root` (its modules named `prefix`.*, as the file's tensors are: our names) the
    file's matrices and experts as GGUF blocks where the kernels take them; returns the state dict of the rest (dense
    in `dtype`, named `prefix`.*)."""
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()  # file tensors taken by the matrices and experts below
    quantized = lambda name: in_blocks(tensors.get(name))  # noqa: E731

    def dense(name: str) -> torch.Tensor:
        return _dense(tensors[name], cfg, dtype)

    def owner(name: str) -> nn.Module:
        return root.get_submodule(name.removeprefix(prefix).removeprefix("."))

    for name, module in list(root.named_modules(prefix=prefix)):
        if not isinstance(module, nn.Linear):
            continue
        parts = _parts(name, tensors)  # the file's tensors whose rows make this module's weight, in order
        biases = [f"{p}.bias" for p in parts if f"{p}.bias" in tensors]
        used.update([f"{p}.weight" for p in parts] + biases)
        parent, attr = name.rsplit(".", 1)
        if all(quantized(f"{p}.weight") for p in parts):
            lins = [
                _linear(tensors[f"{p}.weight"], cfg, reader, dense(f"{p}.bias") if f"{p}.bias" in tensors else None)
                for p in parts
            ]
            setattr(owner(parent), attr, lins[0] if len(lins) == 1 else GGUFConcatLinear(lins))
            continue
        weight = torch.cat([dense(f"{p}.weight") for p in parts])  # (a one-row matrix may be stored 1-D)
        state[f"{name}.weight"] = weight.reshape(module.out_features, module.in_features)
        if biases:
            state[f"{name}.bias"] = torch.cat([dense(b) for b in biases])
    for name, moe in list(root.named_modules(prefix=prefix)):  # experts: blocks where the kernels take them, else
        if not isinstance(moe, MoE):  # dense as `Experts` holds them
            continue
        pre = f"{name}.experts."
        fused = f"{pre}gate_up_proj.weight" in tensors  # Gemma 4's
        parts = [f"{pre}{p}.weight" for p in ("gate_up_proj",) * fused or ("gate_proj", "up_proj")]
        parts.append(f"{pre}down_proj.weight")
        if not all(p in tensors for p in parts):
            continue
        biases = [f"{pre}{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")]
        used.update(parts + biases)
        if all(quantized(p) for p in parts):
            moe.experts = _experts([tensors[p] for p in parts[:-1]], tensors[parts[-1]], reader, moe.experts)
        else:
            state[f"{pre}gate_up_proj"] = torch.cat([dense(p) for p in parts[:-1]], dim=1)
            state[f"{pre}down_proj"] = dense(parts[-1])
        if biases[0] in tensors:  # gpt-oss
            state[f"{pre}gate_up_bias"] = torch.cat([dense(biases[0]), dense(biases[1])], dim=1)
            state[f"{pre}down_bias"] = dense(biases[2])
    for name in tensors:  # the rest of each layer (norms, attention sinks, linear attention's conv and gates)
        if name.startswith(prefix + ".") and name not in used:
            state[name] = dense(name)
    return state


def quantize_from_gguf(
    model: Transformer, gguf_path: Path | str, dtype: torch.dtype = torch.float32, reader=None
) -> Transformer:
    """Give `model` (built for this file's config, weights on meta or anything) the GGUF file's tensors, keeping
    the quantized ones as blocks. Returns the model (modified in place), in eval mode."""
    path = Path(gguf_path)
    reader = reader or open_gguf(path)
    cfg = model.config
    names = hf_names(reader, cfg)
    tensors = {our_name(names[t.name]): t for t in reader.tensors if t.name in names}
    state = load_layers(model.model.layers, "model.layers", tensors, cfg, reader, dtype)
    quantized = lambda name: in_blocks(tensors.get(name))  # noqa: E731

    emb = "model.embed_tokens.weight"
    if quantized(emb):
        table = _linear(tensors[emb], cfg, reader)
        model.model.embed_tokens = GGUFEmbedding(table, dtype)
    else:
        state[emb] = _dense(tensors[emb], cfg, dtype)
        table = None
    head = "lm_head.weight" if "lm_head.weight" in tensors else emb  # tied: the embedding table
    if quantized(head):
        model.lm_head = table if head == emb else _linear(tensors[head], cfg, reader)
    else:
        state["lm_head.weight"] = state[emb] if head == emb else _dense(tensors[head], cfg, dtype)
    state["model.norm.weight"] = _dense(tensors["model.norm.weight"], cfg, dtype)
    for name in [n for n in tensors if n.startswith("model.") and n.endswith(".weight")]:  # the family's other tables
        if name.startswith("model.layers.") or name in state or name == emb:  # (Gemma 4's per-layer inputs)
            continue
        module = model.get_submodule(name.removesuffix(".weight"))
        if not quantized(name) or not isinstance(module, (nn.Embedding, nn.Linear)):
            state[name] = _dense(tensors[name], cfg, dtype)
        else:
            lin = _linear(tensors[name], cfg, reader)
            parent, attr = name.removesuffix(".weight").rsplit(".", 1)
            blocks = lin if isinstance(module, nn.Linear) else GGUFEmbedding(lin, dtype)
            setattr(model.get_submodule(parent), attr, blocks)

    dense_types = {tensors[n].tensor_type.name for n in tensors if len(tensors[n].shape) > 1 and not quantized(n)}
    model.gguf_dense_types = sorted(dense_types)  # matrices of types the kernels do not take: held dense in dtype
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if unexpected or left:
        raise SpecdecError(
            f"{path}: tensors do not match the model (unexpected {unexpected[:3]}, not loaded {left[:3]})"
        )
    return model.eval()


def _parts(module: str, tensors: dict) -> list[str]:
    """The file's tensors (names without .weight) that make up our module `module`: itself where the file holds it
    fused (Phi-3's qkv_proj, gate_up_proj), else its parts in order (`transformer.FUSED`)."""
    sub = module.partition(".layers.")[2].partition(".")[2]  # "self_attn.qkv_proj"
    if f"{module}.weight" in tensors or sub not in FUSED:
        return [module]
    parts = [module.removesuffix(sub) + part for part in FUSED[sub]]
    return [p for p in parts if f"{p}.weight" in tensors]  # (Gemma 4: attention without its own v, or k and v)


def densify(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` with every GGUF module in it (itself included) replaced by a dense one in `dtype`, its weights
    dequantized once on the host: for the parts `-ngl` places on a GPU, where the C kernels do not run."""
    if isinstance(module, GGUFEmbedding):
        return nn.Embedding.from_pretrained(module.table.dequantize(dtype), freeze=True)
    if isinstance(module, GGUFExperts):
        gate_up = [torch.cat([p.dequantize(dtype) for p in m.parts]) for m in module.gate_up]
        biases = [None if b is None else b.detach().to(dtype) for b in (module.gate_up_bias, module.down_bias)]
        experts = Experts(torch.stack(gate_up), torch.stack([m.dequantize(dtype) for m in module.down]), *biases)
        experts.limit, experts.alpha, experts.gelu = module.limit, module.alpha, module.gelu
        return experts
    if isinstance(module, (GGUFLinear, GGUFConcatLinear)):
        parts = list(module.parts) if isinstance(module, GGUFConcatLinear) else [module]
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        dense.weight = nn.Parameter(torch.cat([p.dequantize(dtype) for p in parts]), requires_grad=False)
        if module.bias is not None:
            dense.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        return dense
    for name, child in list(module.named_children()):
        setattr(module, name, densify(child, dtype))
    return module


def describe(model: nn.Module) -> str:
    """Which path a model from `quantize_from_gguf` runs, e.g. 'gguf: Q4_K/Q5_0/Q6_K/Q8_0 kernel path avx512, x16
    layout' (x16: repacked at load for the AVX-512 kernel), plus e.g. '; Q5_1 dequantized to float32' for matrices of
    types the kernels do not take."""
    lins = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    kinds = sorted({m.type_name.removesuffix(" x16") for m in lins})
    text = f"gguf: {'/'.join(kinds)} {K.describe()}" if kinds else "gguf: no kernel types"
    repacked = sum(bool(m.qtype & K.X16) for m in lins)
    if repacked:
        text += ", x16 layout" if repacked == len(lins) else f", x16 layout ({repacked} of {len(lins)} matrices)"
    dense = getattr(model, "gguf_dense_types", [])
    if dense:
        dtype = str(model.model.norm.weight.dtype).removeprefix("torch.")
        text += f"; {'/'.join(dense)} dequantized to {dtype}"
    return text


def load_gguf_quantized(path: Path | str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) straight from a GGUF file, quantized tensors kept as blocks (no fp32 conversion)."""
    from specdec.models.tokenizer import Tokenizer

    path = Path(path)
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    with torch.device("meta"):
        model = Transformer(cfg)
    quantize_from_gguf(model, path, dtype, reader)
    return model, Tokenizer(gguf_tokenizer(path, reader))
