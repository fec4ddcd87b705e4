"""One configuration object for an `LLM`, built once from CLI flags, API keywords or a server's flags.

    Config.make(model="qwen2.5-coder-1.5b", spec_type="suffix", suffix_factor=2.0)  # API keywords
    Config.from_namespace(args)                                                       # parsed CLI flags

Drafter options (`ngram_n`, `suffix_factor`, ...) come from the drafter registry: their names, defaults and
rules live with the drafters (`specdec.drafters.registry.Option`), not here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from specdec import compat
from specdec.drafters import REGISTRY, default_spec_type, parse_spec_type
from specdec.drafters.chain import CHAIN_MODES
from specdec.engine.planner import SpecConfig
from specdec.errors import SpecdecError
from specdec.models import packs
from specdec.models.loader import QUANT_CHOICES

DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Config:
    model: str | None = None  # target: pack name, GGUF file or checkpoint dir; None = the default pair
    draft: str | None = None  # draft model (spec types that need one)
    spec_type: str | None = None  # a spec type or chain; None: `drafters.default_spec_type`
    context: int = 4096
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32
    quant: str = "auto"  # target weights: auto | gguf | int8 | int4 | none
    draft_quant: str = "auto"
    threads: int | None = None
    parallel: int = 1  # KV cache slots: sequences that can run at once
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    draft_max: int = SpecConfig.draft_max
    draft_min: int = SpecConfig.draft_min
    adaptive: bool = SpecConfig.adaptive
    chain_mode: str = "first"  # chains: first | gain
    progress: bool = True  # download/convert progress on stderr
    accept_threshold: float = 0.0  # opt-in LOSSY relaxed acceptance (--spec-accept-threshold); 0 = off
    cache_mb: int = 0  # prefix cache (MiB) shared by the target and a draft model; 0 = off
    fast_prefill: bool = False  # opt-in: large forwards in torch (`kernels.set_fast_prefill`), numbers change
    drafter: dict[str, Any] = field(default_factory=dict)  # drafter options (registry names), defaults filled in

    def __post_init__(self):
        for name in ("context", "draft_max", "parallel", *(("threads",) if self.threads is not None else ())):
            if getattr(self, name) < 1:
                raise SpecdecError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.cache_mb < 0:
            raise SpecdecError(f"cache_mb must be >= 0 (got {self.cache_mb})")
        if not 0 <= self.accept_threshold <= 1:
            raise SpecdecError(f"accept_threshold must be in [0, 1] (got {self.accept_threshold})")
        if not 0 <= self.draft_min <= self.draft_max:
            raise SpecdecError("draft_min must be between 0 and draft_max")
        for what, q in (("draft", self.draft_quant), ("target", self.quant)):
            if q not in QUANT_CHOICES:
                raise SpecdecError(f"unknown {what} quantization {q!r} (choose {', '.join(QUANT_CHOICES)})")
        if self.dtype not in DTYPES:
            raise SpecdecError(f"unknown dtype {self.dtype!r} (choose {', '.join(DTYPES)})")
        if self.chain_mode not in CHAIN_MODES:
            raise SpecdecError(f"unknown chain mode {self.chain_mode!r} (choose {', '.join(CHAIN_MODES)})")
        spec = self.spec_type or default_spec_type(self.model, self.draft)
        parts = parse_spec_type(spec)
        object.__setattr__(self, "spec_type", ",".join(parts))
        object.__setattr__(self, "drafter", REGISTRY.option_values(self.drafter))
        if self.model is None:  # the default pair
            object.__setattr__(self, "model", packs.DEFAULT_TARGET)
            if self.draft is None and any(p != "none" and REGISTRY.get(p).draft_model for p in parts):
                object.__setattr__(self, "draft", packs.DEFAULT_DRAFT)

    def settings(self) -> dict[str, Any]:
        """Every setting by its keyword: the fields, and the drafter options beside them."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "drafter"}, **self.drafter}

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(self.draft_max, self.draft_min, self.adaptive, self.accept_threshold)

    @classmethod
    def make(cls, **kw: Any) -> Config:
        """From keywords: Config fields and drafter option names side by side, and transformers' assisted-generation
        words (`compat.HF_WORDS`: assistant_model, prompt_lookup_num_tokens, ...); unknown names fail."""
        compat.refuse_other_names(kw, "LLM(...)")
        hf = {k: kw.pop(k) for k in compat.HF_WORDS if k in kw}
        kw = compat.merge(kw, compat.from_transformers(hf), "transformers' arguments")
        own = {f.name for f in fields(cls)} - {"drafter"}
        return cls(
            **{k: v for k, v in kw.items() if k in own},
            drafter={**kw.get("drafter", {}), **{k: v for k, v in kw.items() if k not in own | {"drafter"}}},
        )

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, **override: Any) -> Config:
        """From parsed CLI flags (`specdec generate|serve|bench`); flags a command lacks keep their defaults."""
        given = compat.from_flags({k: v for k, v in vars(args).items() if v is not None})
        if "spec_adaptive" in given:
            given["adaptive"] = given["spec_adaptive"] == "on"
        own = {f.name for f in fields(cls)} - {"drafter"}
        kw = {k: v for k, v in given.items() if k in own}
        kw["drafter"] = {k: v for k, v in given.items() if k in REGISTRY.options}
        return cls(**{**kw, **override})
