"""Layer placement for `-ngl N` / `-ngld N`: which parts of a model sit on the GPU. Pure; no torch.

Two conventions, both unit-tested:
- `specdec` (our runtime): the first N decoder layers on the GPU, together with the token
  embeddings (when N >= 1) and the final norm + LM head (when N covers every layer). Activations
  cross the GPU/CPU boundary once per split.
- `llama.cpp`: the last N repeating layers on the GPU; token embeddings always on the CPU; the
  output layer (final norm + LM head) on the GPU only when N > number of layers (hence `-ngl 99`).
"""

from __future__ import annotations

from dataclasses import dataclass

STYLES = ("specdec", "llama.cpp")
ALL_LAYERS = 999  # `-ngl all`


@dataclass(frozen=True)
class Placement:
    num_layers: int
    n_gpu_layers: int  # decoder layers on the GPU (clamped to num_layers)
    layers: tuple[str, ...]  # "gpu" | "cpu" per decoder layer
    embed: str  # token embeddings
    head: str  # final norm + LM head
    style: str

    @property
    def crossings(self) -> int:
        """Device changes along embeddings -> layers -> head (hidden states copied per token)."""
        seq = (self.embed, *self.layers, self.head)
        return sum(a != b for a, b in zip(seq, seq[1:]))

    @property
    def gpu_layers(self) -> list[int]:
        return [i for i, d in enumerate(self.layers) if d == "gpu"]

    @property
    def on_gpu(self) -> bool:
        return "gpu" in (self.embed, self.head, *self.layers)

    def module_devices(self, gpu: str = "cuda:0", cpu: str = "cpu") -> dict[str, str]:
        """Module name (as in `specdec.models.transformer`) -> torch device string."""
        dev = {"gpu": gpu, "cpu": cpu}
        out = {"model.embed_tokens": dev[self.embed]}
        out.update({f"model.layers.{i}": dev[d] for i, d in enumerate(self.layers)})
        out.update({"model.norm": dev[self.head], "lm_head": dev[self.head]})
        return out


def place_layers(num_layers: int, n_gpu_layers: int, style: str = "specdec") -> Placement:
    """Where each part of a `num_layers`-layer model goes for `-ngl n_gpu_layers` (>= 0; 999 = all)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if n_gpu_layers < 0:
        raise ValueError(f"n_gpu_layers must be >= 0, got {n_gpu_layers}")
    if style not in STYLES:
        raise ValueError(f"unknown placement style {style!r} (choose {', '.join(STYLES)})")
    n = min(n_gpu_layers, num_layers)
    if style == "specdec":
        layers = tuple("gpu" if i < n else "cpu" for i in range(num_layers))
        embed = "gpu" if n >= 1 else "cpu"
        head = "gpu" if n == num_layers else "cpu"
    else:
        layers = tuple("gpu" if i >= num_layers - n else "cpu" for i in range(num_layers))
        embed = "cpu"
        head = "gpu" if n_gpu_layers > num_layers else "cpu"
    return Placement(num_layers, n, layers, embed, head, style)


def offload_notice(n_gpu_layers: int | None, n_gpu_layers_draft: int | None, cuda: bool | None = None) -> str | None:
    """The one line `generate`/`serve` print for -ngl/-ngld, or None when there is nothing to say."""
    if not n_gpu_layers and not n_gpu_layers_draft:
        return None
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        return "specdec: -ngl/-ngld ignored: no CUDA device, every layer runs on the CPU"
    return (
        f"specdec: -ngl {n_gpu_layers or 0} / -ngld {n_gpu_layers_draft or 0}: those first layers on the GPU, "
        "the rest on the CPU (`specdec plan` shows the placement)"
    )
