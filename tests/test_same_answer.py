"""Same request, same answer: SmolLM2-135M (real weights, its GGUF through the kernels, as `specdec serve -m
smollm2-135m` runs it), eight prompts of which one is over 800 tokens, greedy and seeded, with no drafter, ngram-simple
and the default chain (suffix-tree, then a draft model): a prompt's tokens are the same asked alone, beside the seven
others (one batch of 8 slots), again with the prompt cache warm, and in a second process.

On the code before one arithmetic per token (prefill chunks above a start-up-timed row count dequantized to bf16 and
used torch's attention) the cached and batched answers differed: a cache hit prefilled only the prompt's tail through
the decode kernels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import specdec
from specdec.engine.scheduler import Request, Scheduler
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.real

SLOTS, TOKENS = 8, 24
SPECS = ("none", "ngram-simple", "suffix-tree,draft")
# a long system message (the prompt cache's case: a shared document, then a question), built from numbered facts
FACTS = " ".join(
    f"Fact {i}: the river {['Alder', 'Birch', 'Cedar', 'Dune'][i % 4]} flows {10 + i} miles past the "
    f"village of {['Ash', 'Brook', 'Crest'][i % 3]}ford."
    for i in range(48)
)
PROMPTS = [
    f"{FACTS}\n\nQuestion: which river flows past Brookford, and how far? Answer:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "List three colours of the rainbow: red, orange,",
    "import numpy as np\n\nx = np.arange(10)\nprint(x",
    "Translate to French: 'Good morning, how are you?'\n",
    "A haiku about autumn leaves:\n",
]


def _requests(llm, spec: str, seeded: bool, cache: bool) -> list[Request]:
    drafter = llm.drafter_for(spec)
    return [
        Request(llm.encode(p), SamplingParams(max_tokens=TOKENS, **_sampling(i, seeded)), drafter, cache_prompt=cache)
        for i, p in enumerate(PROMPTS)
    ]


def _sampling(i: int, seeded: bool) -> dict:
    return dict(temperature=0.8, top_p=0.95, seed=100 + i) if seeded else dict(temperature=0.0)


def _run(sched: Scheduler, reqs: list[Request], together: bool) -> list[Request]:
    """Run `reqs` through the scheduler: all submitted at once (together) or one after another."""
    for group in [reqs] if together else [[r] for r in reqs]:
        for r in group:
            sched.submit(r)
        for _ in range(100_000):
            if all(r.seq is not None and r.seq.finish_reason for r in group):
                break
            sched.run_once()
        assert all(r.error is None for r in group), [r.error for r in group]
    return reqs


@pytest.fixture(scope="module")
def llm(smollm_dir):
    # adaptive off: every step drafts (adaptive lengths may draft nothing in a batch, which would prove nothing)
    model = specdec.LLM(
        "smollm2-135m",
        draft="smollm2-135m",
        spec_type="none",
        parallel=SLOTS,
        context=1280,
        cache_mb=256,
        adaptive=False,
        draft_max=4,
        progress=False,
    )
    model.engine.stop_ids = set()  # every answer runs TOKENS tokens
    return model


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_same_tokens_alone_batched_and_cached(llm, seeded):
    assert len(llm.encode(PROMPTS[0])) > 800
    sched = Scheduler(llm.engine, SLOTS)
    base = [r.seq.output_ids for r in _run(sched, _requests(llm, "none", seeded, False), together=False)]
    if not seeded:
        assert len({tuple(b) for b in base}) == len(base)  # eight different answers
    for spec in SPECS:
        llm.prefix_cache.clear()
        alone = _run(sched, _requests(llm, spec, seeded, True), together=False)  # fills the cache
        assert all(r.seq.cached_tokens == 0 for r in alone)  # no prompt shares a prefix with another: all fresh
        together = _run(sched, _requests(llm, spec, seeded, False), together=True)
        cached = _run(sched, _requests(llm, spec, seeded, True), together=True)
        for how, reqs in (("alone", alone), ("beside 7 others", together), ("cache warm", cached)):
            assert [r.seq.output_ids for r in reqs] == base, (spec, how)
        assert all(r.seq.cached_tokens > 0 for r in cached if len(r.prompt_ids) > 16)
        if spec != "none":  # speculation ran: tokens were drafted and some accepted
            for how, reqs in (("alone", alone), ("beside 7 others", together), ("cache warm", cached)):
                assert sum(r.seq.stats.drafted for r in reqs) > 0, (spec, how)
                assert sum(r.seq.stats.accepted for r in reqs) > 0, (spec, how)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_same_tokens_in_a_second_process(llm, seeded, tmp_path):
    """`specdec generate --json` in a fresh process answers the long prompt and a short one as this process does."""
    for i in (0, 2):
        ours = llm.generate(PROMPTS[i], max_tokens=TOKENS, spec_type="none", **_sampling(i, seeded)).token_ids
        prompt = tmp_path / f"prompt{i}.txt"
        prompt.write_text(PROMPTS[i])
        s = _sampling(i, seeded)
        cmd = [
            sys.executable,
            "-m",
            "specdec.cli",
            "generate",
            "-m",
            "smollm2-135m",
            "-f",
            str(prompt),
            "-n",
            str(TOKENS),
            "--temp",
            str(s["temperature"]),
            "--ignore-eos",
            "--json",
        ]
        if seeded:
            cmd += ["--top-p", str(s["top_p"]), "--seed", str(s["seed"])]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == ours, i
