"""`early-exit`: the target's first E layers draft on the target's own KV cache; output stays the target's."""
import pytest

import specdec
from specdec.errors import SpecdecError

PROMPTS = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4"]


def _llm(target, **kw):
    kw = {"spec_type": "none", "dtype": "fp32", "context": 96, "adaptive": False, "progress": False, **kw}
    llm = specdec.LLM(str(target), **kw)
    llm.engine.stop_ids = set()
    return llm


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_greedy_equality_every_exit_layer(tiny_dir, family):
    target = tiny_dir(family, layers=3)
    for layer in (1, 2):
        llm = _llm(target, spec_exit_layer=layer)
        drafter = llm.drafter_for("early-exit")
        assert drafter.runner.cache is llm.runner.cache  # no cache of its own
        assert len(drafter.runner.model.model.layers) == layer
        fed = []  # tokens per draft-side prefill: always the one the target has not processed yet
        prefill = drafter.runner.prefill
        drafter.runner.prefill = lambda tokens, *a, **k: fed.append(len(tokens)) or prefill(tokens, *a, **k)
        for prompt in PROMPTS:
            base = llm.generate(prompt, max_tokens=40, spec_type="none")
            for spec, k, branch_p in (("early-exit", 1, 0.0), ("early-exit", 5, 0.0), ("early-exit", 5, 0.7),
                                      ("suffix,early-exit", 4, 0.0)):
                llm.engine.spec.draft_max, drafter.branch_p = k, branch_p
                r = llm.generate(prompt, max_tokens=40, spec_type=spec)
                assert r.token_ids == base.token_ids, (family, layer, prompt, spec, k, branch_p)
        assert set(fed) == {1}  # never a catch-up prefill: the target's cache already holds the context


def test_exit_layer_is_checked(tiny_dir):
    with pytest.raises(SpecdecError, match="spec-exit-layer must be in 1..1"):
        _llm(tiny_dir("llama"), spec_type="early-exit", spec_exit_layer=2).generate("t1", max_tokens=2)


@pytest.mark.real
def test_smollm_greedy_equality(smollm_dir):
    """SmolLM2-135M (30 layers), fp32: every output equals plain decoding; shallow exits get drafts accepted."""
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "List three facts about the Moon."]
    accepted = 0
    for layer in (8, 20):
        llm = _llm(smollm_dir, spec_exit_layer=layer, draft_max=4)
        for prompt in prompts:
            base = llm.generate(prompt, max_tokens=32, chat=True, spec_type="none")
            r = llm.generate(prompt, max_tokens=32, chat=True, spec_type="early-exit")
            assert r.token_ids == base.token_ids, (layer, prompt)
            accepted += r.stats.accepted
    assert accepted > 0
