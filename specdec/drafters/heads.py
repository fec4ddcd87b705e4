"""Where trained drafter heads are found: a directory with a `manifest.json` naming its `kind` and `target`."""
from __future__ import annotations

import json
from pathlib import Path

from specdec import paths
from specdec.errors import SpecdecError

SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # heads committed with the package


def find_head(target: str | None, kind: str, flag: str) -> Path:
    """The newest head of `kind` trained for `target` (a pack name or model path) under SPECDEC_HOME/heads, else one
    shipped with specdec; `flag` names the option that gives a head directory instead."""
    name = Path(target).name if target else ""
    found = [m.parent for root in (paths.home() / "heads", SHIPPED) if root.is_dir()
             for m in sorted(root.glob("*/manifest.json"), key=lambda f: f.stat().st_mtime, reverse=True)
             if _manifest_matches(m, kind, name)]
    if not found:
        raise SpecdecError(f"no {kind} head for {target!r} (train one: specdec train {kind} -m {target}; or give "
                           f"{flag} DIR)")
    return found[0]


def _manifest_matches(path: Path, kind: str, target: str) -> bool:
    m = json.loads(path.read_text())
    return m.get("kind") == kind and Path(str(m.get("target", ""))).name == target
