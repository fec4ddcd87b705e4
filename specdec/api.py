"""Python API: `LLM(model, draft=..., spec_type=...).generate(prompt, ...)`."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable

import torch

from specdec.drafters import Drafter, parse_spec_type
from specdec.drafters.chain import CHAIN_MODES, ChainDrafter
from specdec.drafters.factory import MODEL_FREE, ModelFreeSettings, make_model_free
from specdec.drafters.suffix import FACTOR
from specdec.engine.engine import Engine, SpecConfig, StreamCallback
from specdec.engine.stats import Stats
from specdec.errors import SpecdecError
from specdec.models import packs
from specdec.models.loader import (QUANT_CHOICES, load_checkpoint, resolve_dtype, resolve_gguf, resolve_model,
                                   resolve_quant)
from specdec.runtime.quant import quantize_
from specdec.runtime.runner import ModelRunner
from specdec.sampling import SamplingParams


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str
    top2_gaps: list[float]  # per output token: the target's top-1 minus top-2 logit
    synthetic: bool = False  # a synthetic drafter forced acceptances: NOT the target's output

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "synthetic": self.synthetic, "stats": self.stats.to_dict()}


class LLM:
    """A target model, optionally with a drafter. With no model, the default Qwen2.5-Coder pair."""

    def __init__(self, model: str | None = None, draft: str | None = None, spec_type: str | None = None,
                 context: int = 4096, dtype: str = "auto", threads: int | None = None, draft_max: int = 16,
                 draft_min: int = 0, draft_p_min: float = 0.0, ngram_n: int = 3, ngram_m: int = 16,
                 draft_quant: str = "auto", progress: bool = True, adaptive: bool = True,
                 draft_branch_p: float = 0.0, ngram_min_hits: int = 1,
                 ngram_mod_pool_mb: float = 16.0, suffix_max_requests: int = 64, suffix_factor: float = FACTOR,
                 suffix_min_prob: float = 0.1, synth_rates: list[float] | None = None, synth_len: int = 8,
                 parallel: int = 1, chain_mode: str = "first", n_gpu_layers: int = 0, n_gpu_layers_draft: int = 0,
                 quant: str = "auto"):
        spec_type = spec_type or ("draft" if draft or model is None else "none")
        self.spec_type = ",".join(parse_spec_type(spec_type))
        _check_positive(context=context, draft_max=draft_max, parallel=parallel)
        if draft_min < 0 or draft_min > draft_max:
            raise SpecdecError("draft_min must be between 0 and draft_max")
        if not 0 <= draft_p_min <= 1:
            raise SpecdecError("draft_p_min must be in [0, 1]")
        if not 0 <= draft_branch_p <= 1:
            raise SpecdecError("draft_branch_p must be in [0, 1]")
        for what, q in (("draft", draft_quant), ("target", quant)):
            if q not in QUANT_CHOICES:
                raise SpecdecError(f"unknown {what} quantization {q!r} (choose {', '.join(QUANT_CHOICES)})")
        self._model_free = ModelFreeSettings(ngram_n, ngram_m, ngram_min_hits, ngram_mod_pool_mb, suffix_max_requests,
                                             suffix_factor, suffix_min_prob, tuple(synth_rates or [0.8]), synth_len)
        if chain_mode not in CHAIN_MODES:
            raise SpecdecError(f"unknown chain mode {chain_mode!r} (choose {', '.join(CHAIN_MODES)})")
        self._chain_mode = chain_mode
        if threads is not None:
            _check_positive(threads=threads)
            torch.set_num_threads(threads)
        if model is None:
            model = packs.DEFAULT_TARGET
            if "draft" in self.spec_type.split(",") and draft is None:
                draft = packs.DEFAULT_DRAFT
        target, self.tokenizer, self.quant, self.dtype = load_model(model, quant, dtype, n_gpu_layers, progress)
        self._dtype_name, self._ngld = dtype, n_gpu_layers_draft
        self.quant_info = describe_quant(target, self.quant)  # which path the target runs, for stats and reports
        context = min(context, target.config.max_position_embeddings)
        self.parallel = parallel  # KV cache slots: sequences that can run at once
        self.runner = ModelRunner(target, num_slots=parallel, context=context)
        self._draft_name, self._p_min, self._branch_p = draft, draft_p_min, draft_branch_p
        self._draft_quant = draft_quant
        self._spec = SpecConfig(draft_max, draft_min, adaptive)
        self._progress = progress
        self._drafters: dict[tuple[str, Hashable], Drafter | None] = {}  # by (spec type or chain, scope)
        self._drafters_lock = threading.RLock()  # server requests ask from several threads; chains nest
        self.engine = Engine(self.runner, self.tokenizer, self._spec)
        self.drafter = self.drafter_for(spec_type)

    def drafter_for(self, spec_type: str, scope: Hashable = None) -> Drafter | None:
        """The drafter for one spec type or chain (None for 'none'), made once per LLM and `scope`. Model-free
        drafters (and chains with one) get an instance per scope, so what they learn across requests (the
        ngram-mod pool, the suffix memory) stays within it (e.g. one API key); scope None is the LLM's own.
        The draft model keeps nothing across requests: one serves every scope."""
        parts = parse_spec_type(spec_type)
        key = (",".join(parts), scope if any(p in MODEL_FREE for p in parts) else None)
        if key not in self._drafters:
            with self._drafters_lock:  # made once, however many requests ask at the same time (a draft model loads)
                if key not in self._drafters:
                    members = [self.drafter_for(p, scope) for p in parts] if len(parts) > 1 else None
                    self._drafters[key] = (ChainDrafter(members, self._chain_mode) if members
                                           else self._make_drafter(key[0]))
        return self._drafters[key]

    def reset_drafters(self) -> None:
        """Forget what drafters learned across requests (ngram-mod pool, suffix memory), e.g. between repeats."""
        for d in self._drafters.values():
            if hasattr(d, "reset"):
                d.reset()

    def _make_drafter(self, spec_type: str) -> Drafter | None:
        if spec_type in MODEL_FREE:
            return make_model_free(spec_type, self._model_free)
        if spec_type == "draft":
            from specdec.drafters.draft_model import DraftModelDrafter
            if self._draft_name is None:
                raise SpecdecError("spec type 'draft' needs a draft model (-md)")
            dmodel, dtok, _, _ = load_model(self._draft_name, self._draft_quant, self._dtype_name, self._ngld,
                                            self._progress)
            if not dtok.same_vocab(self.tokenizer):
                raise SpecdecError(f"draft model {self._draft_name} uses a different tokenizer than the target; "
                                   "a draft model must share the target's vocabulary")
            return DraftModelDrafter(ModelRunner(dmodel, self.parallel, self.context), self.runner.vocab_size, self._p_min,
                                     self._branch_p)
        return None

    @property
    def context(self) -> int:
        return self.runner.context

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation (`[{"role", "content"}, ...]`) in the chat template, ready for the assistant's turn."""
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                 chat: bool = False, system: str | None = None, on_text: StreamCallback | None = None,
                 spec_type: str | None = None) -> Result:
        """Generate from a prompt (text, or token ids); `spec_type` overrides the LLM's for this call."""
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat, system)
        params = SamplingParams(temperature, top_k, top_p, min_p, seed, max_tokens, list(stop or []))
        drafter = self.drafter if spec_type is None else self.drafter_for(spec_type)
        seq = self.engine.generate(ids, params, on_text, drafter)
        return Result(seq.text, seq.output_ids, seq.stats, seq.finish_reason or "stop", seq.top2_gaps, seq.synthetic)


