"""GGUF block kernels (specdec/runtime/kernels/ggml_q.c) against an fp64 reference.

Weights: Q8_0, Q5_0 and Q4_1 from `gguf.quants.quantize`; Q4_K, Q6_K and MXFP4 (which the gguf package cannot
quantize) as random valid blocks. The reference dequantizer is `gguf.quants.dequantize`.

Error bound. The kernels quantize each activation row to int8 per group of G inputs (G = 256 for
the K-quants, 32 for Q8_0/Q5_0/Q4_1) with scale amax/127, so each input carries a rounding error of at
most amax/254, uniformly spread: rms amax/(127*sqrt(12)), about 0.8% of a Gaussian row's rms for
G = 256 (amax ~ 3.4 sigma) and 0.6% for G = 32. With weights uncorrelated to that noise the relative
error of a dot product is the same ~0.8%, so:
  * against the exact product x @ W^T (fp64): relative error (Frobenius, over the whole output) < 2e-2;
  * against x_q @ W^T, where x_q is x after the same int8 rounding reproduced in numpy: < 1e-4 (only
    fp32 accumulation is left), which pins down the integer arithmetic exactly.
Every instruction-set path is tested (a path the CPU lacks is lowered to the best it has, so these run on
any x86 CPU, and the scalar path anywhere).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from specdec.runtime import kernels as K
from specdec.runtime.gguf_linear import GGUFConcatLinear, GGUFLinear, for_this_cpu

gguf = pytest.importorskip("gguf")

ROWS = (1, 2, 5, 17, 64, 200)
SIZES = {
    "Q4_K": (256, 1536, 8960),
    "Q6_K": (256, 1536, 8960),
    "Q5_0": (896, 1536, 96),
    "Q8_0": (896, 1536, 8960),
    "Q4_1": (576, 1536, 96),
    "MXFP4": (2880, 1536, 96),
}
OUT = 37  # odd: exercises a last, partial task of outputs


def random_blocks(qtype: int, out: int, inp: int, rng) -> np.ndarray:
    if qtype in (K.Q8_0, K.Q5_0, K.Q4_1):
        w = rng.standard_normal((out, inp)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).reshape(out, -1)
    be, bb = K.BLOCK[qtype]
    nb = out * inp // be
    b = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)  # any bytes are valid nibbles / scales
    if qtype == K.MXFP4:
        b[:, 0] = rng.integers(118, 124, nb)  # e8m0 scales 2^-10 .. 2^-5: weights of a trained layer's size
        b[:6, 0] = [0, 1, 2, 3, 104, 110]  # and small ones: e < 2 is subnormal
        return b.reshape(out, -1)
    half = lambda: (rng.uniform(0.5, 1.5, (nb, 1)) / 64).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == K.Q4_K:
        b[:, 0:2], b[:, 2:4] = half(), half()  # d, dmin
    else:
        b[:, 208:210] = half()  # d
    return b.reshape(out, -1)


def x16_paths() -> list[str]:
    """The x16 kernels this CPU runs: AVX2; AVX-512 without VNNI ('avx512bw'), with it, with AMX, where it has them."""
    return [p for p in ("avx2", "avx512bw", "avx512", "amx") if K.PATHS[p] <= K.PATHS[K.best_path()]]


def int8_rows(x: np.ndarray, group: int) -> np.ndarray:
    """x after the kernels' activation quantization (int8 per `group` inputs, scale amax/127), in float64."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, group)
    amax = np.abs(g).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(g * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.fixture(scope="module")
def lib():
    if K.library() is None:
        pytest.skip(f"kernel library not built here: {K.build_error}")
    return K.library()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def need_path(path: str) -> None:
    """Skip a test of kernel path `path` where this CPU lacks it: it would test a lower path under the higher name."""
    best = K.library().gq_best_path()
    if K.PATHS[path] > best:
        pytest.skip(f"this CPU has no {path} (best: {K.PATH_NAMES[best]})")


@pytest.mark.parametrize("name", list(K.TYPES))
def test_dequantize_matches_gguf(name, lib):
    rng = np.random.default_rng(1)
    qt = K.TYPES[name]
    inp = SIZES[name][1]
    blocks = random_blocks(qt, OUT, inp, rng)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qt)).reshape(OUT, inp)
    lin = GGUFLinear.from_blocks(blocks, name, (OUT, inp))
    assert np.array_equal(lin.dequantize(torch.float32).numpy(), ref)
    assert torch.equal(lin.dequantize(torch.bfloat16), torch.from_numpy(ref).to(torch.bfloat16))
    assert np.array_equal(lin.dequantize(torch.float32, slice(5, 20)).numpy(), ref[5:20])


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512bw", "avx512", "amx"])
@pytest.mark.parametrize("name", list(K.TYPES))
def test_kernel_matches_reference(name, path, lib):
    need_path(path)
    rng = np.random.default_rng(zlib.crc32(f"{name}{path}".encode()))
    qt = K.TYPES[name]
    group = K.BLOCK[qt][0]
    for inp in SIZES[name]:
        blocks = random_blocks(qt, OUT, inp, rng)
        w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qt))).reshape(OUT, inp).double()
        lin = GGUFLinear.from_blocks(blocks, name, (OUT, inp))
        for rows in ROWS:
            if path == "scalar" and rows * inp > 64 * 1536:
                continue  # scalar: keep the test fast
            x = rng.standard_normal((rows, inp)).astype(np.float32)
            y = lin._kernel(torch.from_numpy(x), K.PATHS[path])
            assert y is not None and y.dtype == torch.float32 and y.shape == (rows, OUT)
            assert K.PATHS[lin.last_path] <= K.PATHS[path]  # never a path above the one asked for
            exact = torch.from_numpy(x).double() @ w.T  # torch: numpy's fp64 GEMM was slow at 2-17 rows here
            quant = torch.from_numpy(int8_rows(x, group)) @ w.T
            assert rel(y, exact) < 2e-2, (name, path, inp, rows)
            assert rel(y, quant) < 1e-4, (name, path, inp, rows)


