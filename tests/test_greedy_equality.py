"""Greedy speculative output is token-identical to plain decoding, for every spec type (fp32)."""

import itertools

import pytest

import specdec
from specdec.drafters import DEFAULT_MODEL_FREE, DEFAULT_WITH_DRAFT_MODEL, REGISTRY

PROMPTS_TINY = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4", "t60"]
MODEL_FREE = tuple(n for n, t in REGISTRY.types.items() if t.model_free)
CHAIN = "ngram-mod,draft"
SPECS = ("draft", *MODEL_FREE, CHAIN, DEFAULT_WITH_DRAFT_MODEL)


def _tiny_llm(tiny_dir, family, draft_seed, **kw):
    target = tiny_dir(family)
    draft = target if draft_seed is None else tiny_dir(family, seed=draft_seed, layers=1)
    return specdec.LLM(str(target), draft=str(draft), spec_type="none", dtype="fp32", context=64, progress=False, **kw)


def _set_stop(llm, ids):
    llm.engine.stop_ids = set(ids)


def _count(stats: dict, spec: str, r) -> None:
    """Adds r's drafted and accepted tokens to stats[spec]."""
    n = stats.setdefault(spec, [0, 0])
    n[0], n[1] = n[0] + r.stats.drafted, n[1] + r.stats.accepted


def _assert_drafted_and_accepted(stats: dict, drafted_only=()) -> None:
    """Every spec type drafted, and got drafts accepted (but those in `drafted_only`): else it compared plain with
    plain."""
    for spec, (drafted, accepted) in stats.items():
        assert drafted > 0 and (accepted > 0 or spec in drafted_only), (spec, drafted, accepted)


@pytest.mark.parametrize("family,adaptive", [("llama", True), ("qwen2", True), ("qwen3", True), ("llama", False)])
@pytest.mark.parametrize("draft_seed", [None, 1])  # the target itself as draft (all accepted), a weak random draft
def test_tiny_greedy_equality(tiny_dir, family, adaptive, draft_seed):
    llm = _tiny_llm(tiny_dir, family, draft_seed)
    llm.engine.spec.adaptive = adaptive
    _set_stop(llm, [])
    stats = {}  # spec -> [drafted, accepted]
    for prompt in PROMPTS_TINY:
        for max_tokens in (1, 7, 40):
            base = llm.generate(prompt, max_tokens=max_tokens, spec_type="none")
            # model-free drafters do not depend on the draft model: once per family is enough; with adaptive
            # length draft_max is only a cap, so the newer drafters sweep it only without
            for spec in ("draft", CHAIN, DEFAULT_WITH_DRAFT_MODEL) + (MODEL_FREE if draft_seed is None else ()):
                for k in (1, 3, 8) if spec == "draft" or not adaptive else (8,):
                    llm.engine.spec.draft_max = k
                    r = llm.generate(prompt, max_tokens=max_tokens, spec_type=spec)
                    assert r.token_ids == base.token_ids, (family, prompt, max_tokens, spec, k)
                    assert r.finish_reason == base.finish_reason
                    _count(stats, spec, r)
    # fixed lengths: every spec type drafted and got drafts accepted (the random draft model, seed 1: drafted only);
    # adaptive ones skip drafts by measured timings (not asserted: a slow machine may skip them all), but a draft
    # model that does not pay still drafts a one-token probe every PROBE_EVERY undrafted steps
    if adaptive:
        assert stats["draft"][0] > 0, stats
    else:
        _assert_drafted_and_accepted(stats, () if draft_seed is None else ("draft",))


def test_tiny_model_free_with_misses(tiny_dir):
    """n = 1 and no probability cut: model-free drafters draft on most steps and are often wrong."""
    llm = _tiny_llm(tiny_dir, "llama", None, ngram_n=1, suffix_min_prob=0.0, suffix_factor=4.0)
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, 6
    _set_stop(llm, [])
    bases = {p: llm.generate(p, max_tokens=40, spec_type="none").token_ids for p in PROMPTS_TINY}
    for spec in (*MODEL_FREE, "suffix,ngram-map-k"):
        llm.engine.stop_ids = set()
        drafted = accepted = branched = 0
        for prompt in PROMPTS_TINY:
            r = llm.generate(prompt, max_tokens=40, spec_type=spec)
            assert r.token_ids == bases[prompt], (spec, prompt)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
            branched += r.stats.drafted - sum(r.stats.drafted_at)  # tree nodes beyond one per depth
        assert 0 < accepted < drafted, spec
        assert (branched > 0) == spec.endswith("-tree"), spec


