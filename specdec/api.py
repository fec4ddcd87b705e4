"""Python API: `LLM(model, draft=..., spec_type=...).generate(prompt, ...)`."""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import torch

from specdec import compat
from specdec.config import Config
from specdec.constraint import Grammar
from specdec.drafters import REGISTRY, BuildContext, Drafter, parse_spec_type
from specdec.drafters.chain import assemble
from specdec.engine.engine import Engine
from specdec.errors import SpecdecError
from specdec.models.gemma4_assistant import is_assistant
from specdec.models.loader import load_checkpoint, resolve_dtype, resolve_gguf, resolve_model, resolve_quant
from specdec.models.tokenizer import Tokenizer
from specdec.runtime import kernels
from specdec.runtime.cpu import release_openmp_workers
from specdec.runtime.prefix_cache import PrefixCache, PrefixStore
from specdec.runtime.quant import quantize_
from specdec.runtime.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import RequestOptions, StreamCallback
from specdec.stats import Stats
from specdec.tools import render_messages

OPTION_DRAFTERS = 32  # drafters made for per-request options that an LLM keeps (the newest)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str
    top2_gaps: list[float]  # per output token: the target's top-1 minus top-2 logit
    synthetic: bool = False  # a synthetic drafter forced acceptances: NOT the target's output
    lossless: bool = True  # False: synthetic drafts or relaxed acceptance (--spec-accept-threshold) changed it

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "synthetic": self.synthetic,
            "lossless": self.lossless,
            "stats": self.stats.to_dict(),
        }


