"""The decoder layer in one C call (specdec/runtime/layer_kernel.py): the same bits as the layer's Python path on
decode, chain verification, ragged batches and trees (logits and the K/V it writes), on a tiny mixed-type GGUF and
on the real SmolLM2 pack; the Python path where the C layer does not apply; one arithmetic per token, however the
prompt is chunked."""

from __future__ import annotations

import pytest
import torch

from specdec.api import LLM
from specdec.runtime import kernels as K
from specdec.runtime.layer_kernel import LayerKernel, LayerStack
from specdec.runtime.runner import FeatureSpec, ModelRunner

pytest.importorskip("gguf")

from test_quant_target import PROMPT, tiny_gguf  # noqa: E402,F401  (the tiny mixed-type GGUF fixture)


@pytest.fixture(autouse=True)
def lib():
    if K.library() is None:
        pytest.skip(f"kernel library not built here: {K.build_error}")


def _counting(monkeypatch, off: bool = False) -> list[int]:
    """Count the calls the C path took, one layer's or the whole stack's (or, off, make it decline every one)."""
    ran = []
    for cls in (LayerKernel, LayerStack):

        def counted(self, *args, run=cls.run):
            out = None if off else run(self, *args)
            ran.append(out is not None)
            return out

        monkeypatch.setattr(cls, "run", counted)
    return ran


def _steps(runner: ModelRunner) -> list:
    """Decode, a 5-row chain, a ragged batch of two sequences and a tree, after prefilling both slots."""
    runner.prefill(PROMPT, 0)
    runner.prefill(PROMPT[:9], 1)
    n = len(PROMPT)
    out = [
        runner.forward([[7]], [n], [0])[0],
        runner.forward([[7, 5, 9, 14, 3]], [n], [0])[0],
        *runner.forward([[7, 5], [3, 7, 5, 9]], [n, 9], [0, 1]),
        runner.verify_tree(0, n, [7, 5, 9, 2, 4], [-1, 0, -1, 2]),
    ]
    return out + [t.clone() for t in runner.cache.k + runner.cache.v]


def _compare(model, monkeypatch) -> None:
    with monkeypatch.context() as mp:
        ran = _counting(mp)
        fast = _steps(ModelRunner(model, num_slots=2, context=64))
    assert ran and all(ran)  # every layer of every step took the C path (prefill: more rows, the Python path)
    with monkeypatch.context() as mp:
        _counting(mp, off=True)
        slow = _steps(ModelRunner(model, num_slots=2, context=64))
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def test_same_bits_as_the_python_layer(tiny_gguf, monkeypatch):
    """Q4_K/Q5_0/Q6_K/Q8_0 matrices, q/k/v biases, two KV heads for four query heads."""
    llm = LLM(str(tiny_gguf), quant="gguf", dtype="fp32", progress=False)
    _compare(llm.runner.model, monkeypatch)


GEMMA = [
    "gemma2",  # sandwich norms, GeGLU, a query scale, soft-capped scores, sliding layers
    "gemma3_text",  # per-head q/k norms, the sliding layers' own rotary base
    # full layers with their own head size whose values are the keys, value norms, layer scalars, per-layer inputs,
    # layers reading the K/V of others
    "gemma4",
    "gemma4_moe",  # experts beside the MLP, its scaled router in C too
]


@pytest.mark.parametrize("case", GEMMA)
def test_same_bits_on_gemma(tmp_path, monkeypatch, case):
    """Gemma's recipes in C: the same bits as their Python layers, on Q8_0 GGUFs from llama.cpp's converter."""
    from families import convert, make_checkpoint, need_converter

    from specdec.models.gguf_quantized import load_gguf_quantized

    need_converter()
    hf = make_checkpoint(tmp_path / "hf", case)
    model, _ = load_gguf_quantized(convert(hf, "q8_0", tmp_path / "q8_0.gguf"), torch.float32)
    _compare(model, monkeypatch)


@pytest.mark.real
def test_same_bits_on_smollm2(smollm_dir, monkeypatch):
    llm = LLM("smollm2-135m", quant="gguf", dtype="fp32", progress=False)
    _compare(llm.runner.model, monkeypatch)


