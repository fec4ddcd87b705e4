"""Block draft networks: DFlash (z-lab) and DSpark (DeepSpec), one forward pass drafts a whole block.

    c = hidden_norm(fc(concat(target features)))      # one context state per committed token
    every draft layer l: K/V of the context = k_norm(k_proj_l(c)), v_proj_l(c)   (RoPE at the token's position)
    x = embed([anchor, MASK, ..., MASK])              # the target's embeddings, positions P..P+B-1 (P: the anchor)
    x = layer_l(x) for each layer                     # Qwen3 layers; queries see the whole context and the whole block
    logits_k = lm_head(norm(x)_k)                     # the target's LM head; DFlash drafts slots 1..B-1
                                                      # (slot k predicts token P+k), DSpark slots 0..B-1 (P+k+1)

DSpark adds two heads on the block's hidden states, both read sequentially along the drafted chain:
- Markov (`vanilla`): logits_k += markov_w2(markov_w1[previous token]) (the anchor for the first draft);
- confidence: sigmoid(proj([hidden_k; markov_w1[previous token]])), the chance that draft k is accepted.

The context K/V of a layer depends only on c, not on earlier layers, so it is written into the draft's KV cache
once per committed token (`inject`), as the reference's cropped DynamicCache holds it; the block's own K/V rows
are written past it and overwritten by the next injection. Ours: the decoder layers are `transformer.DecoderLayer`
(q/k/v and gate/up fused). Layouts, read by `load_block_drafter` and written by `save_zlab` / `save_speculators`:
- z-lab `dflash` (`DFlashDraftModel`): Qwen3 config.json + `num_target_layers` and `dflash_config`
  {`target_layer_ids` (outputs of target layers j = our feature j + 1), `block_size`, `mask_token_id`}; tensors
  `layers.{i}.*`, `fc`, `hidden_norm`, `norm`, no embeddings or LM head.
- speculators `dflash` / `dspark` 0.9.0: `transformer_layer_config`, `aux_hidden_state_layer_ids` (hidden states
  entering layer i = our features as is), `block_size`, `mask_token_id`, `sample_from_anchor`, DSpark's
  `markov_rank` / `markov_head_type` / `enable_confidence_head` / `confidence_head_with_markov`; tensors as z-lab's
  plus `markov_head.markov_w{1,2}`, `confidence_head.proj`, and `lm_head` only with a reduced vocabulary (not
  supported here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.eagle3 import SPECULATORS_VERSION, _architectures, _write, speculators_config
from specdec.models.mtp import unfused_state
from specdec.models.rope import Rotary, apply_rotary
from specdec.models.state import load_exact, read_tensors
from specdec.models.transformer import Batch, DecoderLayer, RMSNorm, fuse_projections
from specdec.runtime.kv_cache import KVCache


@dataclass(frozen=True)
class BlockConfig:
    layer: ModelConfig  # the draft's decoder layers (Qwen3 style; num_layers = draft layers)
    feature_layers: tuple[int, ...]  # target features: hidden states ENTERING these layers (`FeatureSpec`)
    block_size: int
    mask_token_id: int
    sample_from_anchor: bool = False  # slot 0 drafts too (DSpark): block_size drafts, else block_size - 1
    markov_rank: int = 0  # DSpark's Markov head (0: none)
    confidence: bool = False  # DSpark's confidence head
    confidence_with_markov: bool = True  # its input is [hidden; markov_w1[previous token]]

    @property
    def kind(self) -> str:
        return "dspark" if self.markov_rank or self.confidence else "dflash"

    @property
    def first_slot(self) -> int:
        """The block slot of the first draft token."""
        return 0 if self.sample_from_anchor else 1

    @property
    def drafts(self) -> int:
        """Draft tokens per block."""
        return self.block_size - self.first_slot

    @classmethod
    def for_target(
        cls,
        t: ModelConfig,
        num_layers: int = 5,
        block_size: int = 8,
        mask_token_id: int = 0,
        dspark: bool = False,
        markov_rank: int = 256,
    ) -> BlockConfig:
        """A draft shaped like the target's layers, features spread as DFlash's `build_target_layer_ids`."""
        layer = replace(
            t,
            model_type="qwen3",
            family="qwen3",
            num_layers=num_layers,
            qk_norm="head",
            attention_bias=False,
            o_bias=False,
        )
        return cls(
            layer,
            default_features(t.num_layers, num_layers),
            block_size,
            mask_token_id,
            sample_from_anchor=dspark,
            markov_rank=markov_rank if dspark else 0,
            confidence=dspark,
        )


def default_features(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default target layers (outputs of layers 1 .. N - 3, evenly spread) as features (+1)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2 + 1,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) + 1 for i in range(num_draft_layers))


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: a rank-r logit bias from the previous token."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class BlockDraft(nn.Module):
    """The draft network; embeddings and (unless it ships one) the LM head are the target's."""

    def __init__(self, c: BlockConfig):
        super().__init__()
        self.config = c
        L = c.layer
        if not L.qk_norm:
            raise SpecdecError("block drafters have Qwen3-style layers (q_norm / k_norm)")
        self.fc = nn.Linear(len(c.feature_layers) * L.hidden_size, L.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(L.hidden_size, L.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(L, i) for i in range(L.num_layers))
        self.norm = RMSNorm(L.hidden_size, L.rms_norm_eps)
        self.markov_head = MarkovHead(L.vocab_size, c.markov_rank) if c.markov_rank else None
        if c.confidence and c.confidence_with_markov and not c.markov_rank:
            raise SpecdecError("a confidence head on the Markov embedding needs markov_rank > 0")
        self.confidence_head = (
            ConfidenceHead(L.hidden_size + (c.markov_rank if c.confidence_with_markov else 0)) if c.confidence else None
        )
        with torch.device("cpu"):
            self.rotary = Rotary(L.head_dim, L.rope_theta, L.rope_scaling, L.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        L = self.config.layer
        return KVCache.allocate(
            L.num_layers, num_slots, L.num_kv_heads, max_len, L.head_dim, self.dtype, self.fc.weight.device
        )

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., F, Ht] (in `feature_layers` order) -> context states c [..., H]."""
        return self.hidden_norm(self.fc(feats.flatten(-2).to(self.dtype)))

    def inject(self, c: torch.Tensor, batch: Batch, cache: KVCache) -> None:
        """Write every layer's K/V of the context states c [1, n, H] at the batch's positions."""
        L = self.config.layer
        q_size, kv_size = L.num_heads * L.head_dim, L.num_kv_heads * L.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[q_size:]
            k, v = F.linear(c, attn.qkv_proj.weight[q_size:], bias).split(kv_size, dim=-1)  # [1, n, kv] each
            k = attn.k_norm(k.unflatten(-1, (L.num_kv_heads, L.head_dim))).transpose(1, 2)  # [1, kvh, n, hd]
            v = v.unflatten(-1, (L.num_kv_heads, L.head_dim)).transpose(1, 2)
            cache.write(i, batch.slots, batch.cache_index, apply_rotary(k, batch.cos, batch.sin), v, batch.write_span)

    def block(self, emb: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Block embeddings [1, B, H] at the batch's positions (mask None: every key) -> post-norm states [1, B, H]."""
        x = emb.to(self.dtype)
        for layer in self.layers:
            x = layer(x, batch, cache)
        return self.norm(x)

    def packed(
        self,
        c: torch.Tensor,
        ctx_positions: torch.Tensor,
        emb: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Training over one packed row with a scratch cache (autograd flows through it): context states c [1, R, H]
        at ctx_positions [1, R], blocks emb [1, M, H] at block_positions [1, M], mask [1, 1, M, R + M] bool (block
        queries -> context keys, then block keys) -> post-norm block states [1, M, H]."""
        R, M = c.shape[1], emb.shape[1]
        cache, slots = self.allocate_cache(1, R + M), torch.tensor([0])

        def rows(start: int, positions: torch.Tensor, m: torch.Tensor | None) -> Batch:
            cos, sin = self.rotary.tables(positions.cpu(), c.dtype)
            index = torch.arange(start, start + positions.shape[1], device=c.device)[None]
            return Batch(slots, index, cos.to(c.device), sin.to(c.device), m, R + M, (0, start, start + index.shape[1]))

        self.inject(c, rows(0, ctx_positions, None), cache)
        return self.block(emb, rows(R, block_positions, mask), cache)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """Previous tokens [...] -> logit bias [..., V] (zero without a Markov head)."""
        if self.markov_head is None:
            return torch.zeros(())
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev)).float()

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Block states [..., H] and previous tokens [...] -> confidence logits [...] (sigmoid: P(accepted))."""
        if self.confidence_head is None:
            raise SpecdecError("this block drafter has no confidence head")
        x = hidden
        if self.config.confidence_with_markov:
            x = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
        return self.confidence_head.proj(x)[..., 0].float()


# --- loading and saving ---


def _layer_config(d: dict) -> ModelConfig:
    layer = ModelConfig.from_hf_dict({**d, "model_type": "qwen3"})  # the reference layers are Qwen3's
    if d.get("layer_types") and any(t != "full_attention" for t in d["layer_types"]):
        raise SpecdecError("block drafters with sliding-window layers are not supported")
    return layer


def _zlab_config(d: dict) -> BlockConfig:
    """z-lab `DFlashDraftModel` config.json (values in `dflash_config` win, as in its `_draft_value`)."""
    get = lambda name, default=None: d.get("dflash_config", {}).get(name, d.get(name, default))  # noqa: E731
    for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0)):
        if float(get(name) or neutral) != neutral:
            raise SpecdecError(f"DFlash variant with {name} = {get(name)} is not supported")
    if get("is_causal"):
        raise SpecdecError("causal DFlash drafters are not supported")
    layer = _layer_config(d)
    ids = get("target_layer_ids")
    feats = tuple(j + 1 for j in ids) if ids else default_features(d["num_target_layers"], layer.num_layers)
    if get("mask_token_id") is None:
        raise SpecdecError("DFlash config has no mask_token_id")
    return BlockConfig(layer, feats, int(get("block_size", 16)), int(get("mask_token_id")))


