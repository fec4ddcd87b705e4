"""EAGLE-3 draft head: one Llama-style decoder layer over fused low/mid/high target features.

    g = fc(concat(aux_0, aux_1, aux_2))                        # target hidden states entering layers `aux_layers`
    x = concat(input_layernorm(embed(token)), hidden_norm(g))  # [.., 2H]
    h = g + o_proj(attention(q/k/v(x)))                        # RoPE at the target's positions
    h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                  # over the draft vocabulary; h is the next step's g

The pair fed at position P is (token[P+1], g[P]): a target feature goes with the embedding of the token after
it. Parameter names follow the HF / SpecForge / SGLang layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t` as
offsets: target id = i + d2t[i], `t2d` as a mask over the target vocabulary), except that q/k/v and gate/up are
fused here (one matmul each); `save_head` / `load_head` convert. Token embeddings are the target's (frozen,
not part of the head). `save_speculators` writes the `speculators` layout that vLLM serves (`layers.0.*`, a
`speculators_config`); `specdec/models/eagle3_gguf.py` writes llama.cpp's `eagle3` GGUF.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.config import ModelConfig
from specdec.models.rope import Rotary, apply_rotary
from specdec.models.state import load_exact, read_tensors
from specdec.models.transformer import MLP, Batch, RMSNorm
from specdec.runtime.attention import attention
from specdec.runtime.kv_cache import KVCache

WEIGHTS = "model.safetensors"
HF_FUSED = {
    "midlayer.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "midlayer.mlp.gate_up_proj": ("gate_proj", "up_proj"),
}
SPECULATORS_VERSION = "0.9.0"  # the `speculators` release whose layout `save_speculators` writes (tested against it)
# speculators / EAGLE-3.1 variants this head does not implement (each False in the layout we read)
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # target layers whose INPUT hidden states are fused (HF hidden_states[k])
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    rope_scaling: dict | None = field(default=None, hash=False)

    @classmethod
    def for_target(
        cls,
        t: ModelConfig,
        draft_vocab: int,
        intermediate: int | None = None,
        aux_layers: tuple[int, ...] | None = None,
    ) -> Eagle3Config:
        """A head shaped like the target's layers (EAGLE-3's default aux layers (2, N // 2, N - 3))."""
        n = t.num_layers
        return cls(
            t.hidden_size,
            intermediate or t.intermediate_size,
            t.num_heads,
            t.num_kv_heads,
            t.head_dim,
            t.vocab_size,
            min(draft_vocab, t.vocab_size),
            t.hidden_size,
            aux_layers or (2, n // 2, n - 3),
            t.rms_norm_eps,
            t.rope_theta,
            t.max_position_embeddings,
            t.rope_scaling,
        )

    def to_hf(self) -> dict:
        """config.json of the HF / SpecForge layout (`LlamaForCausalLMEagle3`)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "attention_bias": False,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "torch_dtype": "float32",
        }

    def to_speculators(
        self, verifier: str, architectures: list[str], speculative_tokens: int, dtype: torch.dtype
    ) -> dict:
        """config.json of the `speculators` layout (`Eagle3SpeculatorConfig`, speculators 0.9.0)."""
        layer = {
            k: v
            for k, v in self.to_hf().items()
            if k
            not in (
                "architectures",
                "draft_vocab_size",
                "target_hidden_size",
                "torch_dtype",
                "eagle_aux_hidden_state_layer_ids",
            )
        }
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            **dict.fromkeys(UNSUPPORTED_FLAGS, False),
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "dtype": str(dtype).removeprefix("torch."),
            "speculators_config": speculators_config("eagle3", verifier, architectures, speculative_tokens),
        }

    @classmethod
    def from_hf(cls, d: dict, num_target_layers: int | None = None) -> Eagle3Config:
        """From an HF / SpecForge config.json, or a speculators one with `transformer_layer_config` merged in."""
        if d.get("num_hidden_layers", 1) != 1 or "draft_vocab_size" not in d:
            raise SpecdecError("not an EAGLE-3 head config (needs num_hidden_layers 1 and draft_vocab_size)")
        if flags := [f for f in UNSUPPORTED_FLAGS if d.get(f)]:
            raise SpecdecError(f"EAGLE-3 head variant not supported here ({', '.join(flags)} set)")
        aux = d.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if num_target_layers is None:
                raise SpecdecError(
                    "EAGLE-3 config has no eagle_aux_hidden_state_layer_ids; the target's layer count "
                    "is needed for the default (2, N // 2, N - 3)"
                )
            n = num_target_layers
            aux = (2, n // 2, n - 3)
        h = d["hidden_size"]
        theta, scaling = _rope(d)
        return cls(
            h,
            d["intermediate_size"],
            d["num_attention_heads"],
            d["num_key_value_heads"],
            d.get("head_dim") or h // d["num_attention_heads"],
            d["vocab_size"],
            d["draft_vocab_size"],
            d.get("target_hidden_size") or h,
            tuple(aux),
            d.get("rms_norm_eps", 1e-6),
            theta,
            d.get("max_position_embeddings", 32768),
            scaling,
        )


def speculators_config(algorithm: str, verifier: str, architectures: list[str], speculative_tokens: int) -> dict:
    """The `speculators_config` of a speculators config.json: greedy proposals of `speculative_tokens`."""
    proposal = {
        "proposal_type": "greedy",
        "speculative_tokens": speculative_tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "algorithm": algorithm,
        "proposal_methods": [proposal],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": architectures},
    }


def _rope(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from legacy keys or transformers 5's `rope_parameters`."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, scaling


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide concat(embedding, feature); no biases."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(2 * c.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q [B, heads, T, hd], k and v [B, kv_heads, T, hd], RoPE applied."""
        B, T, _ = x.shape
        c = self.c
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, batch.cos, batch.sin)
        cache.write(0, batch.slots, batch.cache_index, k, v, batch.write_span)
        keys, values = cache.read(0, batch.slots, batch.kv_len)  # [B, kv_heads, S, hd]
        return self.o_proj(attention(q, keys, values, batch.mask).reshape(B, T, self.q_size))


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(
            SimpleNamespace(
                hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, mlp_bias=False, hidden_act="silu"
            )
        )

    def inputs(self, emb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """[B, T, H] x 2 -> the attention input [B, T, 2H]."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)

    def finish(self, g: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual and MLP after attention: the pre-norm output h [B, T, H]."""
        h = g + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # target id = i + d2t[i]
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        with torch.device("cpu"):
            self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., L, Ht] (the target's features, in `aux_layers` order) -> g [..., H]."""
        return self.fc(aux.flatten(-2).to(self.dtype))

    def forward(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, cache: KVCache):
        """emb, g [B, T, H] at the batch's positions -> (draft logits [B, T, Vd] fp32, pre-norm h [B, T, H])."""
        x = self.midlayer.inputs(emb, g)
        h = self.midlayer.finish(g, self.midlayer.self_attn(x, batch, cache))
        return self.lm_head(self.norm(h)).float(), h

    @property
    def dtype(self) -> torch.dtype:
        """The head's activations (its norms' dtype: the matrices may run as quantized blocks)."""
        return self.norm.weight.dtype

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target token id of each draft-vocabulary entry."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these target token ids (sorted, [Vd]) as the draft vocabulary."""
        ids = target_ids.to(torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise SpecdecError(f"draft vocabulary needs {self.config.draft_vocab_size} distinct ids")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True


def save_head(head: Eagle3Head, out: Path, manifest: dict | None = None) -> Path:
    """The HF / SpecForge layout: config.json + model.safetensors (q/k/v and gate/up unfused, d2t, t2d)."""
    _write(out, hf_state(head), head.config.to_hf(), manifest)
    return out


def save_speculators(
    head: Eagle3Head,
    out: Path,
    verifier_name: str,
    speculative_tokens: int = 3,
    manifest: dict | None = None,
    embeddings: torch.Tensor | None = None,
) -> Path:
    """The `speculators` layout (what `Eagle3DraftModel.from_pretrained` and vLLM load): `layers.0.*`, `d2t`/`t2d`
    only with a reduced vocabulary. `verifier_name`: the target's HF id or path. `embeddings` (the target's token
    embeddings [V, H]) are stored as `embed_tokens.weight`, as speculators' own checkpoints do; without them vLLM
    shares the target's, but speculators 0.9.0 (under transformers 5.24) leaves its embedding uninitialized."""
    c = head.config
    state = {k.replace("midlayer.", "layers.0."): v for k, v in hf_state(head).items()}
    if c.draft_vocab_size == c.vocab_size:  # speculators keeps no vocabulary map then (its d2t/t2d are None)
        del state["d2t"], state["t2d"]
    if embeddings is not None:
        if embeddings.shape != (c.vocab_size, c.hidden_size):
            raise SpecdecError(
                f"embeddings {tuple(embeddings.shape)}: the head needs [{c.vocab_size}, {c.hidden_size}]"
            )
        state["embed_tokens.weight"] = embeddings.detach().to(head.dtype).contiguous()
    cfg = c.to_speculators(verifier_name, _architectures(verifier_name), speculative_tokens, head.dtype)
    _write(out, state, cfg, manifest)
    return out


def hf_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors under HF / SpecForge names (`midlayer.*`, q/k/v and gate/up unfused)."""
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    c = head.config
    for fused, parts in HF_FUSED.items():
        w = state.pop(f"{fused}.weight")
        sizes = (
            [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2
            if "qkv" in fused
            else [c.intermediate_size] * 2
        )
        owner = fused.rsplit(".", 1)[0]
        for name, part in zip(parts, w.split(sizes)):
            state[f"{owner}.{name}.weight"] = part.contiguous()
    return state


def _write(out: Path, state: dict[str, torch.Tensor], config: dict, manifest: dict | None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if manifest is not None:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _architectures(verifier: str) -> list[str]:
    """The verifier's `architectures` when it is a local HF directory, else none (speculators allows [])."""
    cfg = Path(verifier) / "config.json"
    return list(json.loads(cfg.read_text()).get("architectures") or []) if cfg.is_file() else []


def load_head(path: Path, num_target_layers: int | None = None, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A head saved by `save_head` or by SpecForge / SGLang (`midlayer.*`), or in the speculators layout
    (`save_speculators`, `Eagle3DraftModel.save_pretrained`: `layers.0.*`, `d2t`/`t2d` or vLLM's
    `draft_id_to_target_id`, the target's `embed_tokens` dropped)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise SpecdecError(f"{path}: no config.json (an EAGLE-3 head directory is config.json + safetensors)")
    d = json.loads(cfg_file.read_text())
    d = {**d.get("transformer_layer_config", {}), **{k: v for k, v in d.items() if k != "transformer_layer_config"}}
    head = Eagle3Head(Eagle3Config.from_hf(d, num_target_layers))
    state = _to_ours(read_tensors(path), head)
    load_exact(head, state, path, "an EAGLE-3 head", optional=("t2d",))
    if "t2d" not in state:
        head.t2d[head.draft_to_target] = True
    return head.to(dtype).eval()


def _to_ours(state: dict[str, torch.Tensor], head: Eagle3Head) -> dict[str, torch.Tensor]:
    """Other layouts' names -> ours (speculators `layers.0.`, vLLM's `draft_id_to_target_id`; unfused q/k/v,
    gate/up); embeddings the head does not keep are dropped."""
    state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items() if not k.startswith("embed_tokens")}
    if "draft_id_to_target_id" in state:
        state["d2t"] = state.pop("draft_id_to_target_id")
    for fused, parts in HF_FUSED.items():
        owner = fused.rsplit(".", 1)[0]
        names = [f"{owner}.{p}.weight" for p in parts]
        if all(n in state for n in names):
            state[f"{fused}.weight"] = torch.cat([state.pop(n) for n in names])
    state["d2t"] = state["d2t"].to(torch.long) if "d2t" in state else torch.zeros_like(head.d2t)
    if "t2d" in state:
        state["t2d"] = state["t2d"].to(torch.bool)
    return state
