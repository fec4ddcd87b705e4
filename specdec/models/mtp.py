"""MTP (multi-token prediction) blocks: the next-n layers a checkpoint ships, or one trained after the fact.

    e = enorm(embed(token[P+1]))     h = hnorm(g[P])    # g: the target's post-norm final state (HF hidden_states[N])
    x = eh_proj([e; h])                                 # MiMo: [h; e]
    out = layer(x)                                      # a Llama / Qwen2 / Qwen3 decoder layer, own KV cache, RoPE at P
    logits = head(norm(out))                            # norm: shared_head.norm / final_layernorm
    next g = norm(out), or out where the layout recycles the pre-norm state (DeepSeek-V3 as vLLM runs it)

The pair fed at position P is (token[P+1], g[P]), as for EAGLE-3; a chain recycles `next g` one position on. With
several blocks, step s of a chain runs block min(s, n - 1), and every block's cache holds the committed pairs.
`head` is the block's own `shared_head.head` when the checkpoint has one, else the target's LM head (shared, not a
parameter of the head: `MtpHead.share`); token embeddings are always the target's.

Layouts (block i; N = the target's layer count), read by `load_mtp`:
- DeepSeek-V3 `nextn`: `model.layers.{N+i}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}` + the decoder
  layer's own names, config `num_nextn_predict_layers`; [e; h], pre-norm state recycled (vLLM `deepseek_mtp`); a
  missing `shared_head.norm` falls back to the target's final norm (llama.cpp).
- MiMo: `model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}` + the layer's names,
  config `num_nextn_predict_layers` (model_type `mimo`, a Qwen2); [h; e], normed state recycled.
- Qwen3.5: `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}` shared by the blocks + `mtp.layers.{i}.*`, a
  full-attention Qwen3.5 layer; config `mtp_num_hidden_layers`; [e; h], normed state recycled (llama.cpp
  src/models/qwen35.cpp `graph_mtp`). llama.cpp's converter writes them as nextn layers `blk.{N+i}.nextn.*`, read
  from the GGUF itself (`load_native`).
- speculators `mtp` (also the head directory `save_head` writes for a post-hoc block, with a manifest.json
  {kind: "mtp", target} for `drafters.heads.find_head`): `mtp_layers.{i}.*` with MiMo's names, config.json with
  `speculators_model_type: "mtp"` and `transformer_layer_config`; [e; h], normed state recycled.
Ours: `blocks.{i}.{enorm,hnorm,eh_proj,layer.*,norm,head}`, q/k/v and gate/up fused like `transformer.py`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.eagle3 import SPECULATORS_VERSION, _architectures, _write, speculators_config
from specdec.models.rope import Rotary
from specdec.models.state import is_mtp_tensor, load_exact, read_tensors
from specdec.models.transformer import Batch, DecoderLayer, RMSNorm, fuse_projections, our_name
from specdec.runtime.kv_cache import KVCache

# layout -> (block i's tensor prefix, their names -> ours); the decoder layer's names are the same everywhere
MIMO_NAMES = {
    "token_layernorm": "enorm",
    "hidden_layernorm": "hnorm",
    "input_proj": "eh_proj",
    "final_layernorm": "norm",
}
LAYOUTS = {
    "nextn": (
        "model.layers.{i}.",
        {
            "enorm": "enorm",
            "hnorm": "hnorm",
            "eh_proj": "eh_proj",
            "shared_head.norm": "norm",
            "shared_head.head": "head",
        },
    ),
    "mimo": ("model.mtp_layers.{i}.", MIMO_NAMES),
    "speculators": ("mtp_layers.{i}.", MIMO_NAMES),
}
COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")  # config.json: how many blocks ship
QWEN3_5_NAMES = {
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head.norm",
}


def _nextn_tensors() -> dict:
    """A nextn block's own modules -> their gguf MODEL_TENSOR."""
    from gguf import MODEL_TENSOR as T

    return {
        "eh_proj": T.NEXTN_EH_PROJ,
        "enorm": T.NEXTN_ENORM,
        "hnorm": T.NEXTN_HNORM,
        "shared_head.norm": T.NEXTN_SHARED_HEAD_NORM,
        "shared_head.head": T.NEXTN_SHARED_HEAD_HEAD,
    }


