"""Bench methods behind one interface: our spec types and `transformers` generate (plain, assisted, PLD)."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, fields

import torch

from specdec.bench.report import Outcomes
from specdec.stats import Stats

HF_METHODS = ("hf-plain", "hf-assisted", "hf-pld")
HF_PLD_TOKENS = 10


@dataclass
class Output:
    """One generation (one turn) by one method; None = the method does not report it."""

    tokens: list[int]
    seconds: float  # wall time of the call (prefill included)
    top2_gaps: list[float] | None = None  # our engine: per output token, top-1 minus top-2 logit
    target_forwards: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    prefill_s: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    drafted_at: list[int] | None = None  # per draft position: times drafted
    accepted_at: list[int] | None = None  # per draft position: times accepted
    server_s: float | None = None  # llama.cpp: prompt + predicted time from its `timings`
    peak_rss_mb: float | None = None


def merge(outs: list[Output]) -> Output:
    """The turns of one conversation as one run: tokens concatenated, counts and times summed."""
    merged = {}
    for f in fields(Output):
        vals = [getattr(o, f.name) for o in outs]
        if any(v is None for v in vals):
            merged[f.name] = None
        elif f.name == "peak_rss_mb":
            merged[f.name] = max(vals)
        elif f.name in ("drafted_at", "accepted_at"):
            width = max(len(v) for v in vals)
            merged[f.name] = [sum(v[i] for v in vals if i < len(v)) for i in range(width)]
        elif f.name in ("tokens", "top2_gaps"):
            merged[f.name] = [x for v in vals for x in v]
        else:
            merged[f.name] = sum(vals)
    return Output(**merged)


def strip_stop(tokens: list[int], stop_ids: set[int] | list[int]) -> list[int]:
    """Output tokens without the trailing end-of-turn tokens (our engine never returns them)."""
    end = len(tokens)
    while end and tokens[end - 1] in stop_ids:
        end -= 1
    return tokens[:end]


def rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Method:
    """A way to generate that the bench times."""

    name: str
    baseline: str  # the method whose greedy output this one must reproduce token for token
    fresh_repeats: bool = True  # False: keeps cross-request state that cannot be reset, so repeats are not first-seen
    lossy: bool = False  # an opt-in lossy drafter: its output is not meant to match the baseline

    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int | None) -> Output:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the method holds (a server process)."""


class EngineMethod(Method):
    """One of specdec's spec types, or a chain `a+b` (spec type `a,b`); all share the target and its KV cache."""

    def __init__(self, llm, name: str):
        from specdec.drafters import is_lossy

        self.name, self.baseline, self.llm = name, "none", llm
        self.spec_type = name.replace("+", ",")
        self.lossy = is_lossy(self.spec_type)
        self.drafter = llm.drafter_for(self.spec_type)  # loads a draft model now, not while timing

    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int | None) -> Output:
        self.llm.reset_drafters()  # no learning from earlier runs of this prompt (chains share drafters)
        r = self.llm.generate(ids, max_tokens=max_tokens, temperature=temperature, seed=seed, spec_type=self.spec_type)
        return engine_output(r.token_ids, r.stats, r.top2_gaps)


def engine_output(tokens: list[int], s: Stats, top2_gaps: list[float]) -> Output:
    """An Output from our engine's stats for one generation."""
    return Output(
        tokens,
        s.total_s,
        top2_gaps,
        s.target_forwards,
        s.drafted,
        s.accepted,
        s.prefill_s,
        s.draft_s,
        s.verify_s,
        list(s.drafted_at),
        list(s.accepted_at),
        peak_rss_mb=rss_mb(),
    )


class HF(Method):
    """`transformers` generate on the same checkpoint, dtype and threads."""

    def __init__(self, name: str, model, stop_ids: set[int], extra: dict):
        self.name, self.baseline, self.model, self.extra = name, "hf-plain", model, extra
        self.stop_ids = sorted(stop_ids)

    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int | None) -> Output:
        inp = torch.tensor([ids])
        sampling = (
            dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            if temperature > 0
            else dict(do_sample=False)
        )
        if seed is not None:
            torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=self.stop_ids[0],
                **sampling,
                **self.extra,
            )
        dt = time.perf_counter() - t0
        return Output(strip_stop(out[0, len(ids) :].tolist(), self.stop_ids), dt, peak_rss_mb=rss_mb())


def hf_methods(
    names: list[str], target: str, draft: str | None, dtype: torch.dtype, stop_ids: set[int], outcomes: Outcomes
) -> list[HF]:
    """The requested `hf-*` methods, sharing one copy of the target; one that fails to load is recorded in
    `outcomes` and left out."""
    if not names:
        return []
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdec.models.loader import resolve_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    load = lambda name: AutoModelForCausalLM.from_pretrained(str(resolve_model(name)), dtype=dtype).eval()  # noqa: E731
    model = outcomes.attempt(names, "loading", lambda: load(target))
    if model is None:
        return []
    extra = {
        "hf-plain": lambda: {},
        "hf-pld": lambda: {"prompt_lookup_num_tokens": HF_PLD_TOKENS},
        "hf-assisted": lambda: {"assistant_model": load(draft)},
    }
    loaded = [outcomes.attempt([n], "loading", lambda: HF(n, model, stop_ids, extra[n]())) for n in names]
    return [m for m in loaded if m is not None]
