"""Drafters, one file each, all behind `Drafter.propose`."""
from specdec.drafters.base import Draft, Drafter
from specdec.errors import SpecdecError

SPEC_TYPES = ("none", "draft", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-map-k-tree", "ngram-mod",
              "suffix", "suffix-tree", "synthetic")
LOSSY_TYPES = ("synthetic",)  # opt-in only: output is not the target's
LOSSLESS_TYPES = tuple(t for t in SPEC_TYPES if t not in LOSSY_TYPES)


def parse_spec_type(spec: str) -> list[str]:
    """'ngram-mod,draft' -> ['ngram-mod', 'draft'] (a chain); unknown names, 'none' in a chain and repeats fail."""
    parts = [p.strip() for p in spec.split(",")]
    for p in parts:
        if p not in SPEC_TYPES:
            raise SpecdecError(f"unknown spec type {p!r} (choose {', '.join(SPEC_TYPES)}, "
                               "or a comma-separated chain such as ngram-mod,draft)")
    if len(parts) > 1 and "none" in parts:
        raise SpecdecError(f"spec type chain {spec!r} cannot contain 'none'")
    if len(set(parts)) < len(parts):
        raise SpecdecError(f"spec type chain {spec!r} repeats a drafter")
    return parts


__all__ = ["Draft", "Drafter", "LOSSLESS_TYPES", "LOSSY_TYPES", "SPEC_TYPES", "parse_spec_type"]
