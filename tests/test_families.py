"""Every model family against transformers, from tiny random checkpoints made by `transformers` (tests/families.py):

1. the checkpoint directory: our logits equal transformers' in fp32 over 32 positions;
2. llama.cpp's own converter (the pinned source's convert_hf_to_gguf.py) to F32: the same, both ways we load a GGUF
   (its tensors directly, and the converted checkpoint directory);
3. speculative greedy decoding (ngram-simple, and the Q8_0 file as its own draft model) equals plain decoding on the
   Q8_0 file, with tokens drafted (and accepted by the draft model).

Against llama.cpp on the same files: tests/test_families_llama_cpp.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import BASE, TINY, need_converter, prompt_ids

TOL = 1e-4


@pytest.fixture(autouse=True)
def _home(family_home):
    pass


# Families whose reference computes another way than ours in float32 (Qwen3.5: transformers' chunked gated delta rule
# for a prompt, ours the recurrent form): checked against transformers in float64, within twice what transformers' own
# float32 misses by (8.9e-4 on the tiny Qwen3.5, ours 4.7e-4; its multimodal checkpoint 1.6e-4, ours 1.9e-4 in one
# run of `bash scripts/test.sh`, under it in others)
OTHER_ARITHMETIC = {"qwen3_5_text", "qwen3_5_moe_text"}


def _float32_bound(ref32: torch.Tensor, exact: torch.Tensor) -> float:
    """How far our float32 logits may be from float64 ones: twice transformers' own float32 error, at least TOL."""
    return max(TOL, 2 * float((ref32 - exact).abs().max()))


def _transformers(directory: Path, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    eager = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # grouped_mm takes no float64
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **eager).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


def _reference(directory: Path, ids: list[int]) -> tuple[torch.Tensor, float]:
    """transformers' logits [T, V] and how close ours must be."""
    import json

    ref = _transformers(directory, ids)
    if json.loads((directory / "config.json").read_text())["model_type"] not in OTHER_ARITHMETIC:
        return ref, TOL
    exact = _transformers(directory, ids, torch.float64)
    return exact, _float32_bound(ref, exact)


