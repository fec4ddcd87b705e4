"""Model-free drafters by spec type, from one validated set of settings (the `--spec-*` flags)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.drafters.base import Drafter
from specdec.drafters.suffix import FACTOR
from specdec.errors import SpecdecError

MODEL_FREE = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-map-k-tree", "ngram-mod", "suffix",
              "suffix-tree", "synthetic")


@dataclass(frozen=True)
class ModelFreeSettings:
    ngram_n: int = 3
    ngram_m: int = 16
    ngram_min_hits: int = 1
    ngram_mod_pool_mb: float = 16.0
    suffix_max_requests: int = 64
    suffix_factor: float = FACTOR
    suffix_min_prob: float = 0.1
    synth_rates: tuple[float, ...] = (0.8,)
    synth_len: int = 8

    def __post_init__(self):
        for name in ("ngram_n", "ngram_m", "ngram_min_hits", "synth_len"):
            if getattr(self, name) < 1:
                raise SpecdecError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not 0 < self.ngram_mod_pool_mb <= 65536:
            raise SpecdecError(f"ngram_mod_pool_mb must be in (0, 65536] (got {self.ngram_mod_pool_mb})")
        if self.suffix_max_requests < 0:
            raise SpecdecError(f"suffix_max_requests must be >= 0 (got {self.suffix_max_requests})")
        if not 0 < self.suffix_factor < math.inf:
            raise SpecdecError(f"suffix_factor must be > 0 and finite (got {self.suffix_factor})")
        if not 0 <= self.suffix_min_prob <= 1:
            raise SpecdecError("suffix_min_prob must be in [0, 1]")
        if not self.synth_rates or not all(0 <= r <= 1 for r in self.synth_rates):
            raise SpecdecError("synthetic acceptance rates must be in [0, 1]")

    @property
    def pool_size(self) -> int:
        return max(1, int(self.ngram_mod_pool_mb * 2**20) // 4)  # int32 entries


def make_model_free(spec_type: str, s: ModelFreeSettings) -> Drafter:
    """A fresh drafter of one model-free spec type."""
    ngram = dict(n=s.ngram_n, m=s.ngram_m)
    if spec_type == "ngram-simple":
        from specdec.drafters.ngram_simple import NgramSimpleDrafter
        return NgramSimpleDrafter(**ngram)
    if spec_type.startswith("ngram-map-k"):
        from specdec.drafters.ngram_map_k import NgramMapK4VDrafter, NgramMapKDrafter, NgramMapKTreeDrafter
        cls = {"ngram-map-k": NgramMapKDrafter, "ngram-map-k4v": NgramMapK4VDrafter,
               "ngram-map-k-tree": NgramMapKTreeDrafter}[spec_type]
        return cls(**ngram, min_hits=s.ngram_min_hits)
    if spec_type == "ngram-mod":
        from specdec.drafters.ngram_mod import NgramModDrafter
        return NgramModDrafter(**ngram, pool_size=s.pool_size)
    if spec_type in ("suffix", "suffix-tree"):
        from specdec.drafters.suffix import SuffixDrafter, SuffixTreeDrafter
        return (SuffixDrafter if spec_type == "suffix" else SuffixTreeDrafter)(
            factor=s.suffix_factor, min_prob=s.suffix_min_prob, max_requests=s.suffix_max_requests)
    if spec_type == "synthetic":
        from specdec.drafters.synthetic import SyntheticDrafter
        return SyntheticDrafter(list(s.synth_rates), s.synth_len)
    raise SpecdecError(f"spec type {spec_type!r} is not model-free (model-free types: {', '.join(MODEL_FREE)})")
