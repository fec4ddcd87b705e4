"""Where specdec keeps downloads and converted models."""
from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """`$SPECDEC_HOME`, default `~/.cache/specdec`."""
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec")
