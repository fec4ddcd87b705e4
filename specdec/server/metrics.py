"""Prometheus text-format metrics for the server."""
from __future__ import annotations

from specdec.engine.scheduler import Request, Scheduler


class Metrics:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.requests: dict[str, int] = {}  # finish reason or "error" -> count
        self.rejected = 0
        self.prompt_tokens = self.generated = self.drafted = self.accepted = 0

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
            "# TYPE specdec_requests_running gauge",
            f"specdec_requests_running {load['running']}",
            "# TYPE specdec_requests_waiting gauge",
            f"specdec_requests_waiting {load['waiting']}",
            "# TYPE specdec_engine_steps_total counter",
            f"specdec_engine_steps_total {sch.steps}",
            "# HELP specdec_engine_spec_steps_total Engine steps in which speculation was allowed.",
            "# TYPE specdec_engine_spec_steps_total counter",
            f"specdec_engine_spec_steps_total {sch.spec_steps}",
        ]
        if sch.controller:
            lines += ["# HELP specdec_goodput_tokens_per_second Load controller: goodput per batch bucket and arm "
                      "(measured or predicted).", "# TYPE specdec_goodput_tokens_per_second gauge"]
            for b, r in sch.controller.report().items():
                lines += [f'specdec_goodput_tokens_per_second{{batch="{b}",arm="{a}",chosen="{int(a == r["chosen"])}"}} {v}'
                          for a, v in r["goodput"].items()]
        return "\n".join(lines) + "\n"