def _ours(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] over `ids` in two chunks (the second reads the first's K/V from the cache)."""
    from specdec.runtime.runner import ModelRunner

    runner = ModelRunner(model, num_slots=1, context=64)
    split = 20
    return torch.cat([runner.forward([ids[:split]], [0], [0])[0], runner.forward([ids[split:]], [split], [0])[0]])


@pytest.mark.parametrize("case", list(TINY))
def test_checkpoint_logits_equal_transformers(family_files, case):
    from specdec.models.loader import load_checkpoint

    d = family_files(case).hf
    ids = prompt_ids(d)
    model, _ = load_checkpoint(d, torch.float32)
    ref, tol = _reference(d, ids)
    diff = (_ours(model, ids) - ref).abs().max()
    assert diff <= tol, (case, float(diff))


@pytest.mark.parametrize("case", list(TINY))
def test_f32_gguf_logits_equal_transformers(family_files, case):
    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.models.loader import converted_gguf, load_checkpoint

    need_converter()
    f = family_files(case)
    path, ids = f.gguf("f32"), prompt_ids(f.gguf_hf)
    ref, tol = _reference(f.gguf_hf, ids)
    direct, _ = load_gguf_quantized(path, torch.float32)
    via_dir, _ = load_checkpoint(converted_gguf(path, progress=False), torch.float32)
    for how, model in (("gguf", direct), ("converted", via_dir)):
        diff = (_ours(model, ids) - ref).abs().max()
        assert diff <= tol, (case, how, float(diff))


@pytest.mark.parametrize("case", list(TINY))
def test_speculative_greedy_equals_plain(family_files, case):
    import specdec

    need_converter()
    f = family_files(case)
    path = str(f.gguf("q8_0"))
    llm = specdec.LLM(path, draft=path, spec_type="none", context=128, progress=False, ngram_n=1)
    llm.engine.stop_ids = set()
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, 4
    prompt, drafted = prompt_ids(f.gguf_hf)[:6] * 3, {}
    for _ in range(8):  # a prompt holding its own first greedy token, so that a 1-gram matches at once
        base = llm.generate(prompt, max_tokens=40).token_ids
        for spec in ("ngram-simple", "draft"):
            r = llm.generate(prompt, max_tokens=40, spec_type=spec)
            assert r.token_ids == base, (case, spec)
            drafted[spec] = drafted.get(spec, 0) + r.stats.drafted
            assert spec != "draft" or r.stats.accepted > 0, case  # the target as its own draft: all accepted
        if drafted["ngram-simple"]:
            break
        prompt = base[:1] + prompt
    # ngram-simple: drafted only, a random model seldom repeats itself, so its n-gram drafts are seldom accepted
    assert drafted["ngram-simple"] > 0 and drafted["draft"] > 0, (case, drafted)


# per-head q/k norms; Granite's multipliers; OLMo 2's norms after attention and the MLP and its q/k norms over all
# heads; SmolLM3's layers without rotary; Phi-4-mini's partial rotary
@pytest.mark.parametrize("case", ["qwen3", "granite", "olmo2", "smollm3", "phi4-mini"])
def test_c_layer_takes_the_recipe(family_files, monkeypatch, case):
    """The family's layer runs inside the C decoder layer, the same bits as its Python path."""
    from test_layer_kernel import _compare

    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.runtime import kernels

    need_converter()
    if kernels.library() is None:
        pytest.skip(f"kernel library not built here: {kernels.build_error}")
    model, _ = load_gguf_quantized(family_files(case).gguf("q8_0"), torch.float32)
    _compare(model, monkeypatch)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_c_layer_takes_mixtures_of_experts(family_files, monkeypatch, case):
    """A mixture-of-experts layer runs in C with its router, the whole stack in one call (gpt-oss: its sinks, sliding
    layers, biased router and experts and clamped SwiGLU too): the same bits as its Python path (decode, chains, a
    ragged batch, a tree)."""
    from test_layer_kernel import _compare

    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.runtime import kernels

    need_converter()
    if kernels.library() is None:
        pytest.skip(f"kernel library not built here: {kernels.build_error}")
    model, _ = load_gguf_quantized(family_files(case).gguf("q8_0"), torch.float32)
    _compare(model, monkeypatch)


def test_experts_give_each_row_the_same_bits_at_any_batch(family_files):
    """A mixture of experts groups rows by expert: a token's logits are the same bits alone, in a prefill chunk, and
    beside another sequence (Q8_0 experts through the block kernels, the router one row at a time)."""
    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.runtime.runner import ModelRunner

    need_converter()
    model, _ = load_gguf_quantized(family_files("qwen3_moe").gguf("q8_0"), torch.float32)
    runner = ModelRunner(model, num_slots=2, context=64)
    ids = prompt_ids(family_files("qwen3_moe").gguf_hf)[:12]
    chunk = runner.forward([ids], [0], [0])[0]  # [12, V]
    alone = torch.cat([runner.forward([[t]], [i], [0])[0] for i, t in enumerate(ids)])
    beside = runner.forward([ids[-1:], ids[:5]], [11, 0], [0, 1])[0]
    assert torch.equal(chunk, alone) and torch.equal(beside[0], chunk[-1])


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_experts_answer_the_same_batched_cached_and_in_a_second_process(family_files, case, tmp_path):
    """Same request, same answer on a mixture of experts (Q8_0 GGUF): a prompt's greedy tokens are the same asked
    alone, beside another request, with its prefix from the prompt cache, and in a fresh `specdec generate`."""
    import json
    import subprocess
    import sys

    from test_same_answer import FACTS, _run

    import specdec
    from specdec.engine.scheduler import Request, Scheduler
    from specdec.sampling import SamplingParams

    need_converter()
    path = str(family_files(case).gguf("q8_0"))
    llm = specdec.LLM(path, spec_type="none", parallel=2, context=256, cache_mb=16, progress=False)
    llm.engine.stop_ids = set()
    texts = [f"{FACTS[:400]}\nQuestion: which river flows past Ashford?", "Once upon a time, in a small village,"]
    sched = Scheduler(llm.engine, 2)

    def answers(cache: bool, together: bool) -> list[list[int]]:
        params = SamplingParams(max_tokens=16, temperature=0.0)
        reqs = [Request(llm.encode(t), params, llm.drafter_for("none"), cache_prompt=cache) for t in texts]
        done = _run(sched, reqs, together)
        assert not cache or not together or done[0].seq.cached_tokens > 0  # the long prompt's prefix came cached
        return [r.seq.output_ids for r in done]

    alone = answers(cache=False, together=False)
    answers(cache=True, together=False)  # fills the cache
    assert answers(cache=False, together=True) == alone and answers(cache=True, together=True) == alone
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(texts[0])
    cmd = [sys.executable, "-m", "specdec.cli", "generate", "-m", path, "-f", str(prompt), "-n", "16", "--temp", "0"]
    out = subprocess.run([*cmd, "--ignore-eos", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == alone[0]


def test_dense_experts_for_a_gpu_keep_the_biases_and_the_activation(family_files):
    """`densify` (what `-ngl` puts on a GPU) turns gpt-oss's GGUF experts into dense ones with their biases and clamped
    SwiGLU: the same outputs up to the kernels' 8-bit activations (1.0-1.3% of the norm; 50% with neither)."""
    from specdec.models.gguf_quantized import GGUFExperts, densify, load_gguf_quantized

    need_converter()
    model, _ = load_gguf_quantized(family_files("gpt_oss").gguf("q8_0"), torch.float32)
    blocks = model.model.layers[0].mlp.experts
    assert isinstance(blocks, GGUFExperts) and blocks.gate_up_bias is not None and blocks.limit == 7.0
    dense = densify(blocks, torch.float32)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for e in range(model.config.num_experts):
        assert float((dense(e, x) - blocks(e, x)).norm() / blocks(e, x).norm()) < 0.03, e


def test_unsupported_recipes_are_one_line_errors():
    from specdec.errors import SpecdecError
    from specdec.models.config import ModelConfig

    base = {
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    with pytest.raises(SpecdecError, match=r"unsupported architecture 'gpt_neox' \(supported .*gemma3_text") as e:
        ModelConfig.from_hf_dict({**base, "model_type": "gpt_neox"})
    assert "\n" not in str(e.value)


def test_a_multimodal_qwen3_5_checkpoint_runs_its_text_model(tmp_path):
    """Qwen3.5 ships as `Qwen3_5ForConditionalGeneration` (config `text_config`, weights `model.language_model.*` and
    `model.visual.*`): its text model loads, within twice what transformers' own float32 misses by of its float64
    logits."""
    from families import QWEN3_5, _write_tokenizer, randomize
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from specdec.models.loader import load_checkpoint

    vocab, _ = _write_tokenizer(tmp_path, "qwen2")
    text = {"model_type": "qwen3_5_text", "vocab_size": vocab, **BASE, **QWEN3_5}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    randomize(hf, 0)
    hf.save_pretrained(str(tmp_path))
    ids = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    refs = {}
    for dtype in (torch.float32, torch.float64):
        with torch.no_grad():
            refs[dtype] = hf.to(dtype)(input_ids=torch.tensor([ids])).logits[0].double()
    model, _ = load_checkpoint(tmp_path, torch.float32)
    assert model.config.family == "qwen3_5"
    diff = (_ours(model, ids).double() - refs[torch.float64]).abs().max()
    assert diff <= _float32_bound(refs[torch.float32], refs[torch.float64]), float(diff)


def test_a_multimodal_gemma4_checkpoint_runs_its_text_model(tmp_path):
    """Gemma 4 ships as `Gemma4ForConditionalGeneration` (config `text_config`, weights `model.language_model.*` beside
    the vision and audio towers and their embedders): its text model loads, with transformers' logits."""
    from families import GEMMA4, _write_tokenizer, randomize
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from specdec.models.loader import load_checkpoint

    vocab, _ = _write_tokenizer(tmp_path, "gemma")
    layers = ["sliding_attention", "full_attention"]
    text = {"model_type": "gemma4_text", **BASE, **GEMMA4, "vocab_size": vocab, "layer_types": layers}
    text |= {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    audio = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "output_proj_dims": 16}
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=audio))
    randomize(hf, 0)
    hf.save_pretrained(str(tmp_path))
    ids = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    model, _ = load_checkpoint(tmp_path, torch.float32)
    assert model.config.family == "gemma4"
    assert (_ours(model, ids) - ref).abs().max() <= TOL


# widths the Q8_0 blocks take (multiples of 32: every matrix through the kernels, as in a released model's GGUF)
ROW_INVARIANT = {"gemma4": {}, "gemma4_moe": {}, "qwen3_5_moe": {"shared_expert_intermediate_size": 64}}


@pytest.mark.parametrize("case", list(ROW_INVARIANT))
def test_a_tokens_logits_do_not_depend_on_chunks_or_batch(family_files, tmp_path, case):
    """Same request, same answer for the families whose layers run Python around the block kernels: a Q8_0 GGUF's
    logits are the same bits for a prompt in one forward, in chunks of other sizes, and beside another prompt."""
    from families import convert, make_checkpoint

    from specdec.models.gguf_quantized import load_gguf_quantized
    from specdec.runtime.runner import ModelRunner

    need_converter()
    if ROW_INVARIANT[case]:  # a checkpoint of its own
        hf = make_checkpoint(tmp_path / "hf", case, **ROW_INVARIANT[case])
        path = convert(hf, "q8_0", tmp_path / "q8_0.gguf")
    else:  # the shared one
        hf, path = family_files(case).gguf_hf, family_files(case).gguf("q8_0")
    ids = prompt_ids(hf, 24)
    other = list(reversed(ids))[:17]
    model, _ = load_gguf_quantized(path, torch.float32)
    runner = ModelRunner(model, num_slots=2, context=64)
    whole = runner.forward([ids], [0], [0])[0]
    chunks = [runner.forward([ids[a:b]], [a], [1])[0] for a, b in ((0, 5), (5, 6), (6, 17), (17, 24))]
    assert torch.equal(torch.cat(chunks), whole)
    batched = runner.forward([ids, other], [0, 0], [0, 1])[0]
    assert torch.equal(batched, whole)