def test_drafters_shared_within_an_llm(tiny_dir):
    llm = _tiny_llm(tiny_dir, "qwen2", None)
    llm.engine.spec.adaptive = False
    _set_stop(llm, [])
    mod = llm.drafter_for("ngram-mod")
    assert llm.drafter_for("ngram-mod, draft") is llm.drafter_for(CHAIN)
    assert llm.drafter_for(CHAIN).members[0] is mod  # one pool per LLM
    base = llm.generate(PROMPTS_TINY[1], max_tokens=20, spec_type="ngram-mod")
    assert mod.used > 0
    r = llm.generate(PROMPTS_TINY[1], max_tokens=20, spec_type=CHAIN)  # its ngram-mod remembers the first run
    assert r.token_ids == base.token_ids and r.stats.accepted >= 10
    llm.reset_drafters()
    assert mod.used == 0
    llm.engine.stop_ids = set()
    for spec in ("suffix,ngram-map-k", "suffix-tree", "ngram-map-k-tree"):
        r = llm.generate(PROMPTS_TINY[1], max_tokens=20, temperature=0.8, seed=1, spec_type=spec)
        assert len(r.token_ids) == 20  # sampling with model-free (one-hot) drafts and trees runs


def test_tiny_runs_into_eos_and_context(tiny_dir):
    # fixed draft lengths (an adaptive one may draft nothing); n = 1 and no probability cut: the model-free drafters
    # draft on most steps, so that some drafts are accepted
    llm = _tiny_llm(tiny_dir, "llama", None, adaptive=False, ngram_n=1, suffix_min_prob=0.0, suffix_factor=4.0)
    _set_stop(llm, [])
    prompt = PROMPTS_TINY[0]
    free = llm.generate(prompt, max_tokens=200, spec_type="none")
    assert free.finish_reason == "length" and len(free.token_ids) == 64 - 8  # stopped by the context
    eos = free.token_ids[20]
    _set_stop(llm, [eos])
    base = llm.generate(prompt, max_tokens=200, spec_type="none")
    assert base.finish_reason == "stop" and eos not in base.token_ids
    stats = {}
    for spec in SPECS:
        llm.engine.spec.draft_max = 8
        r = llm.generate(prompt, max_tokens=200, spec_type=spec)
        assert r.token_ids == base.token_ids and r.finish_reason == "stop"
        _count(stats, spec, r)
    _set_stop(llm, [])
    for spec in SPECS:
        r = llm.generate(prompt, max_tokens=200, spec_type=spec)
        assert r.token_ids == free.token_ids and r.finish_reason == "length"
        _count(stats, spec, r)
    _assert_drafted_and_accepted(stats)


def test_stop_strings_identical(tiny_dir):
    llm = _tiny_llm(tiny_dir, "qwen2", None, adaptive=False, draft_max=8)  # fixed: an adaptive one may draft nothing
    _set_stop(llm, [])
    prompt = "t22 t22"  # its output repeats itself before the stop: every spec type gets drafts accepted
    free = llm.generate(prompt, max_tokens=30, spec_type="none")
    stop = free.text.split()[10]
    base = llm.generate(prompt, max_tokens=30, stop=[stop], spec_type="none")
    assert stop not in base.text and base.finish_reason == "stop"
    stats = {}
    for spec in SPECS:
        r = llm.generate(prompt, max_tokens=30, stop=[stop], spec_type=spec)
        assert (r.text, r.token_ids) == (base.text, base.token_ids)
        _count(stats, spec, r)
    _assert_drafted_and_accepted(stats)


REAL_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not move. The fox ran away.",
]


@pytest.mark.real
def test_smollm_greedy_equality(smollm_dir):
    # The draft is SmolLM2-135M with int8 weights (int4 needs bf16, so fp32 falls back to int8; the bf16 test
    # covers int4): real, and wrong now and then.
    # Adaptive length is off: a same-size draft never pays, so adaptive would (rightly) stop drafting.
    llm = specdec.LLM(
        str(smollm_dir),
        draft=str(smollm_dir),
        spec_type="none",
        dtype="fp32",
        context=256,
        adaptive=False,
        progress=False,
    )
    drafter = llm.drafter_for("draft")
    stats, branched = {}, 0
    for prompt in REAL_PROMPTS:
        base = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
        for spec, k, branch_p in (
            ("draft", 4, 0.0),
            ("draft", 10, 0.0),
            ("draft", 10, 0.6),
            ("ngram-simple", 6, 0.0),
            ("ngram-map-k", 6, 0.0),
            ("ngram-map-k4v", 6, 0.0),
            ("ngram-map-k-tree", 6, 0.0),
            ("ngram-mod", 6, 0.0),
            ("suffix", 16, 0.0),
            ("suffix-tree", 16, 0.0),
            (CHAIN, 6, 0.0),
            (DEFAULT_WITH_DRAFT_MODEL, 16, 0.0),
        ):
            llm.engine.spec.draft_max, drafter.branch_p = k, branch_p
            r = llm.generate(prompt, max_tokens=48, chat=True, spec_type=spec)
            assert r.token_ids == base.token_ids, (prompt, spec, k, branch_p)
            _count(stats, spec, r)
            branched += r.stats.drafted - sum(r.stats.drafted_at)  # tree nodes beyond one per depth
    _assert_drafted_and_accepted(stats)  # the shallow draft and the n-gram lookup do get tokens accepted
    assert branched > 0  # draft trees (branch_p 0.6) were built and verified


