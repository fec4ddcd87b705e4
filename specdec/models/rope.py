"""Rotary position embeddings with the scaling variants HF configs use (linear, llama3, yarn, longrope)."""

from __future__ import annotations

import math

import torch

from specdec.errors import SpecdecError


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor") or max_pos / p["original_max_position_embeddings"]
    orig = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


def _longrope(inv: torch.Tensor, p: dict, max_pos: int, context: int) -> tuple[torch.Tensor, float]:
    """Phi-3's longrope: the long factors where the context exceeds the original one, else the short ones
    (llama.cpp's rule, `llama_model::get_rope_factors`; transformers decides by each forward's last position, so a
    token's logits there depend on how far that forward reaches)."""
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attn = p.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
    factors = p["long_factor"] if context > orig else p["short_factor"]
    return inv / torch.tensor(factors, dtype=torch.float32), float(attn)


def inv_freq_and_scale(
    dim: int,
    theta: float,
    scaling: dict | None,
    max_pos: int,
    factors: tuple[float, ...] | None = None,
    context: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] of the `dim` rotated channels of a head and the attention scale applied to
    cos/sin; `factors` divide the inverse frequencies (a GGUF's `rope_freqs`, llama.cpp's form of llama3 scaling);
    `context` (default `max_pos`): the context the model runs at, which picks longrope's factors."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if factors is not None:
        inv = inv / torch.tensor(factors, dtype=torch.float32)
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, scaling, max_pos)
    if kind == "longrope":
        return _longrope(inv, scaling, max_pos, max_pos if context is None else context)
    if kind == "proportional":  # Gemma 4's full layers: the first pairs rotate at the whole head's frequencies
        rotated = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
        return torch.cat([inv[:rotated], torch.zeros(len(inv) - rotated)]) / scaling.get("factor", 1.0), 1.0
    raise SpecdecError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, yarn, longrope, proportional)")


class Rotary:
    """cos/sin tables of the `dim` rotated channels of a head (all of them, or the first ones: partial rotary),
    grown on demand, indexed by absolute position."""

    def __init__(
        self,
        dim: int,
        theta: float,
        scaling: dict | None,
        max_pos: int,
        factors: tuple[float, ...] | None = None,
        context: int | None = None,
    ):
        self.inv_freq, self.scale = inv_freq_and_scale(dim, theta, scaling, max_pos, factors, context)
        self.cos = self.sin = torch.empty(0, dim)

    def _grow(self, n: int, device: torch.device) -> None:
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, dim]
        self.cos = (emb.cos() * self.scale).to(device)
        self.sin = (emb.sin() * self.scale).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, dim] in `dtype`."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0], 256), positions.device)
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B, 1, T, R], R <= D: the first R channels rotated, the rest passed through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    return x * cos + rotate_half(x) * sin
