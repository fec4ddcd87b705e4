"""The target's `--quant` (`LLM(quant=...)`): `gguf` runs the GGUF file's own blocks (GGUFLinear); speculation
stays lossless against that quantized target; a checkpoint directory with `--quant gguf` is a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdec.api import LLM
from specdec.errors import SpecdecError
from specdec.runtime import kernels as K

gguf = pytest.importorskip("gguf")

from test_gguf_kernels import _tiny_gguf  # noqa: E402  (the tiny mixed-type model, 2 layers, vocab 300)

V = 300


class _WriterWithTokenizer(gguf.GGUFWriter):
    """`_tiny_gguf` writes no tokenizer; `load_gguf_quantized` needs one: a gpt2 token list over the 300 ids."""

    def write_header_to_file(self, *args, **kwargs):
        self.add_tokenizer_model("gpt2")
        self.add_token_list([chr(ord("a") + i) for i in range(26)] + ["ab"] + [f"<{i}>" for i in range(27, V)])
        self.add_token_types([1] * V)
        self.add_token_merges(["a b"])
        self.add_eos_token_id(0)
        return super().write_header_to_file(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "tiny-mixed.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", _WriterWithTokenizer)
        _tiny_gguf(path, True, np.random.default_rng(11))
    return path


PROMPT = [5, 9, 14, 3, 7, 5, 9, 14, 3, 7, 5, 9, 14, 3, 7, 5, 9]  # repeats: the n-gram and suffix drafters draft


def test_gguf_target_loads_and_speculation_is_lossless(tiny_gguf):
    from specdec.models.gguf_quantized import GGUFEmbedding
    from specdec.runtime.gguf_linear import GGUFLinear

    # draft_max 7: verification stays within 8 rows, the kernel path plain decoding uses (prefill: the same in both)
    llm = LLM(
        str(tiny_gguf),
        quant="gguf",
        dtype="fp32",
        draft_max=7,
        adaptive=False,  # fixed: adaptive may not draft
        progress=False,
    )
    m = llm.runner.model
    assert isinstance(m.model.embed_tokens, GGUFEmbedding)
    assert not any(isinstance(x, torch.nn.Linear) for x in m.modules())
    lins = [x for x in m.modules() if isinstance(x, GGUFLinear)]
    assert {x.type_name.removesuffix(" x16") for x in lins} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    if K.runs_x16():  # repacked for the AVX-512 kernels where the output count allows
        assert all((x.type_name.endswith(" x16")) == (x.out_features % 16 == 0) for x in lins)
    assert llm.quant == "gguf" and llm.quant_info.startswith("gguf: Q4_K/Q5_0/Q6_K/Q8_0 ")
    assert "dequantized" not in llm.quant_info  # every matrix of the file is a kernel type
    plain = llm.generate(PROMPT, max_tokens=24, spec_type="none")
    assert plain.stats.new_tokens > 0
    for spec in ("ngram-simple", "suffix"):
        r = llm.generate(PROMPT, max_tokens=24, spec_type=spec)
        assert r.token_ids == plain.token_ids, spec
        assert r.stats.drafted > 0, spec  # it did speculate (and rejected some: a random model)
        assert r.stats.accepted > 0, spec
        assert r.stats.target_forwards <= plain.stats.target_forwards


def test_gguf_tokenizer_is_built_once_per_tokenizer(tiny_gguf, tmp_path, monkeypatch):
    """Built once, and shared by a file with other weights and the same tokenizer metadata."""
    from specdec.models import gguf_convert
    from specdec.models.gguf_convert import gguf_tokenizer

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    first = gguf_tokenizer(tiny_gguf)
    assert (first / "tokenizer.json").exists() and first.parent == tmp_path / "home" / "tokenizers"
    other = tmp_path / "other.gguf"
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    other.write_bytes(data)
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *a: pytest.fail("built again"))
    assert gguf_tokenizer(tiny_gguf) == first == gguf_tokenizer(other)
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp folder left


def test_gguf_architecture_from_the_header(tiny_gguf, tmp_path, monkeypatch):
    """The header's first key where llama.cpp's converter writes it, else the reader's answer."""
    import gguf

    from specdec.models import gguf_convert
    from specdec.models.gguf_convert import gguf_architecture

    with monkeypatch.context() as m:
        m.setattr(gguf_convert, "open_gguf", lambda p: pytest.fail("opened the whole file"))
        assert gguf_architecture(tiny_gguf) == "qwen2"
    w = gguf.GGUFWriter(tmp_path / "late.gguf", "llama")
    w.kv_data[0] = {"general.name": gguf.GGUFValue("x", gguf.GGUFValueType.STRING), **w.kv_data[0]}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert gguf_architecture(tmp_path / "late.gguf") == "llama"


def test_unknown_quant_is_refused(tiny_gguf):
    with pytest.raises(SpecdecError, match="unknown target quantization"):
        LLM(str(tiny_gguf), quant="q4", progress=False)


def test_quant_gguf_on_checkpoint_dir_is_a_clear_error(tiny_dir):
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "-m", str(tiny_dir("qwen2")), "-p", "t1", "--quant", "gguf"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--quant gguf needs a GGUF file or a model pack" in lines[0], res.stderr