@dataclass
class MtpConfig:
    layer: ModelConfig  # the decoder layer's shape (a target-like config; num_layers is the target's)
    num_blocks: int = 1
    hidden_first: bool = False  # eh_proj reads [hnorm(g); enorm(e)] (MiMo)
    recycle_normed: bool = True  # the next step's g is norm(out) (MiMo, speculators), else out (DeepSeek / vLLM)
    own_head: bool = False  # blocks carry shared_head.head (else the target's LM head is used)

    @classmethod
    def for_target(cls, t: ModelConfig, intermediate: int | None = None) -> MtpConfig:
        """A post-hoc block shaped like the target's layers (speculators' convention)."""
        return cls(replace(t, intermediate_size=intermediate or t.intermediate_size))

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


class MtpBlock(nn.Module):
    def __init__(self, c: MtpConfig, index: int):
        super().__init__()
        H, eps = c.hidden_size, c.layer.rms_norm_eps
        self.hidden_first = c.hidden_first
        offset = c.layer.norm_offset
        self.enorm, self.hnorm = RMSNorm(H, eps, offset), RMSNorm(H, eps, offset)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(c.layer, index)  # its K/V go to cache layer `index`
        self.norm = RMSNorm(H, eps, offset)
        self.head = nn.Linear(H, c.layer.vocab_size, bias=False) if c.own_head else None

    def forward(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """emb, g [B, T, H] -> the layer's output (pre-norm) [B, T, H]."""
        e, h = self.enorm(emb), self.hnorm(g)
        return self.layer(self.eh_proj(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1)), batch, cache)


class MtpHead(nn.Module):
    def __init__(self, c: MtpConfig):
        super().__init__()
        self.config = c
        self.blocks = nn.ModuleList(MtpBlock(c, i) for i in range(c.num_blocks))
        t = c.layer
        with torch.device("cpu"):
            self.rotary = Rotary(t.rope_dim, t.rope_theta, t.rope_scaling, t.max_position_embeddings)
        self.__dict__["lm_head"] = None  # the target's, not a submodule (not saved, moved or trained with the head)

    def share(self, lm_head: nn.Module) -> MtpHead:
        """Use the target's LM head where a block has none of its own."""
        self.__dict__["lm_head"] = lm_head
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].eh_proj.weight.dtype

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A KV cache with one layer per block."""
        t = self.config.layer
        return KVCache.allocate(
            len(self.blocks),
            num_slots,
            t.num_kv_heads,
            max_len,
            t.head_dim,
            self.dtype,
            self.blocks[0].eh_proj.weight.device,
        )

    def forward(
        self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, cache: KVCache, depth: int = 0, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs emb, g [B, T, H] through block min(depth, n - 1) -> (logits [B, T or 1, V] fp32, next g [B, T, H])."""
        block = self.blocks[min(depth, len(self.blocks) - 1)]
        out = block(emb, g, batch, cache)
        normed = block.norm(out)
        head = block.head if block.head is not None else self.lm_head
        if head is None:
            raise SpecdecError("MTP head has no LM head: share the target's (MtpHead.share)")
        logits = head(normed[:, -1:] if last_only else normed).float()
        return logits, normed if self.config.recycle_normed else out

    def feed(
        self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, cache: KVCache, last_only: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed pairs into every block's cache -> block 0's (logits, next g), as `forward`."""
        for i in range(1, len(self.blocks)):
            self.blocks[i](emb, g, batch, cache)
        return self(emb, g, batch, cache, 0, last_only)

    def packed(
        self,
        emb: torch.Tensor,
        g: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        depth: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training / teacher forcing over one packed sequence, with a scratch cache (autograd flows through it):
        emb[t] = embedding of token[t + 1], g[t] = the state of t, both [1, T, H]; positions [1, T] (default
        0..T-1); mask [1, 1, T, T] bool (default causal; block-diagonal for several documents).
        -> (logits [1, T, V] fp32, next g [1, T, H])."""
        T = emb.shape[1]
        positions = torch.arange(T, device=emb.device)[None] if positions is None else positions
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=emb.device).tril()[None, None]
        cos, sin = self.rotary.tables(positions.cpu(), emb.dtype)
        index = torch.arange(T, device=emb.device)[None]  # cache rows: token order (positions only rotate)
        batch = Batch(torch.tensor([0]), index, cos.to(emb.device), sin.to(emb.device), mask, T, (0, 0, T))
        return self(emb, g, batch, self.allocate_cache(1, T), depth)


