"""Other engines' words (transformers, vLLM, TGI, Ollama) map onto specdec's settings; the rest fails clearly."""

import pytest

from specdec import compat
from specdec.config import Config
from specdec.drafters.ngram_simple import NgramSimpleDrafter
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence


def test_transformers_words():
    assert compat.from_transformers({"prompt_lookup_num_tokens": 10}) == {
        "spec_type": "ngram-simple",
        "draft_max": 10,
        "ngram_m": 10,
        "ngram_n": 2,
        "ngram_min": 1,
    }
    assert compat.from_transformers({"prompt_lookup_num_tokens": 5, "max_matching_ngram_size": 4})["ngram_n"] == 4
    assert compat.from_transformers(
        {
            "assistant_model": "qwen2.5-coder-0.5b",
            "num_assistant_tokens": 7,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.4,
        }
    ) == {"draft": "qwen2.5-coder-0.5b", "spec_type": "draft", "draft_max": 7, "adaptive": False, "draft_p_min": 0.4}
    assert compat.from_transformers({"assistant_early_exit": 4}) == {"spec_type": "early-exit", "spec_exit_layer": 4}
    assert compat.from_transformers({"use_mtp": True}) == {"spec_type": "mtp"}
    assert compat.from_transformers({"num_assistant_tokens_schedule": "heuristic"}) == {"adaptive": True}
    assert compat.from_transformers({"use_mtp": False, "assistant_model": None}) == {}


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"num_beams": 2}, "unknown transformers argument 'num_beams' .*assistant_model"),
        ({"num_assistant_tokens_schedule": "dynamic"}, "schedule 'dynamic' .*constant, heuristic"),
        ({"assistant_model": "a", "prompt_lookup_num_tokens": 3}, "another argument already chose 'draft'"),
        ({"max_matching_ngram_size": 2}, "needs prompt_lookup_num_tokens"),
        ({"num_assistant_tokens": 0}, "positive integer"),
        ({"assistant_confidence_threshold": 2}, r"in \[0, 1\]"),
    ],
)
def test_transformers_errors(kw, message):
    with pytest.raises(SpecdecError, match=message):
        compat.from_transformers(kw)


def test_vllm_config_and_flags():
    assert compat.from_vllm(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    ) == {"spec_type": "ngram-simple", "draft_max": 5, "ngram_n": 4, "ngram_min": 2}
    assert compat.from_vllm({"model": "d.gguf", "num_speculative_tokens": 3}) == {
        "spec_type": "draft",
        "draft": "d.gguf",
        "draft_max": 3,
    }
    assert compat.from_vllm({"method": "eagle3", "model": "heads/e3"}) == {
        "spec_type": "eagle3",
        "eagle3_head": "heads/e3",
    }
    assert compat.from_vllm({"method": "ngram-mod,draft", "model": "d"}) == {
        "spec_type": "ngram-mod,draft",
        "draft": "d",
    }  # any spec type or chain
    for method, spec in (("suffix", "suffix"), ("mtp", "mtp"), ("dflash", "dflash"), ("medusa", "medusa")):
        assert compat.from_vllm({"method": method})["spec_type"] == spec
    assert compat.from_vllm_flags("[ngram]", 4, 3) == {
        "spec_type": "ngram-simple",
        "draft_max": 4,
        "ngram_n": 3,
        "ngram_min": 3,
    }
    assert compat.from_vllm_flags("d.gguf", 6) == {"spec_type": "draft", "draft": "d.gguf", "draft_max": 6}
    assert compat.from_vllm_flags() == {}


