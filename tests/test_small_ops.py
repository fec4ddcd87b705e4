"""A decoder layer's small operations in C (specdec/runtime/small_ops.py): they match torch's, a row's result is
the same bits however many rows share the call, and torch runs where the C path does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.rope import apply_rotary
from specdec.runtime import kernels as K
from specdec.runtime import small_ops as S


@pytest.fixture(autouse=True)
def lib():
    if K.library() is None:
        pytest.skip(f"kernel library not built here: {K.build_error}")


def test_rms_norm_matches_torch_and_rows_are_independent():
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 96) * 3, torch.randn(96)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = S.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(S.rms_norm(x[1, 3:4], w, 1e-6), out[1, 3:4])


@pytest.mark.parametrize("rd", [32, 16])  # every channel; partial rotary (Phi-4-mini, Qwen3.5): the first half
def test_rope_matches_apply_rotary_in_place(rd):
    torch.manual_seed(1)
    B, T, H, kvh, hd = 2, 3, 4, 2, 32
    qkv = torch.randn(B, T, (H + 2 * kvh) * hd)
    cos, sin = torch.randn(B, 1, T, rd), torch.randn(B, 1, T, rd)
    q, k, v = qkv.split([H * hd, kvh * hd, kvh * hd], dim=-1)
    ref_q = apply_rotary(q.reshape(B, T, H, hd).transpose(1, 2), cos, sin)
    ref_k = apply_rotary(k.reshape(B, T, kvh, hd).transpose(1, 2), cos, sin)
    v_before = v.clone()
    assert S.rope_(qkv, H + kvh, hd, cos, sin)
    assert torch.allclose(q.reshape(B, T, H, hd).transpose(1, 2), ref_q, atol=1e-5)
    assert torch.allclose(k.reshape(B, T, kvh, hd).transpose(1, 2), ref_k, atol=1e-5)
    assert torch.equal(v, v_before)  # v's heads are left alone


def test_silu_mul_matches_torch_and_rows_are_independent():
    torch.manual_seed(2)
    gu = torch.randn(3, 4, 2 * 64) * 4
    gu[0, 0, :4] = torch.tensor([-100.0, -87.5, 0.0, 100.0])  # the exponential's clamp and zero
    gate, up = gu.chunk(2, dim=-1)
    out = S.silu_mul(gu)
    assert out.shape == (3, 4, 64) and torch.allclose(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(S.silu_mul(gu[2, 1:2]), out[2, 1:2])


def test_gelu_mul_matches_torch_and_rows_are_independent():
    gu = torch.randn(3, 4, 2 * 64, generator=torch.Generator().manual_seed(3)) * 4
    gu[0, 0, :4] = torch.tensor([-100.0, -3.0, 0.0, 100.0])  # the exponential's clamp and zero
    gate, up = gu.chunk(2, dim=-1)
    out = S.gelu_mul(gu)
    assert out.shape == (3, 4, 64)
    assert torch.allclose(out, F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(S.gelu_mul(gu[2, 1:2]), out[2, 1:2])


@pytest.mark.parametrize("vocab", [5, 8, 13, 1000, 151936])
def test_top2_matches_argmax_and_topk(vocab):
    torch.manual_seed(3)
    x = torch.randn(17, vocab) * 5
    best, gaps = S.top2(x)
    top = x.topk(2, dim=-1).values  # [17, 2]
    assert best == x.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(gaps), top[:, 0] - top[:, 1])
    assert S.top2(x[4:5]) == ([best[4]], [gaps[4]])  # a row alone: the same bits
    assert S.top2(x[:, : vocab - 1])[0] == x[:, : vocab - 1].argmax(-1).tolist()  # rows apart in memory


def test_top2_ties_and_infinities_as_torch():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0] * 5, [-float("inf")] * 19 + [0.0], [2.0] * 20, [0.0] * 9 + [7.0] * 11])
    best, gaps = S.top2(x)
    assert best == x.argmax(-1).tolist() == [1, 19, 0, 9]  # the first of equal bests
    assert gaps == [0.0, float("inf"), 0.0, 0.0]  # a best value that occurs twice leads by 0
    assert S.top2(x.bfloat16()) == (best, gaps)  # torch's path where the C one does not apply


@pytest.mark.parametrize(
    "router,norm,bias",
    [
        ("softmax_topk", True, False),
        ("softmax_topk", False, False),
        ("topk_softmax", False, True),
        ("scaled", True, False),
    ],
)
@pytest.mark.parametrize("experts,k", [(6, 2), (32, 4), (128, 8)])
def test_route_matches_torch_and_rows_are_independent(router, norm, bias, experts, k):
    """A mixture of experts' router (Qwen3-MoE's softmax then top k, renormalised or not; gpt-oss's top k logits
    softmaxed, with a bias; Gemma 4's over RMS-normed, scaled rows, weighted per expert): torch's choices and weights,
    a row alone the same bits, many rows over threads too."""
    torch.manual_seed(experts + k)
    x, w = torch.randn(300, 64), torch.randn(experts, 64) / 8
    parts = S.RouterParts(w, torch.randn(experts) if bias else None, k, router, norm)
    scored = x
    if router == "scaled":
        parts.in_scale, parts.expert_scale, parts.eps = torch.rand(64) + 0.5, torch.rand(experts) + 0.5, 1e-6
        scored = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * parts.in_scale
    weights, chosen = S.route(x, parts)
    logits = scored @ w.T + (0 if parts.bias is None else parts.bias)
    if router == "topk_softmax":
        top, ref_chosen = logits.topk(k, dim=-1)
        ref = top.softmax(-1)
    else:
        ref, ref_chosen = logits.softmax(-1).topk(k, dim=-1)
        ref = ref / ref.sum(-1, keepdim=True) if norm else ref
    if parts.expert_scale is not None:
        ref = ref * parts.expert_scale[ref_chosen]
    assert torch.equal(chosen, ref_chosen) and torch.allclose(weights, ref, atol=1e-6, rtol=1e-5)
    alone = S.route(x[7:8], parts)
    assert torch.equal(alone[0], weights[7:8]) and torch.equal(alone[1], chosen[7:8])
    many = S.route(x.repeat(40, 1), parts)  # enough rows to split over threads
    assert torch.equal(many[0][-300:], weights) and torch.equal(many[1][-300:], chosen)


def test_route_takes_ties_lowest_expert_first_and_refuses_what_it_cannot_run():
    x, w = torch.ones(1, 8), torch.ones(4, 8)
    weights, chosen = S.route(x, S.RouterParts(w, None, 2, "softmax_topk", True))
    assert chosen.tolist() == [[0, 1]] and weights.tolist() == [[0.5, 0.5]]
    assert S.route(x, S.RouterParts(w, None, 2, "sigmoid", True)) is None  # a kind it does not know
    assert S.route(torch.ones(1, 12), S.RouterParts(torch.ones(4, 12), None, 2, "softmax_topk", True)) is None
    assert S.route(x.double(), S.RouterParts(w.double(), None, 2, "softmax_topk", True)) is None


def test_torch_runs_where_the_c_path_does_not_apply():
    w = torch.randn(16, requires_grad=True)
    x = torch.randn(2, 16)
    assert S.rms_norm(x, w, 1e-6) is None  # gradients wanted
    with torch.no_grad():
        assert S.rms_norm(x, w, 1e-6) is not None
    assert S.rms_norm(x.bfloat16(), w.detach().bfloat16(), 1e-6) is None
    assert S.silu_mul(torch.randn(2, 2 * 12)) is None  # not a multiple of 8
    assert not S.rope_(torch.randn(1, 2, 64).bfloat16(), 1, 32, torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 32))


@pytest.mark.parametrize("tiled", [False, True])
def test_gated_delta_rule_matches_torch_and_tokens_are_independent(monkeypatch, tiled):
    """Qwen3.5's linear attention (models/linear_attention.py): the C inputs, rule and gated norm against its torch
    path, and a token's results the same bits whether it comes alone or among others."""
    from specdec.models.config import ModelConfig
    from specdec.models.linear_attention import GatedDeltaNet
    from specdec.runtime.recurrent import Rows, delta_rule

    torch.manual_seed(0)
    cfg = ModelConfig(
        "qwen3_5_text",
        64,
        64,
        128,
        4,
        4,
        2,
        16,
        64,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_dim=16,
        linear_value_dim=24,
        linear_tiled=tiled,
    )
    net = GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    T = 7
    mixed, a, b = torch.randn(T, net.channels) * 2, torch.randn(T, 4) * 3, torch.randn(T, 4) * 3
    fast = net._inputs(mixed, a, b)
    one = [net._inputs(mixed[t : t + 1], a[t : t + 1], b[t : t + 1]) for t in range(T)]
    assert all(torch.equal(f, torch.cat([o[i] for o in one])) for i, f in enumerate(fast))
    rows, ssm = Rows(mixed, *fast), torch.randn(4, 16, 24)
    state, out = delta_rule(ssm, rows)
    step, outs = ssm, []
    for t in range(T):
        step, o = delta_rule(step, Rows(*(part[t : t + 1] for part in rows.parts())))
        outs.append(o)
    assert torch.equal(step, state) and torch.equal(torch.cat(outs), out)
    z = torch.randn(T, 4, 24)
    normed = net.norm(out, z)
    monkeypatch.setattr(K, "library", lambda: None)  # torch's path
    for f, ref in zip(fast, net._inputs(mixed, a, b)):
        torch.testing.assert_close(f, ref, rtol=1e-5, atol=1e-5)
    ref_state, ref_out = delta_rule(ssm, rows)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(normed, net.norm(out, z), rtol=1e-5, atol=1e-5)
