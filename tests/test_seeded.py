"""A seeded sampled request gives the same tokens whatever drafts it and whatever runs beside it (fp32)."""

import pytest
from conftest import untrained_spec_types
from test_scheduler import PROMPTS, _llm, _run

import specdec
from specdec.engine.scheduler import Request, Scheduler
from specdec.sampling import SamplingParams

SPECS = [t for t in untrained_spec_types() if t != "none"] + ["ngram-mod,draft", "suffix,draft"]


def test_tiny_seeded_equal_for_every_spec_type(tiny_dir):
    llm = _llm(tiny_dir, draft_branch_p=0.5, adaptive=False)  # fixed draft lengths: an adaptive one may draft nothing
    stats = {spec: [0, 0] for spec in SPECS}  # spec -> [drafted, accepted]
    for prompt in PROMPTS[:4]:
        for seed in (0, 7):
            kw = dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=seed)
            base = llm.generate(prompt, spec_type="none", **kw).token_ids
            for spec in SPECS:
                r = llm.generate(prompt, spec_type=spec, **kw)
                assert r.token_ids == base, (prompt, seed, spec)
                stats[spec][0] += r.stats.drafted
                stats[spec][1] += r.stats.accepted
        other = llm.generate(prompt, spec_type="none", max_tokens=30, temperature=0.9, top_p=0.95, seed=8).token_ids
        assert other != base  # the seed matters
    # drafted only: the random draft model (seed 1) is right by chance alone
    assert all(d > 0 and (a > 0 or s == "draft") for s, (d, a) in stats.items()), stats


def test_tiny_seeded_equal_at_every_concurrency(tiny_dir):
    """Eight seeded requests, each with another spec type, batched 1, 2 or 4 at a time: the tokens of plain
    single-request decoding with the same seed."""
    # fixed draft lengths, no load controller (adaptive lengths and its plain arm could leave nothing drafted) and
    # n = 1: the n-gram drafters draft on most steps
    llm = _llm(tiny_dir, draft_branch_p=0.5, adaptive=False, ngram_n=1)
    specs = [
        "none",
        "draft",
        "ngram-simple",
        "suffix",
        "ngram-mod",
        "ngram-map-k-tree",
        "suffix-tree",
        "ngram-mod,draft",
    ]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=24) for i in range(len(PROMPTS))]
    bases = [
        llm.generate(p, spec_type="none", max_tokens=24, temperature=0.8, top_k=20, seed=i).token_ids
        for i, p in enumerate(PROMPTS)
    ]
    stats = {s: [0, 0] for s in specs[1:]}  # spec -> [drafted, accepted]
    for slots in (1, 2, 4):
        sched = Scheduler(llm.engine, slots, controller=None, prefill_chunk=5)
        reqs = [Request(llm.encode(p), sp, llm.drafter_for(s)) for p, sp, s in zip(PROMPTS, params, specs)]
        _run(sched, reqs)
        assert [r.seq.output_ids for r in reqs] == bases, slots
        for s, r in zip(specs[1:], reqs[1:]):
            stats[s][0] += r.seq.stats.drafted
            stats[s][1] += r.seq.stats.accepted
    # drafted only: the random draft model (seed 1), and ngram-map-k-tree on a random model's sampled text (which
    # seldom repeats itself); the drafters that remember earlier requests draft the outputs of the rounds before
    assert all(d > 0 and (a > 0 or s in ("draft", "ngram-map-k-tree")) for s, (d, a) in stats.items()), stats


@pytest.mark.real
def test_smollm_seeded_equal_for_every_spec_type(smollm_dir):
    llm = specdec.LLM(
        str(smollm_dir),
        draft=str(smollm_dir),
        spec_type="none",
        dtype="fp32",
        context=256,
        progress=False,
        draft_branch_p=0.6,
        adaptive=False,
        draft_max=3,
    )  # fixed: drafts every step
    kw = dict(max_tokens=40, chat=True, temperature=0.8, top_p=0.95, seed=3)
    prompt = "List the first five prime numbers and explain why 9 is not prime."
    base = llm.generate(prompt, spec_type="none", **kw)
    for spec in SPECS:
        r = llm.generate(prompt, spec_type=spec, **kw)
        assert r.token_ids == base.token_ids, spec
        assert r.stats.drafted > 0 and r.stats.accepted > 0, (spec, r.stats)