def test_paths_agree_and_best_path_is_used(lib):
    rng = np.random.default_rng(3)
    blocks = random_blocks(K.Q4_K, 64, 1536, rng)
    lin = GGUFLinear.from_blocks(blocks, "Q4_K", (64, 1536))
    x = torch.randn(9, 1536)
    ys = {p: lin._kernel(x, K.PATHS[p]) for p in ("scalar", "avx2", "avx512bw", "avx512", "amx")}
    for p, y in ys.items():
        assert torch.allclose(y, ys["scalar"], rtol=1e-4, atol=1e-4 * float(ys["scalar"].abs().max())), p
    lin._kernel(x, K.requested_path())  # as a forward asks: the best path, or the one SPECDEC_KERNEL_PATH caps it at
    assert lin.last_path == K.best_path()


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512bw", "avx512", "amx"])
def test_parts_in_one_call_equal_each_part(path, lib, monkeypatch):
    """A fused projection of mixed block types (q/k/v with v in Q6_K): one kernel call for all parts gives each
    part's own result, side by side, bias included, at 1 to 600 rows."""
    need_path(path)
    monkeypatch.setenv("SPECDEC_KERNEL_PATH", path)
    rng = np.random.default_rng(7)
    parts = [
        GGUFLinear.from_blocks(random_blocks(qt, out, 512, rng), qt, (out, 512), bias=torch.randn(out))
        for qt, out in ((K.Q4_K, 40), (K.Q8_0, 24), (K.Q6_K, 24), (K.Q5_0, 8), (K.Q4_1, 16))
    ]
    cat = GGUFConcatLinear(parts)
    for rows in (1, 3, 40, 600):
        x = torch.randn(1, rows, 512)
        y = cat(x)
        ref = torch.cat([p(x) for p in parts], dim=-1)
        assert y.shape == (1, rows, 112)
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), rows
        assert cat.last_path == K.best_path()