def native_blocks(path: Path) -> int:
    """How many MTP blocks a checkpoint directory's config.json or a GGUF file's metadata declares (0: none)."""
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        from specdec.models.gguf_convert import _field, open_gguf

        reader = open_gguf(path)
        return int(_field(reader, f"{_field(reader, 'general.architecture')}.nextn_predict_layers", 0))
    d = checkpoint_config(path) if (path / "config.json").is_file() else {}
    return 0 if "speculators_model_type" in d else next((int(d[k]) for k in COUNT_KEYS if d.get(k)), 0)


def checkpoint_config(path: Path) -> dict:
    """A directory's config.json (OSError without one), a multimodal checkpoint's `text_config` (Qwen3.5) under it:
    the text model's sizes and MTP layer count read as the top level's."""
    d = json.loads((Path(path) / "config.json").read_text())
    return {**d.get("text_config", {}), **d}


def _qwen3_5_as_nextn(state: dict[str, torch.Tensor], first: int, n: int) -> dict[str, torch.Tensor]:
    """Qwen3.5's `mtp.*` under nextn names, as llama.cpp's converter renames them; the shared fc and norms go to
    every block."""
    out = {}
    for name, t in state.items():
        rest = name.removeprefix("mtp.")
        layer = re.match(r"layers\.(\d+)\.(.+)", rest)
        if rest == name:
            out[name] = t
        elif layer:
            out[f"model.layers.{first + int(layer.group(1))}.{layer.group(2)}"] = t
        else:
            module, _, kind = rest.rpartition(".")
            for i in range(n):
                out[f"model.layers.{first + i}.{QWEN3_5_NAMES[module]}.{kind}"] = t
    return out


def _gguf_head(path: Path, n: int, dtype: torch.dtype) -> MtpHead:
    """A GGUF's nextn blocks as a head: their decoder layers' matrices and experts kept as GGUF blocks through the
    kernels (as the target's, `gguf_quantized.load_layers`), the rest dense in `dtype`."""
    import gguf

    from specdec.models.families import by_name
    from specdec.models.gguf_convert import _dequantize, _field, config_from_gguf, open_gguf
    from specdec.models.gguf_quantized import load_layers

    reader = open_gguf(path)
    t = config_from_gguf(reader, path)
    arch = _field(reader, "general.architecture")
    blocks = range(t.num_layers, t.num_layers + n)
    every = by_name(t.family).gguf_tensor_names(arch, t.num_layers + n)
    ours = tuple(f"model.layers.{i}." for i in blocks)
    names = {g: h for g, h in every.items() if h.startswith(ours) or h == "model.norm"}  # the blocks' layers, the norm
    for m, kind in _nextn_tensors().items():  # the blocks' own (not in every gguf release's TensorNameMap)
        names.update({gguf.TENSOR_NAMES[kind].format(bid=i): f"model.layers.{i}.{m}" for i in blocks})
    tensors = {}
    for tensor in reader.tensors:
        stem, _, kind = tensor.name.rpartition(".")
        if stem in names:
            tensors[our_name(f"{names[stem]}.{kind}")] = tensor
    c = _native_config(t, n, "nextn", own_head=any(".shared_head.head." in k for k in tensors))
    with torch.device("meta"):
        head = MtpHead(c)
    layers = nn.ModuleDict({str(i): block.layer for i, block in zip(blocks, head.blocks)})
    state = load_layers(layers, "model.layers", tensors, c.layer, reader, dtype)
    norm = torch.from_numpy(_dequantize(tensors["model.norm.weight"], t).copy()).to(dtype)
    head_state = _to_ours(state, "nextn", n, t.num_layers)
    for i in range(n):  # nextn without shared_head.norm: the target's final norm (llama.cpp's fallback)
        head_state.setdefault(f"blocks.{i}.norm.weight", norm)
    head.load_state_dict(head_state, strict=False, assign=True)
    left = [name for name, p in head.named_parameters() if p.is_meta]
    if left:
        raise SpecdecError(f"{path}: tensors do not match its MTP blocks (not loaded {left[:3]})")
    return head.eval()


