"""The one exception type users see: a clear, one-line message; and how a command reports it."""

from __future__ import annotations

import sys
from typing import Callable


class SpecdecError(Exception):
    """A user-facing error (bad input, missing file, unsupported model...)."""


def run_command(fn: Callable[[], int], interrupted: str = "interrupted") -> int:
    """fn() as a command's exit code: a SpecdecError is one line on stderr and 1, Ctrl-C is 130."""
    try:
        return fn()
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"specdec: {interrupted}", file=sys.stderr)
        return 130
