"""Greedy speculative output is token-identical to plain decoding, for every spec type (fp32)."""
import pytest

import specdec

PROMPTS_TINY = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4", "t60"]


def _tiny_llm(tiny_dir, family, draft_seed):
    target = tiny_dir(family)
    draft = target if draft_seed is None else tiny_dir(family, seed=draft_seed, layers=1)
    return specdec.LLM(str(target), draft=str(draft), spec_type="none", dtype="fp32", context=64, progress=False)


def _set_stop(llm, ids):
    for t in ("none", "draft", "ngram-simple"):
        llm.engine_for(t).stop_ids = set(ids)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("draft_seed", [None, 1])  # the target itself as draft (all accepted), a weak random draft
def test_tiny_greedy_equality(tiny_dir, family, draft_seed):
    llm = _tiny_llm(tiny_dir, family, draft_seed)
    _set_stop(llm, [])
    for prompt in PROMPTS_TINY:
        for max_tokens in (1, 7, 40):
            base = llm.generate(prompt, max_tokens=max_tokens, spec_type="none")
            for spec in ("draft", "ngram-simple"):
                for k in (1, 3, 8):
                    llm._spec.draft_max = k
                    r = llm.generate(prompt, max_tokens=max_tokens, spec_type=spec)
                    assert r.token_ids == base.token_ids, (family, prompt, max_tokens, spec, k)
                    assert r.finish_reason == base.finish_reason


def test_tiny_runs_into_eos_and_context(tiny_dir):
    llm = _tiny_llm(tiny_dir, "llama", None)
    _set_stop(llm, [])
    prompt = PROMPTS_TINY[0]
    free = llm.generate(prompt, max_tokens=200, spec_type="none")
    assert free.finish_reason == "length" and len(free.token_ids) == 64 - 8  # stopped by the context
    eos = free.token_ids[20]
    _set_stop(llm, [eos])
    base = llm.generate(prompt, max_tokens=200, spec_type="none")
    assert base.finish_reason == "stop" and eos not in base.token_ids
    for spec in ("draft", "ngram-simple"):
        llm._spec.draft_max = 8
        r = llm.generate(prompt, max_tokens=200, spec_type=spec)
        assert r.token_ids == base.token_ids and r.finish_reason == "stop"
    _set_stop(llm, [])
    for spec in ("draft", "ngram-simple"):
        r = llm.generate(prompt, max_tokens=200, spec_type=spec)
        assert r.token_ids == free.token_ids and r.finish_reason == "length"


def test_stop_strings_identical(tiny_dir):
    llm = _tiny_llm(tiny_dir, "qwen2", None)
    _set_stop(llm, [])
    free = llm.generate("t5 t9", max_tokens=30, spec_type="none")
    stop = free.text.split()[10]
    base = llm.generate("t5 t9", max_tokens=30, stop=[stop], spec_type="none")
    assert stop not in base.text and base.finish_reason == "stop"
    for spec in ("draft", "ngram-simple"):
        r = llm.generate("t5 t9", max_tokens=30, stop=[stop], spec_type=spec)
        assert (r.text, r.token_ids) == (base.text, base.token_ids)


REAL_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not move. The fox ran away.",
]


@pytest.mark.real
def test_smollm_greedy_equality(smollm_dir, smollm_shallow):
    llm = specdec.LLM(str(smollm_dir), draft=str(smollm_shallow), spec_type="none", dtype="fp32",
                      context=256, progress=False)
    accepted = 0
    for prompt in REAL_PROMPTS:
        base = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
        for spec, k in (("draft", 4), ("draft", 10), ("ngram-simple", 6)):
            llm._spec.draft_max = k
            r = llm.generate(prompt, max_tokens=48, chat=True, spec_type=spec)
            assert r.token_ids == base.token_ids, (prompt, spec, k)
            accepted += r.stats.accepted
    assert accepted > 0  # the shallow draft and the n-gram lookup do get tokens accepted
