"""Which spec type and draft length for a workload, with the reason in one line."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class Task:
    name: str
    alpha: float  # assumed per-token acceptance of a same-family draft model (override: --accept)
    with_draft: str  # spec type when a draft model pays
    without_draft: str  # model-free spec type otherwise
    why: str


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "code",
            0.80,
            "draft",
            "ngram-simple",
            "code is predictable for a same-family draft (82% accepted on the quick prompts here)",
        ),
        Task("chat", 0.65, "draft", "suffix", "free text: a draft model helps less, drafts should stay short"),
        Task(
            "summarize",
            0.60,
            "ngram-simple",
            "ngram-simple",
            "summaries copy spans of the input, which prompt lookup drafts for free "
            "(2.64x vs 1.99x for the draft model on the summary prompt here)",
        ),
        Task(
            "rag",
            0.65,
            "ngram-simple,draft",
            "ngram-simple",
            "answers quote the retrieved text (prompt lookup first), the draft model covers the rest",
        ),
        Task(
            "agent",
            0.75,
            "suffix,draft",
            "suffix",
            "tool calls and JSON repeat across requests, which suffix remembers; the draft covers the rest",
        ),
    )
}


def task(name: str) -> Task:
    if name not in TASKS:
        raise SpecdecError(f"unknown task {name!r} (choose {', '.join(TASKS)})")
    return TASKS[name]


@dataclass(frozen=True)
class Recommendation:
    spec_type: str
    draft_max: int
    reason: str

    def to_dict(self) -> dict:
        return {"spec_type": self.spec_type, "draft_max": self.draft_max, "reason": self.reason}


def recommend(
    t: Task, has_draft: bool, draft_pays: bool, k: int, gain: float, draft_max: int, why_not: str | None
) -> Recommendation:
    """Use the draft model when it pays, else the task's model-free drafter."""
    if has_draft and draft_pays:
        spec = t.with_draft
        uses_draft = "draft" in spec.split(",")
        detail = f"; draft length {k} -> x{gain:.2f} at the bandwidth bound" if uses_draft else ""
        return Recommendation(spec, k if uses_draft else draft_max, f"{t.name}: {t.why}{detail}")
    spec = t.without_draft
    if has_draft:
        reason = f"{t.name}: the draft model does not pay here ({why_not}); {spec} drafts without a model"
    else:
        reason = f"{t.name}: no draft model given; {spec} drafts without one"
        if t.with_draft != spec:
            reason += f" (with a same-tokenizer draft: {t.with_draft})"
    return Recommendation(spec, draft_max, reason)
