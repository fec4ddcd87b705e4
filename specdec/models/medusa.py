"""Medusa-1 heads: K small heads on the target's final normed hidden state, each guessing one token further ahead.

    h = target_norm(final_t)                      # the target's own input to its LM head, at position t
    x_k = block_k(h)                              # num_layers x (x + SiLU(W x + b)), W zero-initialised
    logits_k = lm_heads[k](x_k)                   # over the draft vocabulary; head k = 1..K guesses token t+k+1

The target's LM head already gives token t+1, so K heads draft K tokens past it. The draft vocabulary is a
subset of the target's (`token_map`: the target id of each of its Vd entries, vLLM's `truncated_vocab_size` /
`token_map`). Saved in vLLM's layout (`blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight`, `token_map`;
config `num_heads`, `num_hidden_layers`, `hidden_size`, `vocab_size`, `truncated_vocab_size`); TGI's /
FasterDecoding's (`{i}.{j}.linear.weight/bias`, `{i}.{L}.weight`; config `medusa_num_heads`,
`medusa_num_layers`) is read too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.models.state import load_exact, read_tensors

WEIGHTS = "model.safetensors"
PREFIXES = ("medusa_heads.", "medusa_head.")  # dropped from tensor names on load (vLLM and FasterDecoding)


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int  # K
    num_layers: int  # residual blocks per head
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    draft_vocab_size: int  # Vd <= vocab_size

    def to_vllm(self) -> dict:
        """config.json of vLLM's Medusa layout (`MedusaModel`)."""
        return {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "truncated_vocab_size": self.draft_vocab_size,
            "medusa_fc_bias": True,
            "original_lm_head": False,
        }

    @classmethod
    def from_dict(cls, d: dict, state: dict[str, torch.Tensor]) -> MedusaConfig:
        """From a vLLM or TGI config; sizes the config leaves out are read off the tensors (ours names)."""
        heads = d.get("num_heads", d.get("medusa_num_heads"))
        layers = d.get("num_hidden_layers", d.get("medusa_num_layers"))
        if heads is None or layers is None:
            raise SpecdecError(
                "not a Medusa config (needs num_heads / medusa_num_heads and num_hidden_layers / medusa_num_layers)"
            )
        if "lm_heads.0.weight" not in state:
            raise SpecdecError("Medusa tensors without a first LM head (lm_heads.0.weight / 0.{L}.weight)")
        rows, hidden = state["lm_heads.0.weight"].shape
        vocab = d.get("vocab_size") or rows
        draft = d.get("truncated_vocab_size") or (len(state["token_map"]) if "token_map" in state else rows)
        return cls(heads, layers, hidden, vocab, draft)


class ResBlock(nn.Module):
    """`num_layers` x (x + SiLU(W x + b)); starts as the identity (W and b zero)."""

    def __init__(self, hidden: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, c: MedusaConfig):
        super().__init__()
        if not 0 < c.draft_vocab_size <= c.vocab_size or min(c.num_heads, c.num_layers) < 1:
            raise SpecdecError(f"bad Medusa config {c}")
        self.config = c
        self.blocks = nn.ModuleList(ResBlock(c.hidden_size, c.num_layers) for _ in range(c.num_heads))
        self.lm_heads = nn.ModuleList(
            nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False) for _ in range(c.num_heads)
        )
        self.register_buffer("token_map", torch.arange(c.draft_vocab_size))  # [Vd] target id of each entry

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The target's normed final states h [..., H] -> draft logits [..., K, Vd] (fp32); head k - 1 guesses the
        token k + 1 places after h's position."""
        h = h.to(self.dtype)
        return torch.stack([self.head(h, k) for k in range(self.config.num_heads)], dim=-2).float()

    @property
    def dtype(self) -> torch.dtype:
        """The heads' activations (a block's bias: the matrices may run as quantized blocks)."""
        return self.blocks[0].layers[0].bias.dtype

    def head(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Head k alone (0-based: it guesses the token k + 2 places after h's): h [..., H] -> logits [..., Vd]."""
        return self.lm_heads[k](self.blocks[k](h))

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these target token ids ([Vd], distinct; kept sorted) as the draft vocabulary."""
        ids = target_ids.to(torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise SpecdecError(f"draft vocabulary needs {self.config.draft_vocab_size} distinct ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise SpecdecError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        self.token_map.copy_(ids)

    def warm_start(self, rows: torch.Tensor) -> None:
        """Every head's LM head <- `rows` [Vd, H] (the target's LM-head rows at `token_map`)."""
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(rows)


def save_heads(heads: MedusaHeads, out: Path, manifest: dict | None = None) -> Path:
    """vLLM's layout: config.json + model.safetensors (`blocks.*`, `lm_heads.*`, `token_map`); manifest.json."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(heads.config.to_vllm(), indent=2))
    if manifest is not None:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def load_heads(path: Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Heads saved by `save_heads` or by vLLM tools, or in TGI's / FasterDecoding's layout
    (`medusa_lm_head.safetensors`)."""
    path = Path(path)
    cfg_file = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not cfg_file.is_file() or not files:
        raise SpecdecError(f"{path}: a Medusa head directory holds config.json and *.safetensors")
    d = json.loads(cfg_file.read_text())
    state = _to_ours(read_tensors(path), d)
    heads = MedusaHeads(MedusaConfig.from_dict(d, state))
    state = _complete(state, heads, d)
    load_exact(heads, state, path, "Medusa heads")
    return heads.to(dtype).eval()


def _to_ours(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """TGI names (`{i}.{j}.linear.*`, `{i}.{L}.weight`) and prefixed ones -> ours."""
    state = {next((k[len(p) :] for p in PREFIXES if k.startswith(p)), k): v for k, v in state.items()}
    layers = d.get("num_hidden_layers", d.get("medusa_num_layers"))
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = re.fullmatch(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)", k)
        if m is None:
            out[k] = v
        elif m.group(3):
            out[f"blocks.{m.group(1)}.layers.{m.group(2)}.{m.group(4)}"] = v
        elif layers is not None and int(m.group(2)) == layers:
            out[f"lm_heads.{m.group(1)}.weight"] = v
        else:
            raise SpecdecError(f"unexpected Medusa tensor {k!r}")
    return out


def _complete(state: dict[str, torch.Tensor], heads: MedusaHeads, d: dict) -> dict[str, torch.Tensor]:
    """What other layouts leave implicit: zero biases (vLLM `medusa_fc_bias` false), one LM head shared by all heads
    (`original_lm_head`), full-vocabulary LM heads cut to `token_map`, the identity map of an untruncated head."""
    c = heads.config
    state.setdefault("token_map", torch.arange(c.draft_vocab_size))
    state["token_map"] = state["token_map"].to(torch.long)
    for i in range(c.num_heads):
        if d.get("original_lm_head") and f"lm_heads.{i}.weight" not in state:
            state[f"lm_heads.{i}.weight"] = state["lm_heads.0.weight"]
        w = state.get(f"lm_heads.{i}.weight")
        if w is not None and w.shape[0] == c.vocab_size > c.draft_vocab_size:
            state[f"lm_heads.{i}.weight"] = w[state["token_map"]]
        for j in range(c.num_layers):
            key = f"blocks.{i}.layers.{j}"
            if f"{key}.weight" in state and f"{key}.bias" not in state and not d.get("medusa_fc_bias"):
                state[f"{key}.bias"] = torch.zeros(c.hidden_size, dtype=state[f"{key}.weight"].dtype)
    return state
