"""The synthetic drafter: acceptance follows the given rates and the output is flagged."""

import specdec


def test_synthetic_rates_and_flag(tiny_dir):
    llm = specdec.LLM(
        str(tiny_dir("qwen2")),
        spec_type="synthetic",
        dtype="fp32",
        context=256,
        synth_rates=[0.9, 0.5],
        synth_len=4,
        adaptive=False,
        progress=False,
    )
    llm.engine.stop_ids = set()
    r = llm.generate("t5 t9", max_tokens=200)
    assert r.synthetic and not llm.generate("t5 t9", max_tokens=5, spec_type="none").synthetic
    first, second = r.stats.per_position_acceptance[:2]
    assert 0.75 < first < 1.0 and 0.3 < second < 0.7
