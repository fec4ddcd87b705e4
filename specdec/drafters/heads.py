"""Where trained drafter heads are found: a directory with a `manifest.json` naming its `kind` and `target`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from specdec import paths
from specdec.drafters.registry import HeadMemory, MemoryQuery, Option
from specdec.errors import SpecdecError
from specdec.models.state import int8_scales

SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # heads committed with the package
HEAD_QUANT = Option(
    "head_quant",
    "--spec-head-quant",
    "auto",
    "eagle3, medusa: auto = the head's matrices as Q8_0 "
    "blocks through the CPU kernels where it runs on the CPU in fp32 (its drafts may differ slightly; "
    "verification keeps the output the target's); none = the weights as loaded (default auto)",
    str,
    "auto or none",
)


def quantize_head(head: nn.Module, options) -> nn.Module:
    """`head` as --spec-head-quant asks: auto runs its fp32 CPU matrices as Q8_0 through the kernels when they are
    built (`runtime.quant.q8_0_`), none leaves it."""
    from specdec.runtime import kernels
    from specdec.runtime.quant import q8_0_

    if options.get(HEAD_QUANT.name, HEAD_QUANT.default) == "auto" and kernels.library() is not None:
        q8_0_(head)
    return head


@dataclass(frozen=True)
class Head:
    """A head directory and what its manifest says."""

    path: Path
    kind: str
    target: str  # the target's name (a pack name, or a model path's last part)
    finished: bool  # training ran to its end (a head saved mid-run says False)
    tau: float | None  # validation mean acceptance length, when the trainer measured one
    shipped: bool  # committed with specdec rather than under SPECDEC_HOME
    mtime: float

    @property
    def megabytes(self) -> float:
        """The weights' files (exports and training state beside them aside)."""
        return sum(f.stat().st_size for f in self.path.glob("*.safetensors")) / 1e6


def list_heads() -> list[Head]:
    """Every head under SPECDEC_HOME/heads and shipped with specdec: finished before unfinished, newest first."""
    heads = [
        _read(m, root == SHIPPED)
        for root in (paths.home() / "heads", SHIPPED)
        if root.is_dir()
        for m in root.glob("*/manifest.json")
    ]
    return sorted((h for h in heads if h is not None), key=lambda h: (h.shipped, not h.finished, -h.mtime))


def find_head(target: str | None, kind: str, flag: str) -> Path:
    """The head of `kind` trained for `target` (a pack name or model path): a finished one before an unfinished one,
    the newest first, SPECDEC_HOME/heads before those shipped with specdec; `flag` names the option that gives a
    head directory instead."""
    name = Path(target).name if target else ""
    found = [h.path for h in list_heads() if h.kind == kind and h.target == name]
    if not found:
        raise SpecdecError(
            f"no {kind} head for {target!r} (train one: specdec train {kind} -m {target}; or give {flag} DIR)"
        )
    return found[0]


def _read(path: Path, shipped: bool) -> Head | None:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    tau = (m.get("validation") or {}).get("tau")
    return Head(
        path.parent,
        str(m.get("kind", "")),
        Path(str(m.get("target", ""))).name,
        bool(m.get("finished", True)),
        tau,
        shipped,
        path.stat().st_mtime,
    )


@dataclass(frozen=True)
class HeadShape:
    """What a head holds at run time: parameters and its KV cache's layers x KV heads x head dim (0 layers: none)."""

    params: int
    kv_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0


def planned_memory(
    q: MemoryQuery,
    kind: str,
    locate: Callable[[], Path],
    shape: Callable[[Path], HeadShape],
    estimate: Callable[[MemoryQuery], HeadShape],
) -> HeadMemory:
    """A head's resident bytes for `specdec plan`: the head `--spec-type kind` would load (`locate`, as the
    drafter finds it) measured by `shape`, else `estimate` for a default head shaped for the target. Weights in the
    runtime dtype; the KV cache holds `context` positions per slot."""
    try:
        path = locate()
        s, where = shape(path), f"the head in {path}"
    except (SpecdecError, OSError, ValueError):
        s, where = estimate(q), f"no {kind} head found: a default head shaped for the target, estimated"
    kv = 2 * s.kv_layers * s.kv_heads * s.head_dim * q.context * q.slots * q.dtype_bytes
    parts = {f"{kind} head weights": s.params * q.dtype_bytes, **({f"{kind} head KV": kv} if kv else {})}
    return HeadMemory(parts, f"{kind}: {where} ({s.params / 1e6:.1f} M parameters)")


def safetensors_params(path: Path, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Elements of every tensor in `path`/*.safetensors (those `skip` names and int8 weights' scales aside), read
    from the headers."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        header.pop("__metadata__", None)
        scales = int8_scales({k: v["dtype"] for k, v in header.items()})
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k not in scales and not skip(k))
    if not total:
        raise SpecdecError(f"{path}: no safetensors weights")
    return total


def layer_params(q: MemoryQuery, hidden_in: int, intermediate: int | None = None) -> int:
    """Parameters of one decoder layer shaped like the target's (q/k/v read `hidden_in` features), norms included."""
    H, kv = q.hidden, q.num_kv_heads * q.head_dim
    attn = hidden_in * (q.num_heads * q.head_dim + 2 * kv) + q.num_heads * q.head_dim * H
    return attn + 3 * H * (intermediate or q.intermediate) + 2 * H
