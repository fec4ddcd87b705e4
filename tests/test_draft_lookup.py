"""`--draft-lookup N`: the draft model's forwards also feed guessed tokens (prompt lookup); where it draws them
their forwards are saved. Each token is still drawn from the draft's own logits for its position, so drafts, and
with them outputs and statistics, are those without guesses (greedy and seeded here; the sampling matrix in
tests/test_lossless_sampling.py runs with the default lookup)."""

import pytest

import specdec
from specdec import LLM
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.runtime.runner import ModelRunner

PROMPT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
)


def _runs(llm, prompt: str, monkeypatch, **kw):
    """(result, draft-model forwards) for lookup 0 then the LLM's own."""
    drafter, out = llm.drafter_for("draft"), []
    calls = []
    real = ModelRunner.forward
    monkeypatch.setattr(
        ModelRunner, "forward", lambda self, *a, **k: (calls.append(self is drafter.runner), real(self, *a, **k))[1]
    )
    for lookup in (0, drafter.lookup):
        drafter.lookup, calls[:] = lookup, []
        out.append((llm.generate(prompt, spec_type="draft", **kw), sum(calls)))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tiny_guesses_leave_drafts_and_outputs_unchanged(tiny_dir, monkeypatch, temperature):
    """The target as its own draft, guessing from an oracle: the plain output's next tokens with every third guess
    wrong, so guesses are drawn and missed."""
    target = tiny_dir("llama")
    llm = specdec.LLM(
        str(target), draft=str(target), dtype="fp32", context=128, draft_max=6, adaptive=False, progress=False
    )
    llm.engine.stop_ids = set()
    saved = drafted = accepted = 0
    for prompt in ("t5 t9 t12 t5 t9 t12 t5", "t33 t2 t71", "t60"):
        ids = llm.encode(prompt)
        full = ids + llm.generate(ids, max_tokens=40, spec_type="none", temperature=temperature, seed=7).token_ids

        def oracle(self, st):
            at, want = len(st.seq.tokens) + len(st.tokens), min(self.reach.get(st.seq.slot, self.lookup), 4)
            return [t if (at + i) % 3 else (t + 1) % 96 for i, t in enumerate(full[at : at + want])]

        monkeypatch.setattr(DraftModelDrafter, "_guess", oracle)
        (a, fa), (b, fb) = _runs(llm, ids, monkeypatch, max_tokens=40, temperature=temperature, seed=7)
        assert b.token_ids == a.token_ids == full[len(ids) :]
        assert (b.stats.drafted, b.stats.accepted) == (a.stats.drafted, a.stats.accepted)
        saved += fa - fb
        drafted, accepted = drafted + b.stats.drafted, accepted + b.stats.accepted
    assert saved > 0  # guesses were drawn
    assert drafted > 0 and accepted > 0  # the target as its own draft


@pytest.mark.real
def test_smollm_guesses_save_draft_forwards(smollm_dir, monkeypatch):
    llm = LLM("smollm2-135m", draft="smollm2-135m", dtype="fp32", draft_max=7, adaptive=False, progress=False)
    plain = llm.generate(PROMPT, max_tokens=48, spec_type="none")
    (a, fa), (b, fb) = _runs(llm, PROMPT, monkeypatch, max_tokens=48)
    assert a.token_ids == b.token_ids == plain.token_ids and b.stats.accepted > 0
    assert fb < fa