@pytest.mark.parametrize("name", list(K.TYPES))
def test_x16_layout_is_the_same_weight(name, lib):
    """Repacked 16 outputs at a time: the same values (dequantized exactly equal, any row range), and the AVX-512
    kernel on it equals the reference at 1 to 200 rows; other paths refuse the layout (None), never misread it."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    qt = K.TYPES[name]
    for out, inp in ((48, 256), (32, 1536), (16, 8960)):
        blocks = random_blocks(qt, out, inp, rng)
        lin = GGUFLinear.from_blocks(blocks, name, (out, inp))
        x16 = lin.repacked()
        assert x16.qtype == qt + K.X16 and x16.type_name == f"{name} x16"
        assert torch.equal(x16.dequantize(torch.float32), lin.dequantize(torch.float32))
        assert torch.equal(x16.dequantize(torch.float32, slice(5, 21)), lin.dequantize(torch.float32, slice(5, 21)))
        assert torch.equal(x16.dequantize(torch.float16, slice(3, 4)), lin.dequantize(torch.float32)[3:4].half())
        w = lin.dequantize(torch.float64)
        for rows in ROWS:
            x = rng.standard_normal((rows, inp)).astype(np.float32)
            if not K.runs_x16():
                assert x16._kernel(torch.from_numpy(x)) is None
                continue
            quant = torch.from_numpy(int8_rows(x, K.BLOCK[qt][0])) @ w.T
            for path in x16_paths():
                y = x16._kernel(torch.from_numpy(x), K.PATHS[path])
                assert x16.last_path == path
                assert rel(y, quant) < 1e-4, (name, path, out, inp, rows)
        assert x16._kernel(torch.randn(2, inp), K.PATHS["scalar"]) is None
    lin = GGUFLinear.from_blocks(random_blocks(qt, 40, 256, rng), name, (40, 256))
    assert for_this_cpu(lin) is lin  # 40 outputs: not a multiple of 16, kept as is
    if K.runs_x16():
        assert (
            for_this_cpu(GGUFLinear.from_blocks(random_blocks(qt, 32, 256, rng), name, (32, 256))).qtype == qt + K.X16
        )


@pytest.mark.parametrize("name", list(K.TYPES))
def test_x16_row_is_the_same_bits_at_any_row_count(name, lib):
    """Decode (1 row) and verification (2 to 40 rows) give every row the same bits: greedy speculative decoding can
    then equal plain decoding exactly on a quantized target. The row counts cover each size of the AVX2 kernel's
    last row tile (1-4 rows), both sides of the row count from which it unpacks Q4_K first (16), and prefill-sized
    calls (150 rows: three tiles of up to 64 rows, in two groups of up to 128: ggml_q.c ROW_GROUP); up to 7 rows of
    8960 inputs walk each output group's input chunks in turn, more walk each chunk over the groups (gq_task)."""
    if not K.runs_x16():
        pytest.skip("the x16 layout runs on AVX2 and AVX-512 only")
    rng = np.random.default_rng(9)
    x16 = GGUFLinear.from_blocks(random_blocks(K.TYPES[name], 96, 8960, rng), name, (96, 8960)).repacked()
    x = torch.randn(150, 8960)
    for path in x16_paths():
        alone = torch.cat([x16._kernel(x[i : i + 1], K.PATHS[path]) for i in range(150)])
        for rows in (2, 3, 5, 7, 15, 16, 17, 40, 150):
            assert torch.equal(x16._kernel(x[:rows], K.PATHS[path]), alone[:rows]), (path, rows)


