"""A seeded sampled request gives the same tokens whatever drafts it and whatever runs beside it (fp32)."""
import pytest

import specdec
from conftest import untrained_spec_types
from specdec.engine.load_control import LoadController
from specdec.engine.scheduler import Request, Scheduler
from specdec.sampling import SamplingParams

from test_scheduler import PROMPTS, _llm, _run

SPECS = [t for t in untrained_spec_types() if t != "none"] + ["ngram-mod,draft", "suffix,draft"]


def test_tiny_seeded_equal_for_every_spec_type(tiny_dir):
    llm = _llm(tiny_dir, draft_branch_p=0.5)
    for prompt in PROMPTS[:4]:
        for seed in (0, 7):
            kw = dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=seed)
            base = llm.generate(prompt, spec_type="none", **kw).token_ids
            for spec in SPECS:
                assert llm.generate(prompt, spec_type=spec, **kw).token_ids == base, (prompt, seed, spec)
        other = llm.generate(prompt, spec_type="none", max_tokens=30, temperature=0.9, top_p=0.95, seed=8).token_ids
        assert other != base  # the seed matters


def test_tiny_seeded_equal_at_every_concurrency(tiny_dir):
    """Eight seeded requests, each with another spec type, batched 1, 2 or 4 at a time: the tokens of plain
    single-request decoding with the same seed."""
    llm = _llm(tiny_dir, draft_branch_p=0.5)
    specs = ["none", "draft", "ngram-simple", "suffix", "ngram-mod", "ngram-map-k-tree", "suffix-tree", "ngram-mod,draft"]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=24) for i in range(len(PROMPTS))]
    bases = [llm.generate(p, spec_type="none", max_tokens=24, temperature=0.8, top_k=20, seed=i).token_ids
             for i, p in enumerate(PROMPTS)]
    for slots in (1, 2, 4):
        sched = Scheduler(llm.engine, slots, controller=LoadController(llm.engine.spec.draft_max), prefill_chunk=5)
        reqs = [Request(llm.encode(p), sp, llm.drafter_for(s)) for p, sp, s in zip(PROMPTS, params, specs)]
        _run(sched, reqs)
        assert [r.seq.output_ids for r in reqs] == bases, slots


@pytest.mark.real
def test_smollm_seeded_equal_for_every_spec_type(smollm_dir):
    llm = specdec.LLM(str(smollm_dir), draft=str(smollm_dir), spec_type="none", dtype="fp32", context=256,
                      progress=False, draft_branch_p=0.6)
    kw = dict(max_tokens=40, chat=True, temperature=0.8, top_p=0.95, seed=3)
    prompt = "List the first five prime numbers and explain why 9 is not prime."
    base = llm.generate(prompt, spec_type="none", **kw)
    accepted = 0
    for spec in SPECS:
        r = llm.generate(prompt, spec_type=spec, **kw)
        assert r.token_ids == base.token_ids, spec
        accepted += r.stats.accepted
    assert accepted > 0
