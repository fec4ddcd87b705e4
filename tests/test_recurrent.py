"""Recurrent states of linear-attention layers (Qwen3.5's gated DeltaNet, `runtime/recurrent.py`), on the tiny
Qwen3.5 of tests/families.py: a rollback gives the bits of a straight run; speculation, with partial acceptances
replaying held rows, equals plain decoding, alone and in the scheduler's batches."""

from __future__ import annotations

import pytest
import torch
from families import need_converter, prompt_ids
from test_same_answer import _run

from specdec.errors import SpecdecError
from specdec.runtime import recurrent


@pytest.fixture(autouse=True)
def _home(family_home):
    pass


@pytest.fixture(scope="module")
def qwen35(family_files):
    need_converter()
    return family_files("qwen3_5")


def _runner(path):
    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.runtime.runner import ModelRunner

    model, _ = load_gguf_quantized(path, torch.float32)
    return ModelRunner(model, num_slots=2, context=64)


def test_a_rollback_gives_the_bits_of_a_straight_run(qwen35):
    ids = prompt_ids(qwen35.gguf_hf, 24)
    runner = _runner(qwen35.gguf("q8_0"))
    straight = runner.forward([ids], [0], [0])[0]  # [24, V]
    runner.forward([ids[:10]], [0], [1])
    runner.forward([ids[10:12] + [7, 8, 9]], [10], [1])  # two right tokens, three wrong: back to 12
    assert torch.equal(runner.forward([ids[12:16]], [12], [1])[0], straight[12:16])
    # drafting forwards that do not settle: a rejection goes back to the first of them
    for i, t in enumerate([5, 6, 7]):
        runner.forward([[t]], [16 + i], [1], settle=False)
    assert torch.equal(runner.forward([ids[16:]], [16], [1])[0], straight[16:])
    with pytest.raises(SpecdecError, match="cannot roll a recurrent state back to position 3"):
        runner.forward([ids[3:5]], [3], [1])


def test_a_new_sequence_in_a_slot_starts_from_zeros(qwen35):
    ids = prompt_ids(qwen35.gguf_hf, 12)
    runner = _runner(qwen35.gguf("q8_0"))
    first = runner.forward([ids], [0], [0])[0]
    runner.forward([ids[::-1]], [0], [0])
    assert torch.equal(runner.forward([ids], [0], [0])[0], first)


def _llm(qwen35, **kw):
    import specdec

    path = str(qwen35.gguf("q8_0"))
    draft = qwen35.gguf("q4_k_m") or qwen35.gguf("f32")  # near the target: long accepted runs, some rejections
    llm = specdec.LLM(path, draft=str(draft), spec_type="none", context=128, progress=False, adaptive=False, **kw)
    llm.engine.stop_ids = set()
    llm.engine.spec.draft_max = 4
    return llm


@pytest.fixture
def replays(monkeypatch):
    """How many times a state was replayed over held rows (a rollback into the middle of a verified draft)."""
    seen = [0]
    real = recurrent.replay

    def counted(state, rows):
        seen[0] += len(rows) > 0
        return real(state, rows)

    monkeypatch.setattr(recurrent, "replay", counted)
    return seen


def test_speculative_greedy_equals_plain_with_rollbacks(qwen35, replays):
    llm = _llm(qwen35)
    prompt = prompt_ids(qwen35.gguf_hf, 8)
    base = llm.generate(prompt, max_tokens=40).token_ids
    for spec in ("draft", "early-exit"):
        r = llm.generate(prompt, max_tokens=40, spec_type=spec)
        assert r.token_ids == base, spec
        assert r.stats.accepted > 0, spec
    assert replays[0] > 0


def test_trees_verify_their_first_path_in_batches(qwen35, replays):
    """Scheduler batches of plain, draft-model trees (cut to their first path), early exit and n-gram drafts equal
    each request alone."""
    from specdec.engine.scheduler import Request, Scheduler
    from specdec.sampling import SamplingParams

    llm = _llm(qwen35, parallel=2, draft_branch_p=0.3)
    prompts = [prompt_ids(qwen35.gguf_hf, n)[k:] for n, k in ((10, 0), (16, 3), (7, 1), (12, 2))]
    specs = ["draft", "none", "early-exit", "ngram-simple"]
    bases = [llm.generate(p, max_tokens=24).token_ids for p in prompts]
    sched = Scheduler(llm.engine, 2, controller=None, prefill_chunk=5)
    reqs = [Request(p, SamplingParams(max_tokens=24), llm.drafter_for(s)) for p, s in zip(prompts, specs)]
    _run(sched, reqs, together=True)
    for r, base, s in zip(reqs, bases, specs):
        assert r.seq.output_ids == base, s
    assert reqs[0].seq.stats.accepted > 0 and replays[0] > 0