@pytest.mark.parametrize("name", list(K.TYPES))
def test_file_layout_row_is_the_same_bits_at_any_row_count(name, lib):
    """The file's layout (what a matrix of 100 outputs keeps: no x16 groups) on every path this CPU runs: a row's
    result does not depend on the rows beside it either, so a vocabulary that is not a multiple of 16 still gives a
    token the same logits decoded alone, verified or prefilled."""
    rng = np.random.default_rng(10)
    lin = GGUFLinear.from_blocks(random_blocks(K.TYPES[name], 100, 2048, rng), name, (100, 2048))
    x = torch.randn(70, 2048)
    for path in ("scalar", *x16_paths()):
        alone = torch.cat([lin._kernel(x[i : i + 1], K.PATHS[path]) for i in range(70)])
        for rows in (2, 3, 5, 16, 70):
            assert torch.equal(lin._kernel(x[:rows], K.PATHS[path]), alone[:rows]), (path, rows)


@pytest.mark.parametrize("name", list(K.TYPES))
def test_threads_give_the_same_bits(name, lib):
    """Threads split the outputs, never a sum: 1, 2 or 3 threads give the same bits on every layout and path (the
    suite's workers run one thread each, so the threaded code is tested here)."""
    rng = np.random.default_rng(4)
    lin = GGUFLinear.from_blocks(random_blocks(K.TYPES[name], 48, 1024, rng), name, (48, 1024))
    layouts = [(lin, ["scalar", K.best_path()])] + [(lin.repacked(), x16_paths())] * K.runs_x16()
    x, before = torch.randn(33, 1024), torch.get_num_threads()
    try:
        for layer, paths in layouts:
            for path in paths:
                outs = []
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    outs.append(torch.cat([layer._kernel(x[:1], K.PATHS[path]), layer._kernel(x, K.PATHS[path])]))
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (path, layer.qtype)
    finally:
        torch.set_num_threads(before)


def test_forward_shapes_dtypes_bias_and_prefill(lib, fast_prefill):
    rng = np.random.default_rng(4)
    blocks = random_blocks(K.Q6_K, 48, 512, rng)
    bias = torch.randn(48)
    lin = GGUFLinear.from_blocks(blocks, "Q6_K", (48, 512), bias=bias)
    w = lin.dequantize(torch.float64)
    for shape in ((3, 512), (2, 5, 512), (1, 600, 512)):  # 600 rows: fast prefill's dequantize + matmul
        x = torch.randn(*shape)
        ref = x.double() @ w.T + bias.double()
        for dtype, tol in ((torch.float32, 2e-2), (torch.bfloat16, 3e-2)):
            y = lin(x.to(dtype))
            assert y.dtype == dtype and y.shape == (*shape[:-1], 48)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol
    lin(torch.randn(600, 512))
    assert lin.last_path == "dequant"
    lin(torch.randn(4, 512))
    assert lin.last_path == K.best_path()
    K.set_fast_prefill(False)  # the default: the kernels at any row count
    lin(torch.randn(600, 512))
    assert lin.last_path == K.best_path()


def test_kernel_reads_only_its_rows(lib):
    """A weight that is a row slice of a bigger buffer (as a file's memory map would give) is used in place."""
    rng = np.random.default_rng(5)
    big = torch.from_numpy(random_blocks(K.Q8_0, 10, 256, rng))
    lin = GGUFLinear.from_blocks(big[3:7], "Q8_0", (4, 256))
    assert lin.qweight.data_ptr() == big[3:7].data_ptr()
    x = torch.randn(2, 256)
    w = gguf.quants.dequantize(big[3:7].numpy(), gguf.GGMLQuantizationType.Q8_0)
    ref = x.double() @ torch.from_numpy(w).double().T
    assert ((lin(x).double() - ref).norm() / ref.norm()).item() < 2e-2


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        GGUFLinear(torch.zeros(4, 100, dtype=torch.uint8), K.Q4_K, 256, 4)  # 144 bytes per 256 inputs
    with pytest.raises(ValueError):
        GGUFLinear(torch.zeros(4, 144, dtype=torch.uint8), K.Q4_K, 250, 4)  # not a multiple of 256
    with pytest.raises(ValueError):
        GGUFLinear(torch.zeros(4, 18, dtype=torch.uint8), 2, 32, 4)  # Q4_0: not supported