@pytest.mark.real
def test_smollm_speculates_by_default(smollm_dir):
    """The model alone drafts with the model-free default (no flags), and equals plain decoding; adaptive length off,
    so that the drafts are made whatever this machine's timings."""
    llm = specdec.LLM(str(smollm_dir), dtype="fp32", context=256, adaptive=False, progress=False)
    assert llm.config.spec_type == DEFAULT_MODEL_FREE
    stats = {}
    for prompt in REAL_PROMPTS:
        base = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
        r = llm.generate(prompt, max_tokens=48, chat=True)
        assert r.token_ids == base.token_ids, prompt
        _count(stats, "default", r)
    _assert_drafted_and_accepted(stats)


@pytest.mark.real
def test_gemma3_270m_greedy_equality():
    """The gemma3-270m pack (Gemma 3, real weights, its Q4_K_M blocks through the kernels, Python layers around them):
    every model-free drafter and the model as its own draft equal plain decoding, with drafts accepted."""
    llm = specdec.LLM("gemma3-270m", draft="gemma3-270m", spec_type="none", context=256, adaptive=False, progress=False)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        base = llm.generate(prompt, max_tokens=48, spec_type="none")
        for spec, k in (("draft", 4), ("ngram-simple", 6), ("suffix-tree", 16)):
            llm.engine.spec.draft_max = k
            r = llm.generate(prompt, max_tokens=48, spec_type=spec)
            assert r.token_ids == base.token_ids, (prompt, spec)
            assert r.stats.accepted > 0, (prompt, spec)


@pytest.mark.real
def test_smollm_gain_chains_equal_plain(smollm_dir):
    """--spec-chain gain on a real model (fp32): token-identical to plain decoding."""
    llm = specdec.LLM(
        str(smollm_dir),
        draft=str(smollm_dir),
        spec_type="none",
        dtype="fp32",
        context=256,
        adaptive=False,
        draft_max=6,
        chain_mode="gain",
        progress=False,
    )
    stats = {}
    for prompt in REAL_PROMPTS:
        base = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
        for spec in ("ngram-mod,draft", "suffix,ngram-simple,draft"):
            r = llm.generate(prompt, max_tokens=48, chat=True, spec_type=spec)
            assert r.token_ids == base.token_ids, (prompt, spec)
            _count(stats, spec, r)
    _assert_drafted_and_accepted(stats)


@pytest.mark.parametrize("draft_seed", [None, 1])
def test_tiny_gain_chains_equal_plain(tiny_dir, draft_seed):
    """--spec-chain gain: the draft with the most expected accepted tokens; output unchanged."""
    llm = _tiny_llm(tiny_dir, "llama", draft_seed, chain_mode="gain")
    llm.engine.spec.adaptive = False  # fixed lengths: which drafter wins depends on acceptance only, not timing
    _set_stop(llm, [])
    stats = {}
    for prompt in PROMPTS_TINY:
        base = llm.generate(prompt, max_tokens=40, spec_type="none")
        for spec in ("ngram-simple,draft", "suffix,ngram-map-k,draft"):
            r = llm.generate(prompt, max_tokens=40, spec_type=spec)
            assert r.token_ids == base.token_ids, (prompt, spec)
            _count(stats, spec, r)
    _assert_drafted_and_accepted(stats)
    chain = llm.drafter_for("ngram-simple,draft")
    assert chain.mode == "gain" and not chain.declined  # released after each request


@pytest.mark.real
def test_smollm_light_steps_equal_plain(smollm_dir):
    """Light steps (the load controller's arm: only a chain's model-free members draft) every other step, with
    adaptive lengths (drafts priced on top of the step's rows, acceptance started from the drafters' history):
    token-identical to plain decoding on a real model (fp32)."""
    llm = specdec.LLM(
        str(smollm_dir), draft=str(smollm_dir), spec_type="none", dtype="fp32", context=256, draft_max=8, progress=False
    )
    step, n = llm.engine.step, itertools.count()
    stats = {}
    for prompt in REAL_PROMPTS:
        base = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
        llm.engine.step = lambda seqs, cap=None: step(seqs, cap, light=next(n) % 2 == 0)
        r = llm.generate(prompt, max_tokens=48, chat=True, spec_type=DEFAULT_WITH_DRAFT_MODEL)
        llm.engine.step = step
        assert r.token_ids == base.token_ids, prompt
        _count(stats, DEFAULT_WITH_DRAFT_MODEL, r)
    # adaptive lengths are the point here: the model-free member's drafts cost next to nothing, so they pay
    _assert_drafted_and_accepted(stats)
