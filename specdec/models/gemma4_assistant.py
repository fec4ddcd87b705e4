"""The Gemma 4 assistant (`Gemma4AssistantForCausalLM`, transformers' models/gemma4_assistant): a small Gemma 4
text model that drafts for its target from the target's own state, with no K/V of its own.

One draft step at position p (the position of the last token t, which the target has not run yet):
    x = pre_projection([target_embedding(t); h])      h: the target's final-normed state at p - 1
    x -> the assistant's layers, each attending with its own queries to the target's K/V of positions < p in the
         last target layer of its type (sliding or full)
    logits = lm_head(norm(x)); the next h = post_projection(norm(x))
Every draft step runs at the same position p, with the token it drafted and the h it returned (transformers'
`MTPCandidateGenerator`, llama.cpp's `draft-mtp` with a gemma4-assistant GGUF). The sliding layers see the last
sliding_window + 1 of those keys, as transformers' assistant masks them (llama.cpp's causal window: the last
sliding_window - 1).

Where the checkpoint orders its embeddings (`use_ordered_embeddings`: the E2B / E4B assistants), the logits are
computed over the tokens of the top `centroid_intermediate_top_k` of `num_centroids` clusters only, the others set
below them (transformers' `Gemma4AssistantMaskedEmbedder`; llama.cpp computes all of them).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.state import load_exact, read_tensors
from specdec.models.transformer import Transformer, fuse_projections
from specdec.runtime.kv_cache import KVCache

MODEL_TYPE, GGUF_ARCH = "gemma4_assistant", "gemma4-assistant"  # (llama.cpp's converter: conversion/gemma.py)


def is_assistant(path: Path | str | None) -> bool:
    """Whether `path` is a Gemma 4 assistant: a checkpoint directory, or llama.cpp's GGUF of one."""
    path = Path(path or "")
    if path.suffix == ".gguf" and path.is_file():
        from specdec.models.gguf_convert import gguf_architecture

        return gguf_architecture(path) == GGUF_ARCH
    config = path / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == MODEL_TYPE


class Gemma4Assistant(nn.Module):
    def __init__(self, cfg: ModelConfig, backbone_hidden: int, clusters: tuple[int, int] | None = None):
        """`clusters`: (num_centroids, centroid_intermediate_top_k) of ordered embeddings, None: all logits."""
        super().__init__()
        self.text = Transformer(cfg)  # embed_tokens (the LM head), layers without K/V of their own, norm
        self.pre_projection = nn.Linear(2 * backbone_hidden, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, backbone_hidden, bias=False)
        self.clusters = clusters
        if clusters is not None:
            self.centroids = nn.Linear(cfg.hidden_size, clusters[0], bias=False)
            self.register_buffer("token_ordering", torch.zeros(cfg.vocab_size, dtype=torch.long))

    def attach(self, target: ModelConfig) -> None:
        """Point each layer at the target layer whose K/V it reads: the last one of its type that keeps K/V."""
        last = {s: max(i for i in range(target.num_layers) if target.sliding(i) == s) for s in (False, True)}
        for layer in self.text.model.layers:
            a = layer.self_attn
            source = target.kv_layer(last[a.sliding])
            if target.attn_shape(source) != (a.kv_heads, a.head_dim):
                raise SpecdecError(
                    f"this Gemma 4 assistant's {'sliding' if a.sliding else 'full'} layers take K/V of "
                    f"{a.kv_heads} x {a.head_dim}; the target's give {target.attn_shape(source)}"
                )
            a.kv_layer = source

    @torch.inference_mode()
    def forward(
        self, emb: torch.Tensor, h: torch.Tensor, position: int, slot: int, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, h [1, Hb] (the target's embedding of the last token, the target's or the previous step's state) ->
        (logits [V] in float32, the next state [1, Hb]); `cache`: the target's."""
        x = self.pre_projection(torch.cat([emb, h], dim=-1))[None]  # [1, 1, H]
        positions = torch.tensor([[position]])
        n = len(self.text.model.layers)
        _, hidden = self.text.forward(
            positions,  # (no token ids: the input is `resume`)
            positions,
            torch.tensor([slot]),
            cache,
            cache_index=positions - 1,  # reads keys < position, writes nothing
            logits_index=torch.zeros(0, dtype=torch.long),
            hidden_layers=(n,),
            resume=x,
        )
        out = self.text.model.norm(hidden[n])[0]  # [1, H]
        return self._logits(out[0]), self.post_projection(out)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normed state [H] -> logits [V] (float32): all of them, or those of the best clusters' tokens."""
        weight = self.text.model.embed_tokens.weight
        if self.clusters is None:
            return self.text.logits(x)
        count, top = self.clusters
        chosen = self.centroids(x).topk(top).indices  # [top]
        tokens = self.token_ordering.view(count, -1)[chosen].reshape(-1)  # [top * V / count]
        picked = (weight[tokens] @ x).float()
        return torch.full((weight.shape[0],), float(picked.min()) - 1.0).index_copy_(0, tokens, picked)


def _our_name(name: str) -> str:
    """A checkpoint tensor's name in `Gemma4Assistant`."""
    return "text." + name if name.startswith("model.") else name.removeprefix("masked_embedding.")


def _text_config(text: ModelConfig) -> ModelConfig:
    """The assistant's layers as they run: every one reading the target's K/V; no soft cap on the logits
    (transformers' assistant applies none); sliding layers keeping keys above p - (window + 2) for a query at p: the
    window + 1 keys before p."""
    window = None if text.sliding_window is None else text.sliding_window + 2
    return replace(text, kv_shared_layers=text.num_layers, final_softcap=None, sliding_window=window)


def load_assistant(path: Path | str, dtype: torch.dtype = torch.float32) -> Gemma4Assistant:
    """A Gemma 4 assistant checkpoint directory or llama.cpp's GGUF of one."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    d = json.loads((path / "config.json").read_text())
    text = _text_config(ModelConfig.from_hf_dict(d["text_config"]))
    clusters = (d["num_centroids"], d["centroid_intermediate_top_k"]) if d.get("use_ordered_embeddings") else None
    model = Gemma4Assistant(text, d["backbone_hidden_size"], clusters)
    state = read_tensors(path, lambda name: name != "lm_head.weight")
    fuse_projections(state, text.num_layers)
    ours = {_our_name(k): t for k, t in state.items()}
    load_exact(model, ours, path, "a Gemma 4 assistant", optional=("text.lm_head.weight",))
    model.text.lm_head.weight = model.text.model.embed_tokens.weight
    return model.to(dtype).requires_grad_(False).eval()


def _load_gguf(path: Path, dtype: torch.dtype) -> Gemma4Assistant:
    """llama.cpp's GGUF of an assistant: Gemma 4 metadata and layers under `gemma4-assistant`, the projections as
    `nextn.pre_projection` / `nextn.post_projection`; its converter leaves ordered embeddings out (all logits)."""
    from specdec.models import families
    from specdec.models.gguf_convert import _field, config_from_gguf, open_gguf
    from specdec.models.gguf_quantized import _dense, quantize_from_gguf

    reader = open_gguf(path)
    text = _text_config(config_from_gguf(reader, path, families.by_gguf_arch("gemma4")))
    with torch.device("meta"):
        model = Gemma4Assistant(text, int(_field(reader, f"{GGUF_ARCH}.embedding_length_out")))
    quantize_from_gguf(model.text, path, dtype, reader)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("pre_projection", "post_projection"):
        weight = _dense(tensors[f"nextn.{name}.weight"], text, dtype)
        getattr(model, name).weight = nn.Parameter(weight, requires_grad=False)
    return model.requires_grad_(False).eval()
