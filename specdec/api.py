"""Python API: `LLM(model, draft=..., spec_type=...).generate(prompt, ...)`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafters import SPEC_TYPES, Drafter
from specdec.engine.engine import Engine, SpecConfig, StreamCallback
from specdec.engine.stats import Stats
from specdec.errors import SpecdecError
from specdec.models import packs
from specdec.models.loader import load_checkpoint, resolve_dtype, resolve_model
from specdec.runtime.quant import quantize_int8_
from specdec.runtime.runner import ModelRunner
from specdec.sampling import SamplingParams


DRAFT_QUANT = ("int8", "none")


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str
    top2_gaps: list[float]  # per output token: the target's top-1 minus top-2 logit

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


class LLM:
    """A target model, optionally with a drafter. With no model, the default Qwen2.5-Coder pair."""

    def __init__(self, model: str | None = None, draft: str | None = None, spec_type: str | None = None,
                 context: int = 4096, dtype: str = "auto", threads: int | None = None, draft_max: int = 16,
                 draft_min: int = 0, draft_p_min: float = 0.0, ngram_n: int = 3, ngram_m: int = 16,
                 draft_quant: str = "int8", progress: bool = True):
        spec_type = spec_type or ("draft" if draft or model is None else "none")
        _check_positive(context=context, draft_max=draft_max, ngram_n=ngram_n, ngram_m=ngram_m)
        if draft_min < 0 or draft_min > draft_max:
            raise SpecdecError("draft_min must be between 0 and draft_max")
        if not 0 <= draft_p_min <= 1:
            raise SpecdecError("draft_p_min must be in [0, 1]")
        if draft_quant not in DRAFT_QUANT:
            raise SpecdecError(f"unknown draft quantization {draft_quant!r} (choose {', '.join(DRAFT_QUANT)})")
        if threads is not None:
            _check_positive(threads=threads)
            torch.set_num_threads(threads)
        if model is None:
            model = packs.DEFAULT_TARGET
            if spec_type == "draft" and draft is None:
                draft = packs.DEFAULT_DRAFT
        self.dtype = resolve_dtype(dtype)
        target, self.tokenizer = load_checkpoint(resolve_model(model, progress), self.dtype)
        context = min(context, target.config.max_position_embeddings)
        self.runner = ModelRunner(target, num_slots=1, context=context)
        self.spec_type = spec_type
        self._draft_name, self._p_min, self._ngram = draft, draft_p_min, (ngram_n, ngram_m)
        self._draft_quant = draft_quant
        self._spec = SpecConfig(draft_max, draft_min)
        self._progress = progress
        self._engines: dict[str, Engine] = {}
        self.engine = self.engine_for(spec_type)

    def engine_for(self, spec_type: str) -> Engine:
        """The engine for one spec type; all share the target and its KV cache."""
        if spec_type not in SPEC_TYPES:
            raise SpecdecError(f"unknown spec type {spec_type!r} (choose {', '.join(SPEC_TYPES)})")
        if spec_type not in self._engines:
            self._engines[spec_type] = Engine(self.runner, self.tokenizer, self._make_drafter(spec_type), self._spec)
        return self._engines[spec_type]

    def _make_drafter(self, spec_type: str) -> Drafter | None:
        if spec_type == "ngram-simple":
            from specdec.drafters.ngram_simple import NgramSimpleDrafter
            return NgramSimpleDrafter(*self._ngram)
        if spec_type == "draft":
            from specdec.drafters.draft_model import DraftModelDrafter
            if self._draft_name is None:
                raise SpecdecError("spec type 'draft' needs a draft model (-md)")
            dmodel, dtok = load_checkpoint(resolve_model(self._draft_name, self._progress), self.dtype)
            if not dtok.same_vocab(self.tokenizer):
                raise SpecdecError(f"draft model {self._draft_name} uses a different tokenizer than the target; "
                                   "a draft model must share the target's vocabulary")
            if self._draft_quant == "int8":
                quantize_int8_(dmodel)
            return DraftModelDrafter(ModelRunner(dmodel, 1, self.context), self.runner.vocab_size, self._p_min)
        return None

    @property
    def context(self) -> int:
        return self.runner.context

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                 chat: bool = False, system: str | None = None, on_text: StreamCallback | None = None,
                 spec_type: str | None = None) -> Result:
        """Generate from a prompt (text, or token ids); `spec_type` overrides the LLM's for this call."""
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat, system)
        params = SamplingParams(temperature, top_k, top_p, min_p, seed, max_tokens, list(stop or []))
        engine = self.engine if spec_type is None else self.engine_for(spec_type)
        seq = engine.generate(ids, params, on_text)
        return Result(seq.text, seq.output_ids, seq.stats, seq.finish_reason or "stop", seq.top2_gaps)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise SpecdecError(f"{name} must be >= 1 (got {v})")
