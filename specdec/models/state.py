"""Drafter heads' tensors on disk: reading a directory's safetensors (weights stored in int8 back in fp32), storing
weights in int8, loading a state dict that must match a module exactly, and which of a checkpoint's tensors are its
MTP blocks'."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.runtime.quant import int8_rows

SCALE = "_scale"  # an int8-stored weight `w` [rows, cols] keeps its per-row scales [rows] (fp32) as `w` + SCALE


def quantize_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-D floating tensor as int8 rows, each with one fp32 scale (its largest magnitude / 127, rounded to
    nearest); other tensors (norms, vocabulary maps) as they are. `read_tensors` undoes it."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.dim() != 2 or not t.is_floating_point():
            out[name] = t
            continue
        q, scale = int8_rows(t)  # [rows, cols], [rows]
        out[name], out[name + SCALE] = q.contiguous(), scale.contiguous()
    return out


def store_int8(path: Path | str) -> None:
    """Rewrite a safetensors file with its weights stored in int8 (`quantize_int8`), its metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as sf:
        state, meta = {n: sf.get_tensor(n) for n in sf.keys()}, sf.metadata()
    save_file(quantize_int8(state), str(path), metadata=meta)


def read_tensors(directory: Path | str, keep: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of a directory's *.safetensors whose names pass `keep`; int8-stored weights (`quantize_int8`)
    come back in fp32."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            dtypes = {n: sf.get_slice(n).get_dtype() for n in sf.keys()}
            scales = int8_scales(dtypes)
            for n in dtypes:
                if n in scales or not keep(n):
                    continue
                t = sf.get_tensor(n)
                if n + SCALE in scales:
                    t = t.float() * sf.get_tensor(n + SCALE)[:, None]
                state[n] = t
    return state


def int8_scales(dtypes: Mapping[str, str]) -> set[str]:
    """Which of a file's tensors (name -> safetensors dtype, e.g. "I8") are the scales of an int8-stored weight
    (`quantize_int8`), not tensors of their own."""
    return {n for n in dtypes if n.endswith(SCALE) and dtypes.get(n.removesuffix(SCALE)) == "I8"}


def load_exact(
    module: nn.Module, state: dict[str, torch.Tensor], where: Path | str, what: str, optional: tuple[str, ...] = ()
) -> None:
    """Load `state` into `module`; a tensor missing (other than `optional` ones) or left over is a SpecdecError
    saying that the file at `where` does not hold `what` (e.g. "Medusa heads")."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in optional]
    if missing or unexpected:
        raise SpecdecError(f"{where}: tensors do not match {what} (missing {missing[:3]}, unexpected {unexpected[:3]})")


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to MTP blocks (the target's loader skips them; models/mtp.py loads them)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return (m is not None and int(m.group(1)) >= num_layers) or name.startswith(("model.mtp_layers.", "mtp."))
