"""Drafters, one file each, all behind `Drafter.propose`, registered here with one line per file."""

from specdec.drafters import (
    dflash,
    draft_model,
    dspark,
    eagle3,
    early_exit,
    medusa,
    mtp,
    ngram_map_k,
    ngram_mod,
    ngram_simple,
    suffix,
    synthetic,
)
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.chain import assemble
from specdec.drafters.registry import REGISTRY, BuildContext, DrafterType, Option, register
from specdec.errors import SpecdecError

# The spec type when none is given and there is a draft model (the default pair too): the suffix tree first, the draft
# model where the suffix tree has nothing (Spec-Bench decode, 0.5B draft for the 1.5B, AMD EPYC Zen 3: 1.18x plain,
# the draft model alone 1.01x; `specdec bench --workload spec_bench --methods none,draft,suffix-tree,draft`).
DEFAULT_WITH_DRAFT_MODEL = "suffix-tree,draft"
# The spec type when none is given and the model comes alone (`-m` without `-md`): model-free drafting, whose
# drafts stop where another token is expected to cost more than it saves (`ngram_index.MatchAcceptance`).
DEFAULT_MODEL_FREE = "suffix"


def default_spec_type(model: str | None, draft: str | None) -> str:
    """The spec type when none is given: with a draft model or none named (the default pair), else the model alone."""
    return DEFAULT_WITH_DRAFT_MODEL if draft or model is None else DEFAULT_MODEL_FREE


for _module in (
    draft_model,
    ngram_simple,
    ngram_map_k,
    ngram_mod,
    suffix,
    synthetic,
    eagle3,
    medusa,
    mtp,
    early_exit,
    dflash,
    dspark,
):  # registry lines
    for _t in _module.TYPES:
        register(_t)


def spec_types(lossy: bool | None = None, heads: bool = True) -> tuple[str, ...]:
    """'none' and every registered spec type (lossy False: the lossless ones; True: only the lossy ones; heads False:
    without those that read target features, i.e. need a trained head)."""
    names = REGISTRY.names(lossy)
    if not heads:
        names = tuple(n for n in names if not REGISTRY.types[n].target_features)
    return (() if lossy else ("none",)) + names


def parse_spec_type(spec: str) -> list[str]:
    """'ngram-mod,draft' -> ['ngram-mod', 'draft'] (a chain); unknown names, 'none' in a chain and repeats fail."""
    parts = [p.strip() for p in spec.split(",")]
    for p in parts:
        if p != "none":
            REGISTRY.get(p)
    if len(parts) > 1 and "none" in parts:
        raise SpecdecError(f"spec type chain {spec!r} cannot contain 'none'")
    if len(set(parts)) < len(parts):
        raise SpecdecError(f"spec type chain {spec!r} repeats a drafter")
    return parts


def build_drafter(spec: str, ctx: BuildContext, chain_mode: str = "first") -> Drafter | None:
    """A fresh drafter for a spec type or chain (None for 'none'), every member built from `ctx`."""
    return assemble(parse_spec_type(spec), lambda p: None if p == "none" else REGISTRY.get(p).build(ctx), chain_mode)


def is_lossy(spec: str) -> bool:
    """Whether a spec type or chain includes an opt-in lossy drafter."""
    return any(p != "none" and REGISTRY.get(p).lossy for p in parse_spec_type(spec))


__all__ = [
    "DEFAULT_WITH_DRAFT_MODEL",
    "REGISTRY",
    "BuildContext",
    "Draft",
    "Drafter",
    "DrafterType",
    "Option",
    "build_drafter",
    "is_lossy",
    "parse_spec_type",
    "register",
    "spec_types",
]