@pytest.mark.parametrize(
    "config,message",
    [
        ("{bad", "not valid JSON"),
        ('{"method": "lookahead"}', "unsupported speculative method 'lookahead' .*ngram, draft_model"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "unsupported --speculative-config key"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "must not exceed"),
        ('{"method": "suffix", "model": "x"}', "takes no model"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_vllm_errors(config, message):
    with pytest.raises(SpecdecError, match=message):
        compat.from_vllm(config)
    with pytest.raises(SpecdecError, match="needs --speculative-model"):
        compat.from_vllm_flags(num_speculative_tokens=3)


def test_tgi_and_modelfile(tmp_path):
    assert compat.from_tgi(4) == {"spec_type": "ngram-simple", "draft_max": 4}
    f = tmp_path / "Modelfile"
    f.write_text(
        "# a comment\nFROM qwen2.5-coder-1.5b\nPARAMETER num_ctx 2048\nPARAMETER num_gpu 0\n"
        "PARAMETER draft_model qwen2.5-coder-0.5b\nPARAMETER num_draft 8\n"
    )
    got = compat.read_modelfile(f)
    assert got == {
        "model": "qwen2.5-coder-1.5b",
        "context": 2048,
        "n_gpu_layers": 0,
        "draft": "qwen2.5-coder-0.5b",
        "draft_max": 8,
        "spec_type": "draft",
    }
    assert Config.make(**got).draft_max == 8
    for text, message in (
        ("FROM m\nPARAMETER temperature 0.7\n", "unsupported PARAMETER 'temperature'.*num_ctx"),
        ("FROM m\nTEMPLATE x\n", "line 2: unsupported instruction 'TEMPLATE'"),
        ("PARAMETER num_ctx 4\n", "no FROM line"),
        ("FROM m\nPARAMETER num_ctx big\n", "expected an integer"),
    ):
        f.write_text(text)
        with pytest.raises(SpecdecError, match=message):
            compat.read_modelfile(f)
    with pytest.raises(SpecdecError, match="cannot read Modelfile"):
        compat.read_modelfile(tmp_path / "missing")


def test_prompt_lookup_falls_back_to_shorter_matches():
    """n = 3 finds nothing; with ngram_min 1 the last token alone matches (transformers' and vLLM's lookup)."""
    seq = Sequence([7, 8, 9, 1, 2, 9], 6, 0, SamplingParams())
    assert NgramSimpleDrafter(3, 4).propose(seq, 4).tokens == []
    assert NgramSimpleDrafter(3, 4, n_min=1).propose(seq, 4).tokens == [1, 2, 9]
    assert NgramSimpleDrafter(3, 4, n_min=2).propose(seq, 4).tokens == []


def _config(*flags):
    from specdec.cli import make_parser

    return Config.from_namespace(make_parser().parse_args(["generate", "-p", "x", *flags]), progress=False)


def test_cli_takes_the_other_engines_flags(tmp_path):
    c = _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.spec_type, c.draft_max, c.drafter["ngram_n"], c.drafter["ngram_min"]) == ("ngram-simple", 5, 4, 4)
    c = _config("--speculative-model", "qwen2.5-coder-0.5b", "--num-speculative-tokens", "3")
    assert (c.spec_type, c.draft, c.draft_max) == ("draft", "qwen2.5-coder-0.5b", 3)
    assert _config("--speculate", "6").draft_max == 6
    f = tmp_path / "Modelfile"
    f.write_text("FROM smollm2-135m\nPARAMETER num_ctx 1024\n")
    c = _config("--modelfile", str(f))
    assert (c.model, c.context) == ("smollm2-135m", 1024)
    with pytest.raises(SpecdecError, match="--speculative-config sets spec_type 'suffix', but 'draft' was given"):
        _config("--spec-type", "draft", "--speculative-config", '{"method": "suffix"}')


def test_cli_errors_are_one_line(tiny_dir):
    from test_cli import assert_clean_error, run

    res = run("generate", "-m", str(tiny_dir("llama")), "-p", "t3", "--speculative-config", '{"method": "x"}')
    assert_clean_error(res, "unsupported speculative method 'x'")


def test_llm_takes_transformers_words(tiny_dir):
    import specdec

    llm = specdec.LLM(
        str(tiny_dir("llama")),
        dtype="fp32",
        context=64,
        progress=False,
        prompt_lookup_num_tokens=4,
        max_matching_ngram_size=3,
    )
    assert (llm.spec_type, llm.config.draft_max, llm.config.drafter["ngram_n"]) == ("ngram-simple", 4, 3)
    llm = specdec.LLM(
        str(tiny_dir("llama")), dtype="fp32", context=64, progress=False, assistant_early_exit=1, adaptive=False
    )  # fixed draft lengths: an adaptive one may draft nothing
    base = llm.generate("t5 t9 t12 t5 t9", max_tokens=12, spec_type="none")
    r = llm.generate("t5 t9 t12 t5 t9", max_tokens=12)
    assert llm.spec_type == "early-exit" and r.token_ids == base.token_ids
    assert r.stats.drafted > 0 and r.stats.accepted > 0


def test_generate_takes_transformers_words_per_call(tiny_dir):
    import specdec

    llm = specdec.LLM(
        str(tiny_dir("llama")), dtype="fp32", context=64, progress=False, ngram_n=2, ngram_min=1, adaptive=False
    )  # fixed draft lengths: an adaptive one may draft nothing
    llm.engine.stop_ids = set()
    drafted = accepted = 0
    for prompt in ("t5 t9 t12 t5 t9 t12 t5 t9", "t1 t1 t1 t1 t1 t1"):  # the tiny model repeats t1: drafts accepted
        base = llm.generate(prompt, max_tokens=16)
        r = llm.generate(prompt, max_tokens=16, prompt_lookup_num_tokens=3)
        assert r.token_ids == base.token_ids, prompt
        assert max(r.stats.chosen_lens) <= 3  # num tokens per call: the draft length cap
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    assert drafted > 0 and accepted > 0
    with pytest.raises(SpecdecError, match="per request only the spec type"):
        llm.generate(prompt, max_tokens=4, prompt_lookup_num_tokens=3, max_matching_ngram_size=4)
    with pytest.raises(SpecdecError, match="unknown transformers argument 'num_beams'"):
        llm.generate(prompt, max_tokens=4, num_beams=2)
    with pytest.raises(SpecdecError, match="transformers' arguments sets spec_type 'ngram-simple', but 'suffix'"):
        llm.generate(prompt, max_tokens=4, spec_type="suffix", prompt_lookup_num_tokens=3)
