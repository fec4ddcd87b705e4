"""Prometheus text-format metrics for the server."""

from __future__ import annotations

from specdec.engine.scheduler import Request, Scheduler
from specdec.runtime.prefix_cache import PrefixCache


class Metrics:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.requests: dict[str, int] = {}  # finish reason or "error" -> count
        self.rejected = 0
        self.prompt_tokens = self.generated = self.drafted = self.accepted = self.relaxed = 0

    def finished(self, req: Request) -> None:
        """Count a finished request; one cancelled before it started has no sequence ("cancelled")."""
        seq = req.seq
        key = "error" if req.error else (seq.finish_reason or "stop") if seq else "cancelled"
        self.requests[key] = self.requests.get(key, 0) + 1
        if seq:
            self.prompt_tokens += seq.prompt_len
            self.generated += seq.stats.new_tokens
            self.drafted += seq.stats.drafted
            self.accepted += seq.stats.accepted
            self.relaxed += seq.stats.relaxed

    def render(self) -> str:
        sch = self.scheduler
        load = sch.load
        lines = [
            "# HELP specdec_requests_total Finished requests by finish reason.",
            "# TYPE specdec_requests_total counter",
            *[f'specdec_requests_total{{reason="{k}"}} {v}' for k, v in sorted(self.requests.items())],
            "# TYPE specdec_requests_rejected_total counter",
            f"specdec_requests_rejected_total {self.rejected}",
            "# TYPE specdec_prompt_tokens_total counter",
            f"specdec_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE specdec_generation_tokens_total counter",
            f"specdec_generation_tokens_total {self.generated}",
            "# TYPE specdec_draft_tokens_total counter",
            f"specdec_draft_tokens_total {self.drafted}",
            "# TYPE specdec_draft_accepted_tokens_total counter",
            f"specdec_draft_accepted_tokens_total {self.accepted}",
            "# HELP specdec_draft_relaxed_tokens_total Of the accepted draft tokens, those accepted only by the opt-in "
            "lossy relaxed rule (--spec-accept-threshold, speculative.accept_threshold).",
            "# TYPE specdec_draft_relaxed_tokens_total counter",
            f"specdec_draft_relaxed_tokens_total {self.relaxed}",
            "# TYPE specdec_requests_running gauge",
            f"specdec_requests_running {load['running']}",
            "# TYPE specdec_requests_waiting gauge",
            f"specdec_requests_waiting {load['waiting']}",
            "# TYPE specdec_engine_steps_total counter",
            f"specdec_engine_steps_total {sch.steps}",
            "# HELP specdec_engine_spec_steps_total Engine steps in which speculation was allowed.",
            "# TYPE specdec_engine_spec_steps_total counter",
            f"specdec_engine_spec_steps_total {sch.spec_steps}",
            "# HELP specdec_engine_prefill_seconds_total Engine time spent prefilling prompts.",
            "# TYPE specdec_engine_prefill_seconds_total counter",
            f"specdec_engine_prefill_seconds_total {sch.prefill_s:.3f}",
            "# HELP specdec_engine_step_seconds_total Engine time spent in decode steps (draft, verify, commit).",
            "# TYPE specdec_engine_step_seconds_total counter",
            f"specdec_engine_step_seconds_total {sch.step_s:.3f}",
        ]
        store = sch.engine.target.prefix
        if store is not None:
            lines += _prefix_cache_lines(store.cache)
        if sch.controller:
            lines += [
                "# HELP specdec_goodput_tokens_per_second Load controller: goodput per batch bucket and arm "
                "(measured or predicted; an arm due to be run and measured is left out).",
                "# TYPE specdec_goodput_tokens_per_second gauge",
            ]
            for b, r in sch.controller.report().items():
                lines += [
                    f'specdec_goodput_tokens_per_second{{batch="{b}",arm="{a}",chosen="{int(a == r["chosen"])}"}} {v}'
                    for a, v in r["goodput"].items()
                    if v is not None
                ]
        return "\n".join(lines) + "\n"


def _prefix_cache_lines(cache: PrefixCache) -> list[str]:
    """Per model (target, draft): lookups, hits and prompt tokens saved; the cache's bytes, budget, blocks."""
    lines = []
    for name, what in (
        ("lookups", "Prompts looked up"),
        ("hits", "Lookups that reused cached K/V"),
        ("tokens_saved", "Prompt tokens whose K/V came from the cache"),
    ):
        lines += [
            f"# HELP specdec_prefix_cache_{name}_total Prefix cache: {what.lower()}, per model.",
            f"# TYPE specdec_prefix_cache_{name}_total counter",
            *[
                f'specdec_prefix_cache_{name}_total{{model="{m}"}} {getattr(st, name)}'
                for m, st in sorted(cache.stats.items())
            ],
        ]
    for name, kind, value in (
        ("bytes", "gauge", cache.used),
        ("budget_bytes", "gauge", cache.budget),
        ("blocks", "gauge", len(cache.blocks)),
        ("evicted_blocks_total", "counter", cache.evicted),
    ):
        lines += [f"# TYPE specdec_prefix_cache_{name} {kind}", f"specdec_prefix_cache_{name} {value}"]
    return lines
