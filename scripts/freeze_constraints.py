"""Print exact pins for specdec's runtime and dev dependencies and everything they pull in, as installed here.

`python scripts/freeze_constraints.py > constraints.txt` after a green `bash scripts/test.sh`: scripts/test.sh and
scripts/demo.sh install with `-c constraints.txt`, so a fresh machine gets the versions that suite passed with."""

from __future__ import annotations

import re
from importlib import metadata

ROOT = "specdec"
EXTRAS = {"dev"}


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _wanted(requirement: str, extras: set[str]) -> bool:
    marker = requirement.partition(";")[2]
    found = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    return found is None or found.group(1) in extras


def closure() -> dict[str, str]:
    """name -> installed version, over the requirement graph from specdec[dev]."""
    pins: dict[str, str] = {}
    todo = [(ROOT, EXTRAS)]
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        for req in dist.requires or []:
            dep = _name(req)
            if _wanted(req, extras) and dep not in pins and dep != ROOT:
                pins[dep] = dist_version(dep)
                todo.append((dep, set()))
    return {k: v for k, v in pins.items() if v}


def dist_version(name: str) -> str:
    try:
        return metadata.version(name).split("+")[0]  # torch's "+cpu" is a local label: == ignores it
    except metadata.PackageNotFoundError:
        return ""


if __name__ == "__main__":
    print(
        "# Exact versions `bash scripts/test.sh` passed with (python scripts/freeze_constraints.py > constraints.txt)"
    )
    for dep, version in sorted(closure().items()):
        print(f"{dep}=={version}")