def test_python_path_where_the_c_layer_does_not_apply(tiny_gguf, monkeypatch):
    """A prefill chunk runs in C (one arithmetic for every row count) unless fast prefill is on; bf16 never does."""
    from specdec.runtime import kernels

    llm = LLM(str(tiny_gguf), quant="gguf", dtype="fp32", progress=False)
    ran = _counting(monkeypatch)
    runner = ModelRunner(llm.runner.model, num_slots=1, context=200)
    runner.prefill(PROMPT * 5, 0)  # 85 rows in one chunk
    assert ran == [True]
    ran.clear()
    kernels.set_fast_prefill(True)
    try:
        runner.prefill(PROMPT * 5, 0)  # more rows than fast prefill leaves to the kernels
    finally:
        kernels.set_fast_prefill(False)
    assert ran == []  # the step was not offered to the C layers
    with torch.no_grad():
        bf16 = LLM(str(tiny_gguf), quant="gguf", dtype="bf16", progress=False)
        bf16.runner.forward([[7]], [0], [0])
    assert ran == []


def _ragged(runner: ModelRunner, mode: str) -> list:
    """Three sequences' chunks of 3, 1 and 6 tokens in one forward (mode: features captured, resumed at layer 1,
    or last-row logits only), then the K/V each sequence holds."""
    runner.prefill(PROMPT, 0)
    runner.prefill(PROMPT[:9], 1)
    runner.prefill(PROMPT[:5], 2)
    n, chunks = len(PROMPT), [[7, 5, 9], [3], [1, 2, 3, 4, 5, 6]]
    starts = [n, 9, 5]
    if mode == "resume":
        h = [
            torch.randn(len(c), runner.model.config.hidden_size, generator=torch.Generator().manual_seed(i))
            for i, c in enumerate(chunks)
        ]
        out = runner.forward(chunks, starts, [0, 1, 2], resume=h, resume_layer=1)
    elif mode == "last":
        out = runner.forward(chunks, starts, [0, 1, 2], last_only=True)
        assert [o.shape[0] for o in out] == [1, 1, 1]
    else:
        runner.capture = FeatureSpec((0, 1))
        out = runner.forward(chunks, starts, [0, 1, 2])
        out += [t for f in runner.features for t in (f.layers, f.final)]
    ends = [s + len(c) for s, c in zip(starts, chunks)]  # past these, padding may have written
    return out + [t[slot, :, :end].clone() for t in runner.cache.k + runner.cache.v for slot, end in enumerate(ends)]


@pytest.mark.parametrize("mode", ["features", "resume", "last"])
def test_ragged_chunks_one_row_each(tiny_gguf, monkeypatch, mode):
    """Chunks of different lengths go one row per entry through the C layers (no padding computed): the same
    logits, features and K/V bits as padded to the longest."""
    model = LLM(str(tiny_gguf), quant="gguf", dtype="fp32", progress=False).runner.model
    shapes = []
    with monkeypatch.context() as mp:
        forward = type(model).forward
        mp.setattr(
            type(model),
            "forward",
            lambda self, tokens, *a, **k: shapes.append(tuple(tokens.shape)) or forward(self, tokens, *a, **k),
        )
        flat = _ragged(ModelRunner(model, num_slots=3, context=64), mode)
    assert shapes[-1] == (10, 1)
    monkeypatch.setattr(type(model), "layers_in_c", lambda self, rows: False)
    padded = _ragged(ModelRunner(model, num_slots=3, context=64), mode)
    for a, b in zip(flat, padded, strict=True):
        assert torch.equal(a, b)


def test_logits_do_not_depend_on_chunking(tiny_gguf):
    """A prompt's logits are the same bits computed in one 200-row chunk, after a prefix of any length (a prompt-cache
    hit, a chunked prefill) and one token at a time; with fast prefill (opt-in) the large chunk rounds differently."""
    llm = LLM(str(tiny_gguf), quant="gguf", dtype="fp32", progress=False)
    runner = ModelRunner(llm.runner.model, num_slots=1, context=256)
    ids = (PROMPT * 15)[:200]
    whole = runner.forward([ids], [0], [0])[0]  # [200, V]
    for n in (1, 16, 100, 190):
        runner.prefill(ids[:n], 0)
        assert torch.equal(runner.forward([ids[n:]], [n], [0])[0], whole[n:]), n
    for t in range(190, 200):
        assert torch.equal(runner.forward([[ids[t]]], [t], [0])[0][0], whole[t]), t
    K.set_fast_prefill(True)
    try:
        assert not torch.equal(runner.forward([ids], [0], [0])[0], whole)  # the negative control
    finally:
        K.set_fast_prefill(False)
