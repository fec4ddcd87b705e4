"""Loading a state dict that must match a module exactly (a drafter head's checkpoint)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecdecError


def load_exact(module: nn.Module, state: dict[str, torch.Tensor], where: Path | str, what: str,
               optional: tuple[str, ...] = ()) -> None:
    """Load `state` into `module`; a tensor missing (other than `optional` ones) or left over is a SpecdecError
    saying that the file at `where` does not hold `what` (e.g. "Medusa heads")."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in optional]
    if missing or unexpected:
        raise SpecdecError(f"{where}: tensors do not match {what} (missing {missing[:3]}, unexpected {unexpected[:3]})")