def test_no_compiler_falls_back(monkeypatch, tmp_path, capsys):
    """No working compiler: one warning line, no crash, and forward still right (dequantize + matmul)."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a 'compiler' that always fails
    monkeypatch.setattr(K, "_compiler", lambda: "false")
    K._reset()
    try:
        assert K.library() is None and K.best_path() == "none"
        assert "unavailable" in capsys.readouterr().err
        rng = np.random.default_rng(6)
        blocks = random_blocks(K.Q5_0, 8, 64, rng)
        lin = GGUFLinear.from_blocks(blocks, "Q5_0", (8, 64))
        x = torch.randn(3, 64)
        w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_0).reshape(8, 64)
        assert rel(lin(x), x.double() @ torch.from_numpy(w).double().T) < 1e-2  # bf16 where the CPU has it
        assert lin.last_path == "dequant"
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        K._reset()


def test_build_is_keyed_by_cpu(monkeypatch, tmp_path):
    cc = K._compiler()
    if cc is None:
        pytest.skip("no compiler")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    a = K.lib_path(cc)
    monkeypatch.setattr(K, "_cpu_signature", lambda: "another cpu")
    assert K.lib_path(cc) != a and K.lib_path(cc).parent == tmp_path / "kernels"


def _tiny_gguf(path, tied: bool, rng) -> None:
    """A 2-layer qwen2 GGUF mixing the four block types (q/k Q4_K with v Q6_K: a fused q/k/v of two types)."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    H, F, V, L = 256, 512, 300, 2
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)

    def q(name, kind, out, inp):
        qt = K.TYPES[kind]
        w.add_tensor(name, random_blocks(qt, out, inp, rng), raw_dtype=gguf.GGMLQuantizationType(qt))

    def f(name, n, scale=0.1, base=0.0):
        w.add_tensor(name, (base + scale * rng.standard_normal(n)).astype(np.float32))

    q("token_embd.weight", "Q8_0", V, H)
    for i in range(L):
        p = f"blk.{i}."
        f(p + "attn_norm.weight", H, base=1.0)
        f(p + "ffn_norm.weight", H, base=1.0)
        q(p + "attn_q.weight", "Q4_K", H, H)
        q(p + "attn_k.weight", "Q4_K", 128, H)
        q(p + "attn_v.weight", "Q6_K", 128, H)
        for b, n in (("attn_q.bias", H), ("attn_k.bias", 128), ("attn_v.bias", 128)):
            f(p + b, n)
        q(p + "attn_output.weight", "Q5_0", H, H)
        q(p + "ffn_gate.weight", "Q4_K", F, H)
        q(p + "ffn_up.weight", "Q4_K", F, H)
        q(p + "ffn_down.weight", "Q6_K", H, F)
    f("output_norm.weight", H, base=1.0)
    if not tied:
        q("output.weight", "Q8_0", V, H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True])
