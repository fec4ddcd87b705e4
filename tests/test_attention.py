"""The C attention of decode and verification steps (specdec/runtime/attention.py): it matches torch's SDPA,
and a query row's output is the same bits however many rows (and masked keys) share the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime import kernels as K
from specdec.runtime.attention import _kernel, attention


@pytest.fixture(autouse=True)
def lib():
    if K.library() is None:
        pytest.skip(f"kernel library not built here: {K.build_error}")


def need_path(path: str) -> None:
    """Skip a test of kernel path `path` where this CPU lacks it: it would test a lower path under the higher name."""
    best = K.library().gq_best_path()
    if K.PATHS[path] > best:
        pytest.skip(f"this CPU has no {path} (best: {K.PATH_NAMES[best]})")


def _cache(B=2, kvh=2, S=40, hd=64, spare=8):
    k = torch.randn(B, kvh, S + spare, hd)[:, :, :S]  # a view of a longer cache, as KVCache.read gives
    v = torch.randn(B, kvh, S + spare, hd)[:, :, :S]
    return k, v


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_matches_sdpa_with_mask_and_gqa(path, monkeypatch):
    need_path(path)
    monkeypatch.setenv("SPECDEC_KERNEL_PATH", path)
    torch.manual_seed(0)
    k, v = _cache()
    q = torch.randn(2, 6, 5, 64)
    mask = torch.rand(2, 1, 5, 40) > 0.3
    mask[..., 0] = True  # every row sees a key
    out = _kernel(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert out is not None and out.shape == (2, 5, 6, 64)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
    none = _kernel(q[:, :, :1], k, v, None)  # no mask: every key
    ref = F.scaled_dot_product_attention(q[:, :, :1], k, v, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(none, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_soft_cap_and_sinks_match_the_written_out_attention(path, monkeypatch):
    """Gemma 2's soft cap and gpt-oss's sinks in the kernel: torch's written-out attention's values, and a row's
    output the same bits alone or among drafted rows."""
    from specdec.runtime.attention import _written_out

    need_path(path)
    monkeypatch.setenv("SPECDEC_KERNEL_PATH", path)
    torch.manual_seed(2)
    k, v = _cache()
    q = torch.randn(2, 6, 5, 64) * 3
    for softcap, sinks in ((30.0, None), (None, torch.randn(6) * 2), (5.0, torch.randn(6))):
        mask = torch.rand(2, 1, 5, 40) > 0.3
        mask[0, 0, 0] = sinks is None  # with sinks, a row that sees no key: all of its weight on the sink
        out = _kernel(q, k, v, mask, 0.125, softcap, sinks)
        ref = _written_out(q, k, v, mask, 0.125, softcap, sinks)
        assert out is not None and torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (softcap, sinks)
        alone = _kernel(q[:1, :, 2:3], k[:1], v[:1], mask[:1, :, 2:3], 0.125, softcap, sinks)
        assert torch.equal(alone[:, 0], out[:1, 2])
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_a_row_is_the_same_bits_alone_or_among_drafts():
    """Decode (one row, keys up to its position) and verification (rows after it, causal mask over more keys)."""
    torch.manual_seed(1)
    k, v = _cache(B=1, S=30)
    q = torch.randn(1, 6, 7, 64)
    pos = 22  # row 0 sits at position 22: it sees keys 0..22
    alone = attention(q[:, :, :1], k[:, :, : pos + 1], v[:, :, : pos + 1], None)
    causal = (torch.arange(30)[None, :] <= torch.arange(pos, pos + 7)[:, None])[None, None]  # [1, 1, 7, 30]
    among = attention(q, k, v, causal)
    assert torch.equal(alone[:, 0], among[:, 0])


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("window", [None, 10])
def test_tiles_give_each_row_its_own_bits(path, window, monkeypatch):
    """A prefill chunk's rows share each key's loads in tiles (their heads in blocks of up to 8 pairs, each row over
    the run of keys it sees, causal or within a sliding window): every row is the same bits as alone, beside a
    tree's branches (keys that are not one run) and a row that sees no key."""
    need_path(path)
    monkeypatch.setenv("SPECDEC_KERNEL_PATH", path)
    torch.manual_seed(3)
    T, S = 37, 60
    ahead = torch.arange(S - T, S)[:, None] - torch.arange(S)[None, :]  # [T, S] each row's distance to each key
    mask = ((ahead >= 0) & (ahead < (window or S)))[None, None].clone()  # [1, 1, T, S]
    mask[0, 0, 20, S - T + 18] = False  # a branch: row 20 does not see row 18's key
    mask[0, 0, 30] = False  # a padded row
    # three query heads a KV head: blocks that span rows with different heads; one: blocks of 4 or 8 rows, whose
    # rows see up to 7 keys the block's first row does not
    for heads, kvh in ((6, 2), (4, 4)):
        k, v = _cache(B=1, kvh=kvh, S=S)
        q = torch.randn(1, heads, T, 64)
        out = _kernel(q, k, v, mask)
        for t in range(T):
            alone = _kernel(q[:, :, t : t + 1], k, v, mask[:, :, t : t + 1])
            assert torch.equal(alone[:, 0], out[:, t]), (heads, t)
        assert torch.equal(out[0, 30], torch.zeros_like(out[0, 30]))


def test_threads_give_the_same_bits():
    """Threads split the (sequence, head) pairs: 1, 2 or 3 threads, the same bits."""
    torch.manual_seed(2)
    k, v = _cache(B=3, S=40)
    q, mask = torch.randn(3, 6, 5, 64), torch.rand(3, 1, 5, 40) > 0.3
    mask[..., 0] = True
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_kernel(q, k, v, mask))
    finally:
        torch.set_num_threads(before)
    assert outs[0] is not None and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_falls_back_to_sdpa_where_the_kernel_does_not_apply(fast_prefill):
    """bf16 takes torch's attention; so does a prefill chunk of more than 64 rows with fast prefill (only then)."""
    k, v = _cache(B=1)
    q = torch.randn(1, 6, 3, 64)
    assert _kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), None) is None
    assert _kernel(torch.randn(1, 6, 100, 64), k, v, None) is None  # a prefill chunk
    K.set_fast_prefill(False)
    assert _kernel(torch.randn(1, 6, 100, 64), k, v, None) is not None
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert out.shape == (1, 3, 6, 64) and out.dtype == torch.bfloat16


def test_training_gets_gradients_through_attention():
    """The C kernel has no backward: a forward that needs gradients takes torch's attention (a few rows too)."""
    q = torch.randn(1, 4, 3, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 3, 16, requires_grad=True), torch.randn(1, 2, 3, 16)
    attention(q, k, v, None).sum().backward()
    assert q.grad is not None and k.grad is not None and q.grad.abs().sum() > 0