def _native_config(t: ModelConfig, n: int, layout: str, own_head: bool) -> MtpConfig:
    """The config of a checkpoint's own blocks: a full-attention layer with the target's recipe."""
    return MtpConfig(
        replace(t, layer_types=None) if t.linear_layers else t,
        n,
        hidden_first=layout == "mimo",
        recycle_normed=layout == "mimo" or t.family == "qwen3_5",
        own_head=own_head,
    )


def _to_ours(state: dict[str, torch.Tensor], layout: str, n: int, first: int) -> dict[str, torch.Tensor]:
    """Block tensors of `layout` (blocks first..first+n-1 in its numbering) -> our names, projections fused."""
    prefix, names = LAYOUTS[layout]
    ours: dict[str, torch.Tensor] = {}
    layer: dict[str, torch.Tensor] = {}
    for i in range(n):
        p = prefix.format(i=first + i)
        for name, t in state.items():
            if not name.startswith(p) or name[len(p) :].startswith("embed_tokens."):  # nextn ships a copy
                continue
            rest = name[len(p) :]
            module, _, kind = rest.rpartition(".")
            if module in names:
                ours[f"blocks.{i}.{names[module]}.{kind}"] = t
            else:  # the decoder layer: fused under the target's names, then moved
                layer[f"model.layers.{i}.{rest}"] = t
    fuse_projections(layer, n)
    ours.update({re.sub(r"^model\.layers\.(\d+)\.", r"blocks.\1.layer.", k): v for k, v in layer.items()})
    return ours


def _build(c: MtpConfig, state: dict[str, torch.Tensor], where: Path, dtype: torch.dtype) -> MtpHead:
    head = MtpHead(c)
    load_exact(head, state, where, "MTP blocks")
    return head.to(dtype).eval()


def load_native(path: Path, dtype: torch.dtype = torch.float32) -> MtpHead:
    """The MTP blocks a checkpoint directory or a GGUF file ships (DeepSeek-V3 `nextn`, MiMo or Qwen3.5 layout)."""
    path = Path(path)
    n = native_blocks(path)
    if n == 0:
        raise SpecdecError(f"{path}: no MTP layers (config has no {' / '.join(COUNT_KEYS)})")
    if path.suffix == ".gguf":
        return _gguf_head(path, n, dtype)
    t = ModelConfig.from_file(path / "config.json")
    state = read_tensors(path, lambda name: is_mtp_tensor(name, t.num_layers) or name == "model.norm.weight")
    state = _qwen3_5_as_nextn(state, t.num_layers, n)
    layout = "mimo" if any(k.startswith("model.mtp_layers.") for k in state) else "nextn"
    ours = _to_ours(state, layout, n, t.num_layers if layout == "nextn" else 0)
    for i in range(n):  # nextn without shared_head.norm: the target's final norm (llama.cpp's fallback)
        ours.setdefault(f"blocks.{i}.norm.weight", state.get("model.norm.weight"))
    c = _native_config(t, n, layout, own_head=any(k.endswith(".head.weight") for k in ours))
    return _build(c, ours, path, dtype)


