"""Where trained drafter heads are found: a directory with a `manifest.json` naming its `kind` and `target`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec import paths
from specdec.errors import SpecdecError

SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # heads committed with the package


@dataclass(frozen=True)
class Head:
    """A head directory and what its manifest says."""
    path: Path
    kind: str
    target: str          # the target's name (a pack name, or a model path's last part)
    finished: bool       # training ran to its end (a head saved mid-run says False)
    tau: float | None    # validation mean acceptance length, when the trainer measured one
    shipped: bool        # committed with specdec rather than under SPECDEC_HOME
    mtime: float

    @property
    def megabytes(self) -> float:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file()) / 1e6


def list_heads() -> list[Head]:
    """Every head under SPECDEC_HOME/heads and shipped with specdec: finished before unfinished, newest first."""
    heads = [_read(m, root == SHIPPED) for root in (paths.home() / "heads", SHIPPED) if root.is_dir()
             for m in root.glob("*/manifest.json")]
    return sorted((h for h in heads if h is not None), key=lambda h: (h.shipped, not h.finished, -h.mtime))


def find_head(target: str | None, kind: str, flag: str) -> Path:
    """The head of `kind` trained for `target` (a pack name or model path): a finished one before an unfinished one,
    the newest first, SPECDEC_HOME/heads before those shipped with specdec; `flag` names the option that gives a
    head directory instead."""
    name = Path(target).name if target else ""
    found = [h.path for h in list_heads() if h.kind == kind and h.target == name]
    if not found:
        raise SpecdecError(f"no {kind} head for {target!r} (train one: specdec train {kind} -m {target}; or give "
                           f"{flag} DIR)")
    return found[0]


def _read(path: Path, shipped: bool) -> Head | None:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    tau = (m.get("validation") or {}).get("tau")
    return Head(path.parent, str(m.get("kind", "")), Path(str(m.get("target", ""))).name,
                bool(m.get("finished", True)), tau, shipped, path.stat().st_mtime)
