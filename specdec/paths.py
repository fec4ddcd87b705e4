"""Where specdec keeps downloads and converted models, and the lock that keeps two processes from filling one
place at once."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.errors import SpecdecError


def home() -> Path:
    """`$SPECDEC_HOME`, default `~/.cache/specdec`."""
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec")


@contextmanager
def file_lock(path: Path, waiting: str = "") -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created, with its folder) for the block: another process asking
    for it waits until this one is done (first printing `waiting`, if given, and the path to stderr). The lock is
    released when the file closes, so a killed process never leaves it held."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise SpecdecError(f"cannot create lock file {path}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(f"{waiting} ({path})", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