# our MtpConfig flags where they differ from what the speculators layout implies (written only then)
FLAGS = {"hidden_first": False, "recycle_normed": True, "own_head": False}


def save_head(
    head: MtpHead, out: Path, verifier: str, manifest: dict | None = None, speculative_tokens: int = 3
) -> Path:
    """The head directory: the speculators `mtp` layout (config.json, model.safetensors with `mtp_layers.{i}.*`,
    q/k/v and gate/up unfused, MiMo's names) + manifest.json. `verifier`: the target's HF id or path."""
    c = head.config
    layer = {**c.layer.to_hf_dict(), "num_hidden_layers": c.layer.num_layers}
    cfg = {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "num_nextn_predict_layers": c.num_blocks,
        "speculators_config": speculators_config("mtp", verifier, _architectures(verifier), speculative_tokens),
        **{f"mtp_{f}": getattr(c, f) for f, default in FLAGS.items() if getattr(c, f) != default},
    }
    _write(Path(out), layout_state(head, "speculators"), cfg, manifest)
    return Path(out)


def layout_state(head: MtpHead, layout: str, first: int = 0) -> dict[str, torch.Tensor]:
    """The head's tensors under `layout`'s names (`LAYOUTS`), its blocks numbered from `first` (nextn: the target's
    layer count), q/k/v and gate/up unfused."""
    prefix, names = LAYOUTS[layout]
    theirs = {v: k for k, v in names.items()}
    state = {}
    for k, v in unfused_state(head).items():
        i, module, kind = re.match(r"blocks\.(\d+)\.(.+)\.(\w+)$", k).groups()
        module = theirs.get(module, module.removeprefix("layer."))
        state[f"{prefix.format(i=first + int(i))}{module}.{kind}"] = v
    return state


def unfused_state(head: MtpHead) -> dict[str, torch.Tensor]:
    """The head's tensors with q/k/v and gate/up split back into HF names."""
    state = {}
    t = head.config.layer
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    for k, v in head.state_dict().items():
        v = v.detach()
        if ".self_attn.qkv_proj." in k:
            for part, name in zip(v.split([q, kv, kv]), ("q_proj", "k_proj", "v_proj")):
                state[k.replace("qkv_proj", name)] = part.contiguous()
        elif ".mlp.gate_up_proj." in k:
            for part, name in zip(v.chunk(2), ("gate_proj", "up_proj")):
                state[k.replace("gate_up_proj", name)] = part.contiguous()
        else:
            state[k] = v.contiguous()
    return state


def load_head(path: Path, dtype: torch.dtype = torch.float32) -> MtpHead:
    """A head directory (`save_head`, speculators' `mtp` layout) or a checkpoint with native MTP layers."""
    path = Path(path)
    cfg_file = path / "config.json"
    if path.suffix == ".gguf":
        return load_native(path, dtype)
    if not cfg_file.is_file():
        raise SpecdecError(f"{path}: no config.json (an MTP head directory is config.json + safetensors)")
    d = json.loads(cfg_file.read_text())
    if d.get("speculators_model_type") != "mtp":
        return load_native(path, dtype)
    n = int(d.get("num_nextn_predict_layers", 1))
    c = MtpConfig(
        ModelConfig.from_hf_dict(d["transformer_layer_config"]),
        n,
        **{f: bool(d.get(f"mtp_{f}", default)) for f, default in FLAGS.items()},
    )
    return _build(c, _to_ours(read_tensors(path), "speculators", n, 0), path, dtype)