def describe_quant(model, quant: str) -> str:
    """e.g. 'none: float32', 'int4: weight-only (196 int4, 1 int8 layers), rest bfloat16',
    'gguf: Q4_K/Q5_0/Q6_K/Q8_0 kernel path avx2'."""
    from specdec.runtime.quant import Int4Linear, Int8Linear

    dtype = str(model.model.norm.weight.dtype).removeprefix("torch.")
    if quant == "gguf":
        from specdec.models.gguf_quantized import describe
        return describe(model)
    if quant in ("int8", "int4"):
        n4 = sum(isinstance(m, Int4Linear) for m in model.modules())
        n8 = sum(isinstance(m, Int8Linear) for m in model.modules())
        return f"{quant}: weight-only ({n4} int4, {n8} int8 layers), rest {dtype}"
    return f"none: {dtype}"


def load_model(name: str, quant: str, dtype: str, n_gpu_layers: int = 0, progress: bool = True):
    """(model, tokenizer, quant, dtype) for a target or a draft: `quant` auto|gguf|int8|int4|none (auto: the file's
    own precision, see `resolve_quant`), `dtype` auto|bf16|fp16|fp32, the first `n_gpu_layers` on the GPU."""
    quant = resolve_quant(quant, name)
    dt = resolve_dtype(dtype, quant=quant)
    if quant == "gguf":  # the file's own blocks through the GGUF kernels (no 16/32-bit weight copies)
        from specdec.models.gguf_quantized import load_gguf_quantized
        pinned = packs.PACKS[name].sha256 if name in packs.PACKS else None  # resolve_gguf checked the pack
        model, tok = load_gguf_quantized(resolve_gguf(name, progress), dt, pinned)
    else:
        model, tok = load_checkpoint(resolve_model(name, progress), dt)
    _offload(model, n_gpu_layers)
    if quant in ("int8", "int4"):
        quantize_(model, quant)  # weight-only, the layers left on the CPU
    return model, tok, quant, dt


def _offload(model, n_gpu_layers: int) -> None:
    """`-ngl`: the first n decoder layers (and embeddings; norm + head when all) on the GPU, when there is one."""
    if n_gpu_layers and torch.cuda.is_available():
        from specdec.runtime.placement import place_layers
        model.place(place_layers(model.config.num_layers, n_gpu_layers).module_devices())


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise SpecdecError(f"{name} must be >= 1 (got {v})")
