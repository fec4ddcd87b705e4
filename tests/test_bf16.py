"""bf16: speculative output may differ from plain decoding only at a near-tie of the top two logits."""

import pytest

import specdec
from specdec.stats import first_divergence

# A k-token verify and a 1-token step round differently in bf16; logits are bf16 matmul outputs
# (spacing 0.125 around |16-32|), so a flip needs the plain run's top-2 gap within a few ulps.
NEAR_TIE = 0.5

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "List the planets of the solar system in order, then list them again in reverse order.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.mark.real
def test_bf16_divergence_only_at_near_ties(smollm_dir):
    llm = specdec.LLM(
        str(smollm_dir),
        draft=str(smollm_dir),
        spec_type="none",
        dtype="bf16",
        context=256,
        adaptive=False,
        progress=False,
    )
    total = same = 0
    for prompt in PROMPTS:
        base = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
        for spec in ("draft", "ngram-simple"):
            r = llm.generate(prompt, max_tokens=48, chat=True, spec_type=spec)
            div = first_divergence(base.token_ids, base.top2_gaps, r.token_ids)
            total += 1
            if div is None:
                same += 1
            else:
                assert div["top2_gap"] is not None and div["top2_gap"] < NEAR_TIE, (prompt, spec, div)
    print(f"bf16 match rate: {same}/{total}")
