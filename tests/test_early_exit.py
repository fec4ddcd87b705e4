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
    stats = {}  # spec -> [drafted, accepted]
    for layer in (1, 2):
        llm = _llm(target, spec_exit_layer=layer)
        drafter = llm.drafter_for("early-exit")
        assert drafter.runner.cache is llm.runner.cache  # no cache of its own
        assert len(drafter.runner.model.model.layers) == layer
        fed = []  # tokens per draft forward: always one (no catch-up, the target's cache holds the context)
        forward = drafter.runner.forward
        drafter.runner.forward = lambda chunks, *a, **k: fed.extend(map(len, chunks)) or forward(chunks, *a, **k)
        starts = []  # the layer each target forward starts at: E where it verifies an early-exit chain
        target_forward = llm.runner.forward
        llm.runner.forward = lambda *a, **k: starts.append(k.get("resume_layer", 0)) or target_forward(*a, **k)
        for prompt in PROMPTS:
            base = llm.generate(prompt, max_tokens=40, spec_type="none")
            for spec, k, branch_p in (
                ("early-exit", 1, 0.0),
                ("early-exit", 5, 0.0),
                ("early-exit", 5, 0.7),
                ("suffix,early-exit", 4, 0.0),
            ):
                llm.engine.spec.draft_max, drafter.branch_p = k, branch_p
                r = llm.generate(prompt, max_tokens=40, spec_type=spec)
                assert r.token_ids == base.token_ids, (family, layer, prompt, spec, k, branch_p)
                n = stats.setdefault(spec, [0, 0])
                n[0], n[1] = n[0] + r.stats.drafted, n[1] + r.stats.accepted
        assert set(fed) == {1}  # never a catch-up prefill: the target's cache already holds the context
        assert set(starts) == {0, layer}  # chains verified from layer E on; prefill, k = 0 and trees from 0
        llm.runner.forward = target_forward
    assert all(drafted > 0 and accepted > 0 for drafted, accepted in stats.values()), stats


def test_exit_layer_is_checked(tiny_dir):
    with pytest.raises(SpecdecError, match="spec-exit-layer must be in 1..1"):
        _llm(tiny_dir("llama"), spec_type="early-exit", spec_exit_layer=2).generate("t1", max_tokens=2)


@pytest.mark.real
def test_smollm_greedy_equality(smollm_dir):
    """SmolLM2-135M (30 layers), fp32: every output equals plain decoding; shallow exits get drafts accepted."""
    prompts = ["Write a Python function that returns the n-th Fibonacci number.", "List three facts about the Moon."]
    accepted = 0
    for layer in (8, 20):
        llm = _llm(smollm_dir, spec_exit_layer=layer, draft_max=4)
        for prompt in prompts:
            base = llm.generate(prompt, max_tokens=32, chat=True, spec_type="none")
            r = llm.generate(prompt, max_tokens=32, chat=True, spec_type="early-exit")
            assert r.token_ids == base.token_ids, (layer, prompt)
            accepted += r.stats.accepted
    assert accepted > 0


def test_tiny_batched_requests_equal_plain(tiny_dir):
    """Eight requests, four slots: the early-exit drafts of a step run as one ragged forward on the shared cache
    while other slots prefill and verify; every output equals plain decoding."""
    from test_scheduler import PROMPTS, _run

    from specdec.engine.scheduler import Request, Scheduler
    from specdec.sampling import SamplingParams

    llm = _llm(tiny_dir("llama", layers=3), spec_exit_layer=2, draft_max=4, parallel=4)
    params = SamplingParams(max_tokens=24)
    bases = [llm.generate(p, max_tokens=24, spec_type="none").token_ids for p in PROMPTS]
    sched = Scheduler(llm.engine, 4, prefill_chunk=5)
    reqs = [Request(llm.encode(p), params, llm.drafter_for("early-exit")) for p in PROMPTS]
    _run(sched, reqs)
    assert [r.seq.output_ids for r in reqs] == bases
    assert sum(r.seq.stats.accepted for r in reqs) > 0


def test_plan_note(tiny_dir):
    """`specdec plan` counts no memory for it and says where it would pay."""
    from test_cli import run

    res = run("plan", "-m", str(tiny_dir("llama", layers=3)), "--spec-type", "early-exit")  # E = 3 // 2
    assert res.returncode == 0, res.stderr
    assert "early-exit at layer 1 of 3: no weights or KV of its own" in res.stdout
    assert "pays only above 33% acceptance" in res.stdout
