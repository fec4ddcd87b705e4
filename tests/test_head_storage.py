"""Heads stored in int8 (`--save-dtype int8`): each weight matrix as int8 rows with one fp32 scale per row, read back
in fp32 by every head loader; the parameter count ignores the scales; a head stored so drafts losslessly. EAGLE-3
and Medusa heads run as Q8_0 blocks through the CPU kernels (`--spec-head-quant auto`), losslessly, or as loaded
(`none`)."""

from __future__ import annotations

import pytest
import torch
from conftest import head_llm
from safetensors.torch import load_file
from test_eagle3 import random_head
from test_medusa import random_heads

from specdec.drafters.heads import safetensors_params
from specdec.models.eagle3 import load_head, save_head
from specdec.models.medusa import load_heads, save_heads
from specdec.models.state import SCALE, quantize_int8, read_tensors, store_int8
from specdec.runtime import kernels
from specdec.runtime.gguf_linear import GGUFLinear


def test_int8_rows_round_trip_within_half_a_step(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(6, 40, generator=g),
        "norm": torch.randn(40, generator=g),
        "ids": torch.arange(6),
        "zero": torch.zeros(3, 4),
    }
    q = quantize_int8(state)
    assert (
        q["w"].dtype == torch.int8 and q["w" + SCALE].shape == (6,) and set(q) == {*state, "w" + SCALE, "zero" + SCALE}
    )
    from safetensors.torch import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file(q, str(tmp_path / "model.safetensors"))
    back = read_tensors(tmp_path)
    assert set(back) == set(state)
    step = state["w"].abs().amax(dim=1, keepdim=True) / 127
    assert ((back["w"] - state["w"]).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back["norm"], state["norm"]) and torch.equal(back["ids"], state["ids"])
    assert torch.equal(back["zero"], state["zero"])
    assert set(read_tensors(tmp_path, lambda n: n != "w")) == {"norm", "ids", "zero"}  # scales follow their weight


def test_only_an_int8_weights_scales_are_not_tensors_of_their_own(tmp_path):
    """A float weight's `_scale` (another format's, e.g. fp8 layouts) stays a tensor: read and counted."""
    from safetensors.torch import save_file

    state = {"a.weight": torch.ones(4, 32), "a.weight_scale": torch.ones(4), **quantize_int8({"b": torch.ones(4, 32)})}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert set(read_tensors(tmp_path)) == {"a.weight", "a.weight_scale", "b"}
    assert safetensors_params(tmp_path) == 4 * 32 + 4 + 4 * 32


def test_eagle3_head_in_int8_loads_close_and_drafts_losslessly(tiny_dir, tmp_path):
    target = tiny_dir("llama", layers=3)
    head = random_head(target)
    save_head(head, tmp_path / "fp32", {"kind": "eagle3", "target": "tiny"})
    save_head(head, tmp_path / "int8", {"kind": "eagle3", "target": "tiny"})
    store_int8(tmp_path / "int8" / "model.safetensors")
    stored = load_file(str(tmp_path / "int8" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.int8 and stored["d2t"].dtype == torch.int64
    assert safetensors_params(tmp_path / "int8") == safetensors_params(tmp_path / "fp32")
    loaded = load_head(tmp_path / "int8")
    for k, v in head.state_dict().items():
        w = loaded.state_dict()[k]
        if v.dim() == 2 and v.is_floating_point():
            assert (w - v).abs().max() <= v.abs().amax() / 254 + 1e-6, k
        else:
            assert torch.equal(w, v), k
    llm = head_llm("eagle3", target, tmp_path / "int8", context=96, draft_max=4)
    plain = llm.generate("t5 t9 t12 t5 t9 t12 t5 t9", max_tokens=32, spec_type="none")
    r = llm.generate("t5 t9 t12 t5 t9 t12 t5 t9", max_tokens=32)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0  # drafted only: a random head is right by chance


def test_medusa_heads_in_int8_load(tiny_dir, tmp_path):
    heads = random_heads(tiny_dir("qwen3", layers=3))
    save_heads(heads, tmp_path / "h")
    store_int8(tmp_path / "h" / "model.safetensors")
    loaded = load_heads(tmp_path / "h")
    for k, v in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=float(v.abs().max()) / 254 + 1e-6)


def _eagle3(target, out):
    save_head(random_head(target), out, {"kind": "eagle3", "target": "tiny"})
    return lambda d: (d.head.fc, d.head.midlayer.self_attn.qkv_proj, d.head.midlayer.mlp.down_proj, d.head.lm_head)


def _medusa(target, out):
    save_heads(random_heads(target), out, {"kind": "medusa", "target": "tiny"})
    return lambda d: (d.heads.blocks[0].layers[0], d.heads.lm_heads[-1])


@pytest.mark.skipif(kernels.library() is None, reason="GGUF kernels not built")
@pytest.mark.parametrize("kind,make", [("eagle3", _eagle3), ("medusa", _medusa)])
def test_heads_run_as_q8_0_blocks_losslessly(tiny_dir, tmp_path, kind, make):
    target = tiny_dir("qwen2", layers=3)
    matrices = make(target, tmp_path / "h")
    for quant in ("none", "auto"):
        llm = head_llm(kind, target, tmp_path / "h", context=96, draft_max=3, head_quant=quant)
        assert {type(m) for m in matrices(llm.drafter)} == ({GGUFLinear} if quant == "auto" else {torch.nn.Linear})
        plain = llm.generate("t5 t9 t12 t5 t9 t12 t5 t9", max_tokens=32, spec_type="none")
        r = llm.generate("t5 t9 t12 t5 t9 t12 t5 t9", max_tokens=32)
        # drafted only: random heads are right by chance alone
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, quant