def _speculators_config(d: dict) -> BlockConfig:
    kind, vocab = d["speculators_model_type"], d["transformer_layer_config"]["vocab_size"]
    if d.get("draft_vocab_size", vocab) != vocab:
        raise SpecdecError("block drafters with a reduced draft vocabulary are not supported")
    if d.get("markov_head_type", "vanilla") != "vanilla":
        raise SpecdecError(f"DSpark Markov head {d['markov_head_type']!r} is not supported (vanilla only)")
    if d.get("mask_token_id") is None or not d.get("aux_hidden_state_layer_ids"):
        raise SpecdecError("speculators block drafter config needs mask_token_id and aux_hidden_state_layer_ids")
    dspark = kind == "dspark"
    return BlockConfig(
        _layer_config(d["transformer_layer_config"]),
        tuple(d["aux_hidden_state_layer_ids"]),
        int(d.get("block_size", 8)),
        int(d["mask_token_id"]),
        bool(d.get("sample_from_anchor", dspark)),
        int(d.get("markov_rank", 256)) if dspark else 0,
        bool(d.get("enable_confidence_head", True)) if dspark else False,
        bool(d.get("confidence_head_with_markov", True)),
    )


def read_config(path: Path) -> BlockConfig:
    """The block drafter config in a directory (either layout)."""
    d = json.loads((Path(path) / "config.json").read_text())
    if d.get("speculators_model_type") in ("dflash", "dspark"):
        return _speculators_config(d)
    if "dflash_config" in d or "num_target_layers" in d:
        return _zlab_config(d)
    raise SpecdecError(f"{path}: not a DFlash / DSpark drafter (z-lab or speculators config.json)")