def test_model_from_gguf_blocks_matches_dequantized_model(tmp_path, lib, tied):
    """quantize_from_gguf: the model computing from the file's blocks against the same file dequantized to
    fp32 (what the checkpoint conversion gives): close logits, and where the greedy tokens differ (a random
    model has near-ties) the quantized model's choice is within 3% of the logit range of the best."""
    from specdec.models.gguf_convert import _dequantize, config_from_gguf, hf_names, open_gguf
    from specdec.models.gguf_quantized import GGUFEmbedding, quantize_from_gguf
    from specdec.models.transformer import Transformer, fuse_projections
    from specdec.runtime.kv_cache import KVCache

    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, tied, np.random.default_rng(7))
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    assert cfg.tie_word_embeddings == tied
    with torch.device("meta"):
        qm, dm = Transformer(cfg), Transformer(cfg)
    quantize_from_gguf(qm, path, torch.float32, reader)
    assert isinstance(qm.model.embed_tokens, GGUFEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in qm.modules())  # every projection kept as blocks
    names = hf_names(reader, cfg)
    state = fuse_projections(
        {names[t.name]: torch.from_numpy(_dequantize(t, cfg)) for t in reader.tensors}, cfg.num_layers
    )
    if tied:
        state.pop("lm_head.weight", None)
    dm.load_state_dict(state, strict=False, assign=True)
    if tied:
        dm.lm_head.weight = dm.model.embed_tokens.weight
    tokens = torch.from_numpy(np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 12)))
    pos = torch.arange(12)[None]
    outs = []
    for m in (qm, dm):
        cache = KVCache.allocate(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32)
        logits, _ = m(tokens[:, :8], pos[:, :8], torch.tensor([0]), cache)  # prefill
        steps = [
            m(tokens[:, i : i + 1], pos[:, i : i + 1], torch.tensor([0]), cache)[0] for i in range(8, 12)
        ]  # decode
        outs.append(torch.cat([logits, *steps], 1))
    lq, ld = outs
    assert ((lq - ld).norm() / ld.norm()).item() < 5e-2
    pick = ld.gather(-1, lq.argmax(-1, keepdim=True))[..., 0]
    best, span = ld.amax(-1), ld.amax(-1) - ld.amin(-1)
    assert bool((pick >= best - 0.03 * span).all())
    assert (lq.argmax(-1) == ld.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("name", list(K.TYPES))
def test_transposed_bf16_dequantize_is_the_same_weight(name, lib, fast_prefill):
    """The prefill's dequantize + bf16 matmul reads x16 blocks transposed ([in, out], gq_dequantize_t, AVX512-BF16
    with VBMI): the same bf16 values as the row-major dequantization, for all rows and for a chunk of them; the
    product equals the one through the row-major weight's transpose. vcvtneps2bf16 flushes subnormal floats to zero
    (|w| < 2^-126: only MXFP4's smallest scales make them)."""
    rng = np.random.default_rng(11)
    lin = GGUFLinear.from_blocks(random_blocks(K.TYPES[name], 96, 1536, rng), name, (96, 1536)).repacked()
    buf = torch.empty(96 * 1536, dtype=torch.bfloat16)
    if lib.gq_dequantize_t(lin.qtype, lin.qweight.data_ptr(), 1536, 0, 96, buf.data_ptr(), 96, 2) != 0:
        pytest.skip("no AVX512-BF16 + VBMI here: the row-major dequantization serves")
    ref = lin.dequantize(torch.bfloat16)
    ref = torch.where(ref.float().abs() < 2.0**-126, 0, ref)
    assert torch.equal(lin._dequantize_into(buf, 0, 96), ref.T)
    assert torch.equal(lin._dequantize_into(buf[: 32 * 1536], 48, 80), ref[48:80].T)
    x = torch.randn(300, 1536)
    assert torch.allclose(lin._dequant_matmul(x), (x.bfloat16() @ ref.T).float(), rtol=1e-2, atol=1e-2)


def test_fused_parts_above_the_kernel_rows_share_one_matmul(lib, fast_prefill):
    """Above the kernel rows, x16 parts are dequantized side by side into one buffer for one bf16 matmul
    (where this CPU writes them transposed): the parts' own results, biases included."""
    rng = np.random.default_rng(12)
    parts = [
        GGUFLinear.from_blocks(random_blocks(qt, out, 512, rng), qt, (out, 512), bias=torch.randn(out)).repacked()
        for qt, out in ((K.Q4_K, 64), (K.Q6_K, 32), (K.Q4_K, 96), (K.Q5_0, 32), (K.Q8_0, 64))
    ]
    cat = GGUFConcatLinear(parts)
    x = torch.randn(600, 512)
    if cat._dequant_matmul(x) is None:
        pytest.skip("no transposed bf16 dequantization here: each part runs alone")
    y, ref = cat(x), torch.cat([p(x) for p in parts], dim=-1)
    assert cat.last_path == "dequant" and y.shape == (600, 288)
    assert torch.allclose(y, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