def test_quant_int8_target_is_lossless_against_itself(tiny_dir):
    from specdec.runtime.quant import Int8Linear

    # fixed draft lengths (see above); ngram_min 1: the output repeats a 3-gram, found from its first token
    llm = LLM(
        str(tiny_dir("qwen2")), quant="int8", dtype="fp32", draft_max=4, adaptive=False, ngram_min=1, progress=False
    )
    assert any(isinstance(x, Int8Linear) for x in llm.runner.model.modules())
    assert llm.quant_info.startswith("int8: weight-only")
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]
    plain = llm.generate(prompt, max_tokens=16, spec_type="none")
    r = llm.generate(prompt, max_tokens=16, spec_type="ngram-simple")
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0 and r.stats.accepted > 0, r.stats


@pytest.mark.real
def test_smollm_pack_gguf_greedy_lossless(smollm_dir):
    """The SmolLM2-135M pack's GGUF (Q4_1 matrices and the Q8_0 embedding, all as blocks through the kernels): plain
    and ngram-simple greedy outputs identical on the quantized target."""
    llm = LLM(
        "smollm2-135m",
        quant="gguf",
        dtype="fp32",
        draft_max=7,
        adaptive=False,  # fixed: see above
        progress=False,
    )
    assert llm.quant_info.startswith("gguf: Q4_1/Q8_0 ") and "dequantized" not in llm.quant_info
    prompt = (
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "def factorial(n):\n    if n < 2:\n        return 1\n"
    )  # it goes on with lines of the prompt: drafts
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    spec = llm.generate(prompt, max_tokens=24, spec_type="ngram-simple")
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0 and spec.stats.accepted > 0, spec.stats
    assert plain.stats.new_tokens == 24 or plain.finish_reason == "stop"


@pytest.fixture(scope="module")
def smollm_q8(smollm_dir, tmp_path_factory):
    """The SmolLM2-135M pack's GGUF with its Q4_1 matrices requantized to Q8_0 by the gguf
    package: a real model whose every matrix runs through the kernels."""
    from specdec.models.packs import pack_gguf

    src = gguf.GGUFReader(pack_gguf("smollm2-135m", progress=False))
    out = tmp_path_factory.mktemp("smollm-q8") / "smollm2-135m-q8_0.gguf"
    w = gguf.GGUFWriter(str(out), src.fields["general.architecture"].contents())
    for f in src.fields.values():
        if not f.name.startswith("GGUF.") and f.name not in ("general.architecture", "general.alignment"):
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    Q41, Q8 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    for t in src.tensors:
        if t.tensor_type == Q41:
            w.add_tensor(t.name, gguf.quants.quantize(gguf.quants.dequantize(t.data, Q41), Q8), raw_dtype=Q8)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.real
def test_real_model_through_the_kernels_greedy_identical(smollm_q8):
    """SmolLM2-135M in Q8_0 blocks, the default `--quant auto` (gguf, fp32 activations): every spec type, the
    draft model (itself) and a draft tree give exactly plain decoding's tokens (on AVX-512: x16 kernels at every
    row count, attention per row)."""
    llm = LLM(
        str(smollm_q8),
        draft=str(smollm_q8),
        spec_type="none",
        adaptive=False,  # fixed: see above
        progress=False,
    )
    assert llm.quant == "gguf" and llm.dtype == torch.float32
    assert llm.quant_info.startswith("gguf: Q8_0 ") and "dequantized" not in llm.quant_info
    prompt = (
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "def factorial(n):\n"
    )
    plain = llm.generate(prompt, max_tokens=40, spec_type="none")
    for spec in ("ngram-simple", "suffix", "suffix-tree", "draft"):
        r = llm.generate(prompt, max_tokens=40, spec_type=spec)
        assert r.token_ids == plain.token_ids, spec
        assert r.stats.drafted > 0 and r.stats.accepted > 0, (spec, r.stats)
    assert r.stats.target_forwards < plain.stats.target_forwards  # the draft (the model itself) was accepted


@pytest.mark.real
def test_generate_json_reports_quant(smollm_dir):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "generate",
            "-m",
            "smollm2-135m",
            "--quant",
            "gguf",
            "--dtype",
            "fp32",
            "-p",
            "Hello",
            "-n",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["quant"].startswith("gguf: ")


def test_densify_holds_the_files_weights(tiny_gguf):
    """`-ngl`'s GPU parts of a GGUF target: every GGUF module becomes a dense one with the file's dequantized
    weights (fused parts side by side), norms untouched."""
    from specdec.models.gguf_quantized import GGUFEmbedding, densify, load_gguf_quantized
    from specdec.runtime.gguf_linear import GGUFConcatLinear, GGUFLinear

    model, _ = load_gguf_quantized(tiny_gguf, torch.float32)
    fused = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(fused, GGUFConcatLinear)
    want = {
        "model.layers.0.self_attn.qkv_proj": torch.cat([p.dequantize() for p in fused.parts]),
        "model.layers.1.mlp.down_proj": model.model.layers[1].mlp.down_proj.dequantize(),
        "model.embed_tokens": model.model.embed_tokens.table.dequantize(),
    }
    norm = model.model.norm.weight
    assert densify(model, torch.float32) is model and model.model.norm.weight is norm
    assert not any(isinstance(m, (GGUFEmbedding, GGUFLinear, GGUFConcatLinear)) for m in model.modules())
    for name, w in want.items():
        torch.testing.assert_close(model.get_submodule(name).weight, w, rtol=0, atol=0)