def load_block_drafter(path: Path, dtype: torch.dtype = torch.float32) -> BlockDraft:
    """A z-lab DFlash or speculators DFlash / DSpark directory -> the network (the target's embeddings and LM head
    are not loaded: the drafter shares the target's)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpecdecError(f"{path}: no config.json (a block drafter directory is config.json + safetensors)")
    c = read_config(path)
    skip = ("embed_tokens.", "verifier_norm.", "verifier_lm_head.", "lm_head.", "d2t", "t2d")
    layers = {f"model.{k}": v for k, v in read_tensors(path, lambda n: not n.startswith(skip)).items()}
    state = {k.removeprefix("model."): v for k, v in fuse_projections(layers, c.layer.num_layers).items()}
    net = BlockDraft(c)
    load_exact(net, state, path, f"a {c.kind} drafter")
    return net.to(dtype).eval()


def _layer_dict(c: BlockConfig) -> dict:
    """The draft layers' Qwen3 config.json entries."""
    d = {**c.layer.to_hf_dict(), "model_type": "qwen3", "num_hidden_layers": c.layer.num_layers}
    del d["architectures"]
    return d


def save_zlab(net: BlockDraft, out: Path, num_target_layers: int, manifest: dict | None = None) -> Path:
    """z-lab's DFlash layout (what `dflash.DFlashDraftModel.from_pretrained` loads); DFlash networks only."""
    c = net.config
    if c.kind != "dflash" or c.sample_from_anchor:
        raise SpecdecError("the z-lab layout holds DFlash drafters only (use the speculators layout for DSpark)")
    cfg = {
        **_layer_dict(c),
        "architectures": ["DFlashDraftModel"],
        "num_target_layers": num_target_layers,
        "block_size": c.block_size,
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in c.feature_layers],
            "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
        },
    }
    _write(Path(out), unfused_state(net), cfg, manifest)
    return Path(out)


def save_speculators(net: BlockDraft, out: Path, verifier: str, manifest: dict | None = None) -> Path:
    """speculators 0.9.0's `dflash` / `dspark` layout (`DFlashDraftModel` / `DSparkDraftModel.from_pretrained`)."""
    c = net.config
    kind = c.kind
    cfg = {
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_dict(c),
        "draft_vocab_size": c.layer.vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.layer.hidden_size,
        "aux_hidden_state_layer_ids": list(c.feature_layers),
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": c.sample_from_anchor,
        "speculators_config": speculators_config(kind, verifier, _architectures(verifier), c.drafts),
    }
    if kind == "dspark":
        cfg.update(
            markov_rank=c.markov_rank,
            markov_head_type="vanilla",
            enable_confidence_head=c.confidence,
            confidence_head_with_markov=c.confidence_with_markov,
        )
    _write(Path(out), unfused_state(net), cfg, manifest)
    return Path(out)
