"""`--draft-vocab N`: the draft model's logits over the first N token ids only. The target checks every drafted
token as before, so greedy outputs equal plain decoding's (here) and sampling stays exact
(tests/test_lossless_sampling.py, the `vocab` configuration)."""

import pytest

import specdec
from specdec import LLM

PROMPT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n"
)


def test_tiny_greedy_equality_with_a_reduced_draft_vocabulary(tiny_dir):
    # the target as its own draft: its drafts are accepted where the target's token is among the first 40 ids
    target = tiny_dir("llama")
    llm = specdec.LLM(
        str(target),
        draft=str(target),
        dtype="fp32",
        context=64,
        draft_vocab=40,
        progress=False,
        adaptive=False,
        draft_max=4,
    )  # fixed draft lengths: an adaptive one may draft nothing
    llm.engine.stop_ids = set()
    drafted = accepted = 0
    for prompt in ("t5 t9 t12 t5 t9", "t33 t2 t71", "t60"):
        base = llm.generate(prompt, max_tokens=30, spec_type="none")
        r = llm.generate(prompt, max_tokens=30, spec_type="draft")
        assert r.token_ids == base.token_ids, prompt
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    model = llm.drafter_for("draft").runner.model
    assert model.lm_head.out_features == 40 and model.model.embed_tokens.weight.shape[0] == 96
    model.keep_head_rows(0)
    assert model.lm_head.out_features == 96


@pytest.mark.real
def test_smollm_gguf_head_rows_keep_greedy_output(smollm_dir):
    """The SmolLM2 pack's Q8_0 head (x16 on AVX2/AVX-512: its first rows, rounded up to 16, sharing the blocks): the
    same tokens as plain decoding, with drafts accepted."""
    llm = LLM("smollm2-135m", draft="smollm2-135m", dtype="fp32", draft_vocab=5000, draft_max=7, progress=False)
    plain = llm.generate(PROMPT, max_tokens=40, spec_type="none")
    r = llm.generate(PROMPT, max_tokens=40, spec_type="draft")
    assert r.token_ids == plain.token_ids and r.stats.accepted > 0
    head = llm.drafter_for("draft").runner.model.lm_head
    assert head.out_features in (5000, 5008) and head.qweight.shape[0] == head.out_features
    assert llm.runner.model.lm_head.out_features == 49152  # the target (the same file) keeps its whole head


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_weight_only_quantized_head_keeps_its_first_rows(kind):
    """`--draft-quant int8|int4` with `--draft-vocab`: the reduced head gives the whole head's first logits."""
    import torch
    from torch import nn

    from specdec.runtime.quant import Int4Linear, Int8Linear

    torch.manual_seed(0)
    head = nn.Linear(128, 96, bias=False, dtype=torch.bfloat16)
    q = (Int4Linear if kind == "int4" else Int8Linear)(head)
    part = q.first_outputs(40)
    n = part.out_features  # int4: rounded up to 16
    assert n == (48 if kind == "int4" else 40) and part.in_features == 128
    for rows in (1, 6):  # the packed one-row kernel and the dequantizing path
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        assert torch.equal(part(x), q(x)[:, :n])


def test_auto_cuts_only_large_vocabularies():
    from specdec.drafters.draft_model import AUTO_VOCAB, VOCAB, head_rows

    assert VOCAB.default == "auto" and VOCAB.check("auto") == "auto" and VOCAB.check("5000") == 5000
    assert head_rows("auto", 151936) == AUTO_VOCAB == 65536  # Qwen2.5
    assert head_rows("auto", 49152) == 0 and head_rows("auto", 96) == 0  # SmolLM2, tiny models: every row
    assert head_rows(0, 151936) == 0 and head_rows(5000, 49152) == 5000
    with pytest.raises(specdec.SpecdecError, match="draft_vocab"):
        VOCAB.check(-1)