class LLM:
    """A target model, optionally with a drafter. With no model, the default Qwen2.5-Coder pair.

    Keywords are `Config` fields (context, dtype, quant, draft_max, ...) and drafter options by their registry
    names (ngram_n, suffix_factor, draft_p_min, ...); or pass a whole `config`."""

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = None,
        spec_type: str | None = None,
        config: Config | None = None,
        **options: Any,
    ):
        cfg = config or Config.make(model=model, draft=draft, spec_type=spec_type, **options)
        self.config = cfg
        self.spec_type = cfg.spec_type
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        if cfg.fast_prefill:  # process-wide, as the kernels' instruction set is
            kernels.set_fast_prefill(True)
        target, self.tokenizer, self.quant, self.dtype = load_model(
            cfg.model, cfg.quant, cfg.dtype, cfg.n_gpu_layers, cfg.progress
        )
        self.quant_info = describe_quant(target, self.quant)  # which path the target runs, for stats and reports
        self.parallel = cfg.parallel
        self.runner = ModelRunner(
            target, num_slots=cfg.parallel, context=min(cfg.context, target.config.max_position_embeddings)
        )
        # prompt K/V kept across requests (`cache_mb`), one budget for the target and a draft model
        self.prefix_cache = PrefixCache(cfg.cache_mb << 20) if cfg.cache_mb else None
        self._attach_prefix(self.runner, "target")
        self._drafters: dict[tuple, Drafter | None] = {}  # by (spec type or chain, scope, request options)
        self._drafters_lock = threading.RLock()  # server requests ask from several threads; chains nest
        self._draft_tokenizers: tuple[Tokenizer, Tokenizer] | None = None  # (target, draft) when they differ
        self.engine = Engine(self.runner, self.tokenizer, cfg.spec)
        self.drafter = self.drafter_for(self.spec_type)

    def drafter_for(
        self, spec_type: str, scope: Hashable = None, options: Mapping[str, Any] | None = None
    ) -> Drafter | None:
        """The drafter for one spec type or chain (None for 'none'), made once per LLM and `scope`. Types that
        learn across requests (the ngram-mod pool, the suffix memory; chains with one) get an instance per scope
        (e.g. one API key); scope None is the LLM's own. The others (the draft model) serve every scope.
        `options`: drafter options of this request (`Registry.request_options`: model-free types only), over the
        LLM's; the latest `OPTION_DRAFTERS` such drafters are kept."""
        parts = parse_spec_type(spec_type)
        per_scope = any(p != "none" and REGISTRY.get(p).per_scope for p in parts)
        own = tuple(sorted(REGISTRY.request_options(parts, options).items())) if options else ()
        key = (",".join(parts), scope if per_scope else None, own)
        if key not in self._drafters:
            with self._drafters_lock:  # made once, however many requests ask at the same time (a draft model loads)
                if key not in self._drafters:
                    self._drafters[key] = assemble(
                        parts, lambda p: self._make_drafter(p, scope, len(parts) > 1, dict(own)), self.config.chain_mode
                    )
                    self._forget_option_drafters()
                release_openmp_workers()  # building may run in a request's thread, which does not decode
        return self._drafters[key]

    def _forget_option_drafters(self) -> None:
        """Keep the newest `OPTION_DRAFTERS` drafters made for per-request options (bounded memory)."""
        made = [k for k in self._drafters if k[2]]
        for k in made[: max(0, len(made) - OPTION_DRAFTERS)]:
            del self._drafters[k]

    def reset_drafters(self) -> None:
        """Forget what drafters learned across requests (ngram-mod pool, suffix memory), e.g. between repeats."""
        for d in self._drafters.values():
            if d is not None:
                d.reset()

    def _make_drafter(
        self, spec_type: str, scope: Hashable, member: bool, options: dict[str, Any] | None = None
    ) -> Drafter | None:
        """A chain member is the scope's own drafter of that type (shared with it); else a new one. `options`: the
        request's own drafter options (over the LLM's)."""
        if spec_type == "none":
            return None
        if member:
            mine = {k: v for k, v in (options or {}).items() if k in {o.name for o in REGISTRY.get(spec_type).options}}
            return self.drafter_for(spec_type, scope, mine)
        t = REGISTRY.get(spec_type)
        if t.verify_hook is not None:
            self.engine.verify_hooks[spec_type] = t.verify_hook
        return t.build(
            BuildContext(
                {**self.config.drafter, **(options or {})},
                self.runner,
                self.config.model,
                self._load_draft,
                lambda: self._draft_tokenizers,
                self.config.draft,
            )
        )

    def _load_draft(self) -> ModelRunner:
        cfg = self.config
        if cfg.draft is None:
            raise SpecdecError("this spec type needs a draft model (-md)")
        dmodel, dtok, _, _ = load_model(cfg.draft, cfg.draft_quant, cfg.dtype, cfg.n_gpu_layers_draft, cfg.progress)
        self._draft_tokenizers = None if dtok.same_vocab(self.tokenizer) else (self.tokenizer, dtok)
        runner = ModelRunner(dmodel, self.parallel, self.context)
        self._attach_prefix(runner, "draft")
        return runner

    def _attach_prefix(self, runner: ModelRunner, name: str) -> None:
        """The shared prefix cache for this runner; not for a model with recurrent layers (Qwen3.5), whose state at
        the end of a prefix the cache's K/V blocks do not hold."""
        if self.prefix_cache is not None and not runner.recurrent:
            runner.prefix = PrefixStore(self.prefix_cache, name, runner.cache)

    @property
    def context(self) -> int:
        return self.runner.context

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation (`[{"role", "content"}, ...]`, OpenAI's tool calls and results included) in the chat
        template, ready for the assistant's turn; `tools`: OpenAI-style function tools offered to the model."""
        messages, tools = render_messages(messages, tools, self.tokenizer.chat_template or "")
        text = self.tokenizer.apply_chat_template(messages, tools=tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        chat: bool = False,
        system: str | None = None,
        on_text: StreamCallback | None = None,
        spec_type: str | None = None,
        grammar: Grammar | None = None,
        **words: Any,
    ) -> Result:
        """Generate from a prompt (text, or token ids); `spec_type` overrides the LLM's for this call; `grammar`
        (`Grammar.json_schema(...)`, `.lark`, `.regex`, `.gbnf`) constrains the output. `words`:
        transformers' assisted-generation arguments (`compat.HF_WORDS`) for this call: they may pick the spec type
        and the draft length; what else they imply must already be this LLM's setting."""
        compat.refuse_other_names(words, "generate()")
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat, system)
        asked = compat.for_request(words, self.config.settings()) if words else {}
        spec_type = compat.merge({"spec_type": spec_type}, asked, "transformers' arguments")["spec_type"]
        options = RequestOptions(
            SamplingParams(temperature, top_k, top_p, min_p, seed, max_tokens, list(stop or [])),
            self.drafter if spec_type is None else self.drafter_for(spec_type),
            draft_max=asked.get("draft_max"),
            grammar=grammar,
        )
        seq = self.engine.generate(ids, options, on_text)
        return Result(
            seq.text, seq.output_ids, seq.stats, seq.finish_reason or "stop", seq.top2_gaps, seq.synthetic, seq.lossless
        )


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
    if is_assistant(name):
        raise SpecdecError(f"{name} is a Gemma 4 assistant, which drafts for its target: --spec-type mtp -md {name}")
    quant = resolve_quant(quant, name)
    dt = resolve_dtype(dtype, quant=quant)
    if quant == "gguf":  # the file's own blocks through the GGUF kernels (no 16/32-bit weight copies)
        from specdec.models.gguf_quantized import load_gguf_quantized

        model, tok = load_gguf_quantized(resolve_gguf(name, progress), dt)
    else:
        model, tok = load_checkpoint(resolve_model(name, progress), dt)
    _offload(model, n_gpu_layers)
    if quant in ("int8", "int4"):
        quantize_(model, quant)  # weight-only, the layers left on the CPU
    return model, tok, quant, dt


def _offload(model, n_gpu_layers: int) -> None:
    """`-ngl`: the first n decoder layers (and embeddings; norm + head when all) on the GPU, when there is one;
    GGUF blocks placed there are dequantized once to the model's dtype (the GGUF kernels run on the CPU)."""
    if n_gpu_layers and torch.cuda.is_available():
        from specdec.models.gguf_quantized import densify
        from specdec.runtime.placement import place_layers

        devices = place_layers(model.config.num_layers, n_gpu_layers).module_devices()
        dtype = model.model.embed_tokens.weight.dtype
        for name in (n for n, d in devices.items() if d != "cpu"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, densify(model.get_submodule(name), dtype))
        model.place(devices)


def build_llm(args: argparse.Namespace, progress: bool = True, **override: Any) -> LLM:
    """An LLM from parsed CLI flags (`specdec generate|serve|bench`); `override`: Config fields to replace."""
    from specdec.runtime.placement import offload_notice

    notice = offload_notice(getattr(args, "n_gpu_layers", None), getattr(args, "n_gpu_layers_draft", None))
    if notice:
        print(notice, file=sys.stderr)
    return LLM(config=Config.from_namespace(args, progress=progress, **override))
