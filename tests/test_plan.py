"""`specdec plan`: sizes against real files and the runtime's own allocations, placement, the speculative
formula, exports and clear errors for bad input."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.plan import PlanInputs, make_plan
from specdec.plan.export import export
from specdec.plan.memory import Format, model_memory
from specdec.plan.report import render
from specdec.plan.specs import load_spec, read_checkpoint, read_config, read_gguf
from specdec.plan.speed import best_k, break_even_alpha, expected_tokens, speedup
from specdec.plan.units import parse_bandwidth, parse_size
from specdec.runtime import kernels as K
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.placement import ALL_LAYERS, offload_notice, place_layers

GiB = 2**30


def write_gguf(path, qtype="Q8_0", layers=2, hidden=64, heads=4, kv_heads=2, ff=128, vocab=96, ctx=256, tied=True):
    """A small llama-architecture GGUF with real quantized blocks (and a tokenizer string array)."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(ctx)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])

    def mat(name, rows, cols):
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)

    hd = hidden // heads
    mat("token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        mat(f"blk.{i}.attn_q.weight", heads * hd, hidden)
        mat(f"blk.{i}.attn_k.weight", kv_heads * hd, hidden)
        mat(f"blk.{i}.attn_v.weight", kv_heads * hd, hidden)
        mat(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        mat(f"blk.{i}.ffn_gate.weight", ff, hidden)
        mat(f"blk.{i}.ffn_up.weight", ff, hidden)
        mat(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        mat("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def plan(**kw):
    kw.setdefault("gpu", "none")
    kw.setdefault("ram", "16GiB")
    return make_plan(PlanInputs(**kw))


def cli(capsys, *args):
    try:
        rc = main(["plan", *args])
    except SystemExit as e:  # argparse errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def held_bytes(model) -> int:
    """Bytes of a loaded model's tensors (parameters and buffers, each once)."""
    seen = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def one_line_error(rc, err, needle):
    assert rc != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and needle in lines[0], lines[0]


# ------------------------------------------------------------------ the speculative formula


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens(0.8, 4))
    assert speedup(0.8, 4, 0.25) == pytest.approx(expected_tokens(0.8, 4) / 2)


def test_break_even_and_when_a_draft_stops_paying():
    # at k=1: (1 + a) / (1 + c) = 1  <=>  a = c
    assert break_even_alpha(0.3, 1) == pytest.approx(0.3, abs=1e-9)
    assert speedup(break_even_alpha(0.2, 5), 5, 0.2) == pytest.approx(1.0, abs=1e-9)
    # a draft costing 40% of a target step never pays below ~40% acceptance, at any length
    assert all(speedup(0.35, k, 0.4) < 1 for k in range(1, 17))
    k, g = best_k(0.9, 0.05, 16)
    assert g > best_k(0.6, 0.05, 16)[1] and k > best_k(0.6, 0.05, 16)[0]


# ------------------------------------------------------------------ units


@pytest.mark.parametrize(
    "text,value",
    [("24GiB", 24 * GiB), ("16GB", 16 * 10**9), ("512MiB", 512 * 2**20), ("1.5", int(1.5 * GiB)), ("2t", 2 * 10**12)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["-1", "abc", "0", "12XB", "", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(SpecdecError):
        parse_size(text, "--gpu-mem")


def test_parse_bandwidth():
    assert parse_bandwidth("936GB/s") == 936e9
    assert parse_bandwidth("64") == 64e9
    with pytest.raises(SpecdecError):
        parse_bandwidth("-5GB/s")


# ------------------------------------------------------------------ placement (no GPU needed)


def test_placement_specdec_first_layers():
    p = place_layers(10, 0)
    assert p.layers == ("cpu",) * 10 and p.embed == p.head == "cpu" and p.crossings == 0 and not p.on_gpu
    p = place_layers(10, 4)
    assert p.gpu_layers == [0, 1, 2, 3] and p.embed == "gpu" and p.head == "cpu" and p.crossings == 1
    p = place_layers(10, 10)
    assert p.gpu_layers == list(range(10)) and p.head == "gpu" and p.crossings == 0
    assert place_layers(10, ALL_LAYERS) == p
    devs = place_layers(3, 2).module_devices()
    assert devs == {
        "model.embed_tokens": "cuda:0",
        "model.layers.0": "cuda:0",
        "model.layers.1": "cuda:0",
        "model.layers.2": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }


def test_placement_llama_cpp_last_layers():
    p = place_layers(10, 4, "llama.cpp")
    assert p.gpu_layers == [6, 7, 8, 9] and p.embed == "cpu" and p.head == "cpu" and p.crossings == 2
    p = place_layers(10, 10, "llama.cpp")
    assert p.gpu_layers == list(range(10)) and p.head == "cpu"
    p = place_layers(10, 11, "llama.cpp")
    assert p.head == "gpu" and p.embed == "cpu" and p.crossings == 1


def test_placement_rejects():
    with pytest.raises(ValueError):
        place_layers(10, -1)
    with pytest.raises(ValueError):
        place_layers(0, 1)
    with pytest.raises(ValueError):
        place_layers(4, 1, "vllm")


def test_offload_notice():
    assert offload_notice(None, None, cuda=False) is None
    assert offload_notice(0, None, cuda=False) is None
    assert "ignored: no CUDA" in offload_notice(20, None, cuda=False)
    assert "ignored: no CUDA" in offload_notice(None, 5, cuda=False)
    assert "on the GPU" in offload_notice(20, 5, cuda=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_generate_accepts_ngl_without_gpu(tiny_dir):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "generate",
            "-m",
            str(tiny_dir("qwen2")),
            "-p",
            "t1 t2 t3",
            "-n",
            "2",
            "--dtype",
            "fp32",
            "-ngl",
            "99",
            "-ngld",
            "all",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "specdec: -ngl/-ngld ignored: no CUDA device" in res.stderr
    assert json.loads(res.stdout)["stats"]["new_tokens"] >= 1


# ------------------------------------------------------------------ sizes against the runtime (exact)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # llama: tied embeddings
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kv_bytes_equal_runtime_allocation(tiny_dir, family, dtype):
    from specdec.models.loader import DTYPES, load_checkpoint
    from specdec.runtime.runner import HEADROOM, ModelRunner

    d = tiny_dir(family)
    for ctx, slots in ((100, 1), (200, 3)):
        p = plan(model=str(d), dtype=dtype, context=ctx, slots=slots)
        model, _ = load_checkpoint(d, DTYPES[dtype])
        cfg = model.config
        runner = ModelRunner(model, num_slots=slots, context=ctx)
        assert p.target.kv == runner.cache.nbytes()
        assert (
            p.target.kv
            == KVCache.allocate(
                cfg.num_layers, slots, cfg.num_kv_heads, ctx + HEADROOM, cfg.head_dim, DTYPES[dtype]
            ).nbytes()
        )
        assert p.target.kv_rows == ctx + HEADROOM


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])  # llama: tied embeddings
@pytest.mark.parametrize("quant", ["int8", "int4", "none"])
def test_weight_bytes_equal_loaded_model(tiny_dir, family, quant):
    """Runtime format: params x dtype bytes; a quantized draft: exactly what `quantize_` leaves."""
    from specdec.models.loader import load_checkpoint
    from specdec.runtime.quant import quantize_

    d = tiny_dir(family)
    model, _ = load_checkpoint(d, torch.bfloat16)
    p = plan(model=str(d), draft=str(d), dtype="bf16", context=64, spec_type="draft", draft_quant=quant)
    assert p.target.weights == held_bytes(model)
    assert p.draft is not None and p.draft.fmt.quant == quant
    quantize_(model, quant)
    assert p.draft.weights == held_bytes(model)


def test_config_json_matches_checkpoint_tensors(tiny_dir):
    for family in ("qwen2", "llama", "qwen3"):
        d = tiny_dir(family)
        ck, cf = read_checkpoint(d), read_config(d / "config.json")
        assert {t.name: t.n_elements for t in ck.tensors} == {t.name: t.n_elements for t in cf.tensors}
        assert ck.dims == cf.dims


# ------------------------------------------------------------------ GGUF


def test_gguf_tensor_sizes_match_gguf_reader(tmp_path):
    import gguf

    for qtype in ("Q8_0", "Q4_0", "F32"):
        path = write_gguf(tmp_path / f"m-{qtype}.gguf", qtype=qtype, tied=qtype != "Q4_0")
        spec = read_gguf(path)
        ref = gguf.GGUFReader(path)
        assert [(t.name, t.file_type, t.file_bytes) for t in spec.tensors] == [
            (t.name, t.tensor_type.name, int(t.n_bytes)) for t in ref.tensors
        ]
        assert spec.dims.num_layers == 2 and spec.dims.vocab == 96 and spec.dims.tied == (qtype != "Q4_0")
        # the numpy views gguf's reader makes (what opening the file costs the runtime's loader)
        assert spec.reader_parts == sum(len(f.parts) for f in ref.fields.values()) + sum(
            len(t.field.parts) for t in ref.tensors
        )
        p = plan(model=str(path), dtype="file", context=128)
        assert p.target.weights == spec.file_bytes == sum(int(t.n_bytes) for t in ref.tensors)
        # KV in llama.cpp's layout: layers x kv_heads x (k + v dims) x context x f16
        assert p.target.kv == 2 * 2 * (16 + 16) * 128 * 2


@pytest.mark.real
def test_real_gguf_weight_bytes_are_the_files_tensor_sizes(smollm_dir):
    """The plan's weights equal the sum of the GGUF's tensor sizes, and those sizes tile the file's data section."""
    import gguf

    from specdec.models.packs import gguf_path

    path = gguf_path("smollm2-135m")
    spec = read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert [(t.name, t.file_type, t.file_bytes) for t in spec.tensors] == [
        (t.name, t.tensor_type.name, int(t.n_bytes)) for t in ref.tensors
    ]
    align = 32
    ends = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in ref.tensors)
    for (_, end), (start, _) in zip(ends, ends[1:]):
        assert 0 <= start - end < align  # only alignment padding between tensors
    assert path.stat().st_size - ends[-1][1] < align
    assert sum(e - s for s, e in ends) == spec.file_bytes
    p = plan(model="smollm2-135m", dtype="file", context=2048)
    assert p.target.weights == spec.file_bytes
    assert spec.type_summary().startswith("Q4_1")


@pytest.mark.real
def test_real_pack_kv_and_weights_equal_runtime(smollm_dir):
    from specdec.models.loader import load_checkpoint
    from specdec.runtime.runner import ModelRunner

    model, _ = load_checkpoint(smollm_dir, torch.bfloat16)
    runner = ModelRunner(model, num_slots=2, context=1000)
    p = plan(model="smollm2-135m", dtype="bf16", quant="none", context=1000, slots=2)
    assert p.target.kv == runner.cache.nbytes()
    held = {id(t): t for t in model.parameters()}
    assert p.target.weights == sum(t.numel() * t.element_size() for t in held.values())


# ------------------------------------------------------------------ specdec's gguf runtime (exact)


def write_mixed_gguf(path, tied=False):
    """A 2-layer qwen2 GGUF with every case the gguf runtime tells apart: Q4_K matrices (x16: 148 bytes per 256
    weights instead of 144), Q6_K/Q5_0/Q8_0 (the same size), a Q4_K table of 300 rows (not 16-row groups: kept
    as stored), a q/k/v with an F16 part (dense as a whole), q/k/v biases (a quantized q/k/v holds them twice)."""
    import gguf
    from test_gguf_kernels import random_blocks

    rng = np.random.default_rng(3)
    H, F, V = 256, 512, 300
    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, v in (
        (w.add_block_count, 2),
        (w.add_context_length, 256),
        (w.add_embedding_length, H),
        (w.add_feed_forward_length, F),
        (w.add_head_count, 4),
        (w.add_head_count_kv, 2),
        (w.add_rope_freq_base, 1e4),
        (w.add_layer_norm_rms_eps, 1e-6),
    ):
        add(v)

    def q(name, kind, out, inp):
        if kind == "F16":
            w.add_tensor(name, rng.standard_normal((out, inp)).astype(np.float16))
        else:
            w.add_tensor(name, random_blocks(K.TYPES[kind], out, inp, rng), raw_dtype=gguf.GGMLQuantizationType[kind])

    q("token_embd.weight", "Q4_K", V, H)
    for i, (qkv, o, gate_up, down) in enumerate(
        (
            (("Q4_K", "Q4_K", "Q6_K"), "Q5_0", ("Q4_K", "Q4_K"), "Q6_K"),
            (("Q8_0", "Q4_K", "F16"), "Q8_0", ("Q4_K", "Q8_0"), "Q5_0"),
        )
    ):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", np.ones(H, np.float32))
        for part, kind, out in zip(("attn_q", "attn_k", "attn_v"), qkv, (H, 128, 128)):
            q(p + part + ".weight", kind, out, H)
            w.add_tensor(p + part + ".bias", rng.standard_normal(out).astype(np.float32))
        q(p + "attn_output.weight", o, H, H)
        for part, kind in zip(("ffn_gate", "ffn_up"), gate_up):
            q(p + part + ".weight", kind, F, H)
        q(p + "ffn_down.weight", down, H, F)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    if not tied:
        q("output.weight", "Q6_K", V, H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_runtime_bytes(ref, x16: bool) -> int:
    """The GGUF's tensor sizes (`ref`: the file opened by gguf.GGUFReader) as the gguf runtime holds them, worked out
    apart from the plan: kernel-type matrices as stored, Q4_K x 148/144 where repacked (x16, rows in 16-row groups);
    other tensors and fused groups with a part of another type dense in fp32; a quantized q/k/v's biases twice."""
    by = {t.name: t for t in ref.tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in by if n.startswith("blk."))
    dense, bias_copies = set(), 0
    for i in range(layers):
        for group in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")):
            names = [f"blk.{i}.{g}.weight" for g in group]
            if any(by[n].tensor_type.name not in K.TYPES for n in names):
                dense.update(names)
            else:
                bias_copies += sum(int(by[b].n_bytes) for g in group if (b := f"blk.{i}.{g}.bias") in by)
    total = 0
    for t in ref.tensors:
        rows = int(t.shape[1]) if len(t.shape) > 1 else 1  # GGUF shapes list the row length first
        if t.tensor_type.name in K.TYPES and rows > 1 and t.name not in dense:
            repacked = x16 and t.tensor_type.name == "Q4_K" and rows % 16 == 0
            total += int(t.n_bytes) // 144 * 148 if repacked else int(t.n_bytes)
        else:
            total += int(t.n_elements) * 4
    return total + bias_copies


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_runtime_weights_are_the_tensor_sizes_with_x16(tmp_path, tied):
    """--quant gguf: the plan's weights equal the GGUF's tensor sizes with the x16 adjustment, exactly, and
    what `quantize_from_gguf` holds on this CPU."""
    import gguf

    from specdec.models.gguf_convert import config_from_gguf, open_gguf
    from specdec.models.gguf_quantized import quantize_from_gguf
    from specdec.models.transformer import Transformer

    path = write_mixed_gguf(tmp_path / "mixed.gguf", tied)
    ref = gguf.GGUFReader(path)
    for x16 in (True, False):
        p = plan(model=str(path), context=64, x16=x16)
        assert p.target.fmt == Format("fp32", "F32", "gguf", x16)
        assert p.target.weights == gguf_runtime_bytes(ref, x16)
    assert gguf_runtime_bytes(ref, True) > gguf_runtime_bytes(ref, False)
    reader = open_gguf(path)
    with torch.device("meta"):
        model = Transformer(config_from_gguf(reader, path))
    quantize_from_gguf(model, path, torch.float32, reader)
    here = plan(model=str(path), context=64, x16=K.runs_x16())
    assert here.target.weights == held_bytes(model)
    assert any(
        "F16 matrices (and a q/k/v or gate/up they are fused with) are held dense in fp32" in n for n in here.notes
    )


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_layers_on_the_gpu_are_planned_dense(tmp_path, tied):
    """-ngl with the gguf runtime dequantizes what it places on the GPU to the compute dtype (`densify`: the kernels
    run on the CPU only), so the plan's GPU bytes for a layer, the embeddings and the head are what densify makes,
    not the file's blocks (it counted the blocks: a Q4_K layer 7x too small in fp32)."""
    from specdec.models.gguf_convert import config_from_gguf, open_gguf
    from specdec.models.gguf_quantized import densify, quantize_from_gguf
    from specdec.models.transformer import Transformer

    path = write_mixed_gguf(tmp_path / "mixed.gguf", tied)
    reader = open_gguf(path)
    with torch.device("meta"):
        model = Transformer(config_from_gguf(reader, path))
    quantize_from_gguf(model, path, torch.float32, reader)
    t = plan(model=str(path), context=64).target
    dense = [held_bytes(densify(layer, torch.float32)) for layer in model.model.layers]
    assert t.dense_gpu.layers == dense and dense[0] > 3 * t.layer_weights[0]
    assert t.dense_gpu.embed == held_bytes(densify(model.model.embed_tokens, torch.float32))
    head = held_bytes(densify(model.lm_head, torch.float32)) + held_bytes(model.model.norm)
    assert t.dense_gpu.head == head
    on_gpu = place_layers(len(dense), ALL_LAYERS)
    assert t.gpu_bytes(on_gpu) == sum(dense) + len(dense) * t.kv_layer + t.dense_gpu.embed + head + t.compute


def test_real_pack_gguf_runtime_weights(tmp_path):
    """The same on a real pack's GGUF (the default draft, all four kernel types), when it is cached."""
    import gguf

    from specdec.models import packs
    from specdec.models.gguf_quantized import load_gguf_quantized

    path = packs.gguf_path("qwen2.5-coder-0.5b")
    if not path.exists():
        pytest.skip("qwen2.5-coder-0.5b is not pulled")
    ref = gguf.GGUFReader(path)  # gguf's own reader, apart from specdec's (10 s for this vocabulary: opened once)
    for x16 in (True, False):
        assert plan(model=str(path), context=64, x16=x16).target.weights == gguf_runtime_bytes(ref, x16)
    model, _ = load_gguf_quantized(path, torch.float32)
    assert plan(model=str(path), context=64, x16=K.runs_x16()).target.weights == held_bytes(model)


def test_gguf_runtime_kv_and_rss_phases(tmp_path):
    """Loading holds the reader's objects, the weights and, at the end, a repacked tensor's file pages or the
    tokenizer; a token-embedding table left in the file's layout is a mapped view, only its looked-up rows read."""
    from specdec.plan.memory import GGUF_READER_PER_PART, SPECDEC_BASE, tokenizer_bytes

    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    p = plan(model=str(path), draft=str(path), context=100, spec_type="draft", x16=True)
    t = p.target
    assert t.kv == 2 * 2 * (64 + 64) * 101 * 4  # fp32 KV, context + HEADROOM rows
    in_rss = t.weights - t.embed  # the 300-row Q4_K table is not repacked (16-row groups): a view of the file
    assert p.rss.parts["target weights"] == in_rss
    largest_repacked = 512 * 256 // 256 * 144  # a 512 x 256 Q4_K gate/up: its file pages beside its copy
    loading = GGUF_READER_PER_PART * t.spec.reader_parts + in_rss + max(largest_repacked, tokenizer_bytes(t.spec))
    assert p.rss.phases["loading the target"] == SPECDEC_BASE + loading
    assert p.rss.phases["loading the draft"] == SPECDEC_BASE + in_rss + t.kv + tokenizer_bytes(t.spec) + loading
    assert p.rss.peak == max(p.rss.phases.values()) and "GGUF reader" in p.rss.load_note
    tied = plan(model=str(write_mixed_gguf(tmp_path / "tied.gguf", tied=True)), context=100, x16=True)
    assert tied.rss.parts["target weights"] == tied.target.weights  # the table is the LM head: read whole


def test_quant_flags_map_onto_generate(tmp_path, tiny_dir, capsys):
    """--quant/--draft-quant resolve as generate's; --dtype file (or a llama.cpp/Ollama export) plans llama.cpp."""
    g = write_mixed_gguf(tmp_path / "m.gguf")
    ck = tiny_dir("qwen2")
    p = plan(model=str(g), draft=str(ck), spec_type="draft", x16=True)
    assert (p.target.fmt.quant, p.draft.fmt.quant) == ("gguf", "none")  # auto: GGUF file / checkpoint directory
    assert p.target.fmt.path == "gguf kernels, x16 layout, fp32 compute"
    assert plan(model=str(g), draft=str(g), draft_quant="int4", spec_type="draft").draft.fmt.quant == "int4"
    assert plan(model=str(ck / "config.json")).target.fmt.quant == "none"
    assert plan(model=str(g), export="llama.cpp").target.fmt == Format("file", "F16")
    assert plan(model=str(g), cpu="cpu-ddr5-12ch").target.fmt.x16
    with pytest.raises(SpecdecError, match="--quant gguf needs a GGUF file or a model pack"):
        plan(model=str(ck), quant="gguf")
    with pytest.raises(SpecdecError, match="--dtype file plans the file as llama.cpp loads it"):
        plan(model=str(g), dtype="file", draft_quant="int8")
    rc, out, _ = cli(capsys, "-m", str(g), "--gpu", "none", "--x16", "no", "--json")
    fmt = json.loads(out)["target"]["format"]
    assert rc == 0 and fmt["path"] == "gguf kernels, file layout, fp32 compute" and not fmt["x16"]
    rc, out, _ = cli(capsys, "-m", str(g), "--gpu", "none", "--avx512", "yes", "--quant", "gguf")
    assert rc == 0 and "target gguf kernels, x16 layout, fp32 compute" in out and "loading the target" in out
    rc, _, err = cli(capsys, "-m", str(g), "--quant", "int3")
    assert rc == 2 and "invalid choice" in err


def test_unknown_quant_type_in_gguf(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)
    path.write_bytes(bytes(data))
    with pytest.raises(SpecdecError, match="unknown quant type id 250"):
        read_gguf(path)
    rc, _, err = cli(capsys, "-m", str(path), "--gpu", "none")
    one_line_error(rc, err, "unknown quant type")


def test_truncated_and_garbage_gguf(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-500])
    with pytest.raises(SpecdecError, match="not a readable GGUF"):
        read_gguf(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 10)
    with pytest.raises(SpecdecError, match="not a readable GGUF"):
        read_gguf(bad)


def test_requantized_format_uses_ggml_block_sizes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", qtype="F32", hidden=256, heads=4, kv_heads=2, ff=512)
    spec = read_gguf(path)
    t = model_memory(spec, Format("Q4_K", "F16"), 64, 1)
    emb = next(x for x in spec.tensors if x.role == "embed")
    assert t.tensor_bytes[emb.name] == emb.n_elements // 256 * 144  # Q4_K: 144 bytes per 256 weights
    norm = next(x for x in spec.tensors if x.name == "output_norm.weight")
    assert t.tensor_bytes[norm.name] == norm.n_elements * 4  # vectors stay F32
    with pytest.raises(SpecdecError, match="unknown quant type"):
        plan(model=str(path), dtype="q9_z")


# ------------------------------------------------------------------ the planner


def big_config(tmp_path, layers=64, hidden=5120, heads=40, kv=8, ff=27648, vocab=152064, name="big"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": hidden,
                "intermediate_size": ff,
                "num_attention_heads": heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": kv,
                "vocab_size": vocab,
                "max_position_embeddings": 32768,
                "torch_dtype": "bfloat16",
            }
        )
    )
    return d / "config.json"


def test_offload_layers_shrink_with_context(tmp_path):
    cfg = big_config(tmp_path)
    small = plan(model=str(cfg), dtype="q4_k", gpu="rtx4090", context=4096)
    assert small.chosen.ngl == 65 and small.chosen.fits  # 64 layers + output: all on the GPU
    large = plan(model=str(cfg), dtype="q4_k", gpu="rtx4090", context=32768)
    assert 0 < large.chosen.ngl < 64 and large.chosen.fits
    assert large.chosen.gpu_need <= 24 * GiB
    assert small.max_context_gpu is not None and 4096 < small.max_context_gpu < 32768
    assert small.per_1k_layers == pytest.approx(
        small.per_1k_bytes / ((sum(small.target.layer_weights) + small.target.kv) / 64)
    )
    # a split model pays the host link and the CPU's bandwidth
    assert large.chosen.target_step.cpu_s > 0 and large.chosen.target_step.link_s > 0
    assert large.chosen.target_step.tokens_per_s < small.chosen.target_step.tokens_per_s


def test_does_not_fit_is_reported_not_raised(tmp_path):
    cfg = big_config(tmp_path)
    p = plan(model=str(cfg), gpu="none", ram="8GiB")
    assert not p.chosen.fits and "RAM needs" in p.chosen.why and p.max_context is None
    assert "DOES NOT FIT" in render(p)
    forced = plan(model=str(cfg), dtype="q4_k", gpu="rtx3060", ngl=64, ram="64GiB")
    assert not forced.chosen.fits and "GPU needs" in forced.chosen.why


def test_draft_that_pushes_target_off_the_gpu_does_not_pay(tmp_path):
    target = big_config(tmp_path, name="t")
    draft = big_config(tmp_path, layers=28, hidden=3584, heads=28, kv=4, ff=18944, name="d")  # a 7B "draft"
    # fast GPU, slow RAM: the target alone fits on the GPU, with the draft 11 of its layers run from DDR4
    p = plan(
        model=str(target),
        draft=str(draft),
        dtype="q4_k",
        gpu="h100",
        gpu_mem="20GiB",
        cpu="cpu-ddr4",
        ram="64GiB",
        context=4096,
        task="code",
    )
    assert p.alone.ngl == 65 and p.with_draft.ngl < 64 and p.draft_gain > 1 and p.gain == 1.0
    assert not p.draft_pays and p.spec_type == "ngram-simple" and p.chosen is p.alone
    assert "does not pay" in p.recommendation.reason and "target layers off the GPU" in p.why_not
    good = plan(
        model=str(target),
        draft=str(big_config(tmp_path, layers=24, hidden=896, heads=14, kv=2, ff=4864, name="small")),
        dtype="q4_k",
        gpu="h100",
        context=4096,
        task="code",
    )
    assert good.draft_pays and good.spec_type == "draft" and good.gain > 1.5
    assert good.expected_tps == pytest.approx(good.chosen.target_step.tokens_per_s * good.gain)


def test_low_acceptance_does_not_pay(tmp_path):
    target = big_config(tmp_path, name="t")
    draft = big_config(tmp_path, layers=24, hidden=896, heads=14, kv=2, ff=4864, name="d")
    p = plan(model=str(target), draft=str(draft), dtype="q4_k", gpu="h100", accept=0.02, task="chat")
    assert not p.draft_pays and p.spec_type == "suffix" and "pays above" in p.why_not


@pytest.mark.parametrize(
    "name,spec",
    [
        ("code", "draft"),
        ("chat", "draft"),
        ("summarize", "ngram-simple"),
        ("rag", "ngram-simple,draft"),
        ("agent", "suffix,draft"),
    ],
)
def test_recommendation_per_task(tmp_path, name, spec):
    target = big_config(tmp_path, name="t")
    draft = big_config(tmp_path, layers=24, hidden=896, heads=14, kv=2, ff=4864, name="d")
    p = plan(model=str(target), draft=str(draft), dtype="q4_k", gpu="h100", task=name)
    assert p.recommendation.spec_type == spec and p.recommendation.reason.startswith(name)
    alone = plan(model=str(target), dtype="q4_k", gpu="h100", task=name)
    assert "draft" not in alone.recommendation.spec_type.split(",")


def test_runtime_rss_parts(tiny_dir):
    d = tiny_dir("qwen2")
    p = plan(model=str(d), draft=str(d), dtype="fp32", context=128, spec_type="draft")
    assert p.rss is not None and p.rss.steady == sum(p.rss.parts.values())
    assert p.rss.peak >= p.rss.steady and p.rss.phases["loading the target"] > p.target.weights
    assert plan(model=str(d), dtype="file", context=128).rss is None  # llama.cpp's loading: no specdec section


def test_json_and_text_outputs(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf")
    rc, out, err = cli(capsys, "-m", str(path), "-md", str(path), "--gpu", "rtx4090", "--dtype", "file", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["target"]["memory"]["weights"] == read_gguf(path).file_bytes
    assert d["with_draft"]["fits"] and d["with_draft"]["ngl"] == 3 and d["with_draft"]["ngld"] == 3
    # a draft as big as its target never pays: the plan keeps the target alone
    assert not d["speculative"]["draft_pays"] and d["setup"] == d["without_draft"] and d["setup"]["ngld"] is None
    assert {"speculative", "recommendation", "context", "hardware", "expected_tps"} <= set(d)
    rc, out, _ = cli(capsys, "-m", str(path), "--gpu", "none", "--ram", "8GiB")
    assert rc == 0 and "recommendation: --spec-type" in out and "placement: -ngl 0" in out


# ------------------------------------------------------------------ exports


def test_exports(tmp_path, tiny_dir):
    t = write_gguf(tmp_path / "t.gguf", layers=4)
    d = write_gguf(tmp_path / "d.gguf", layers=2)
    p = plan(model=str(t), draft=str(d), gpu="rtx4090", context=200, slots=2, spec_type="draft", export="llama.cpp")
    cmd = export(p, "llama.cpp")
    for piece in (
        f"-m {t}",
        f"-md {d}",
        "-ngl 5",
        "-ngld 3",
        "-c 400",
        "-cd 400",
        "-np 2",
        "--spec-type draft-simple",
        f"--spec-draft-n-max {p.k}",
    ):
        assert piece in cmd, (piece, cmd)
    ngram = "\n".join(
        x
        for x in export(plan(model=str(t), gpu="none", task="summarize"), "llama.cpp").splitlines()
        if not x.startswith("#")
    )
    assert "--spec-type ngram-simple" in ngram and "-md" not in ngram and "-ngl 0" in ngram
    assert "--spec-ngram-simple-size-n 3" in ngram
    chain = export(plan(model=str(t), draft=str(d), gpu="rtx4090", spec_type="suffix,draft"), "llama.cpp")
    assert "--spec-type ngram-mod,draft-simple" in chain

    modelfile = export(p, "ollama")
    assert f"FROM {t}" in modelfile and "PARAMETER num_gpu 5" in modelfile and "num_ctx 200" in modelfile

    ck = tiny_dir("qwen2")
    hp = plan(model=str(ck), draft=str(ck), gpu="rtx4090", spec_type="draft", context=128)
    v = export(hp, "vllm")
    assert v.startswith(f"vllm serve {ck}") and "--max-model-len 128" in v
    cfg = json.loads(v.split("--speculative-config ")[1].split("\n")[0].strip(" \\'"))
    assert cfg == {"method": "draft_model", "model": str(ck), "num_speculative_tokens": hp.k}
    ng = export(plan(model=str(ck), gpu="rtx4090", spec_type="ngram-simple", context=128), "vllm")
    assert '"method": "ngram"' in ng
    assert "--speculate" in export(hp, "tgi")
    code = export(hp, "transformers")
    assert "assistant_model=draft" in code and f"num_assistant_tokens={hp.k}" in code
    compile(code, "export.py", "exec")  # valid Python
    with pytest.raises(SpecdecError, match="unknown export engine"):
        export(hp, "sglang")


def test_export_cli(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf")
    rc, out, _ = cli(capsys, "-m", str(path), "--gpu", "none", "--export", "llama.cpp")
    assert rc == 0 and out.startswith("llama-server -m")
    rc, _, err = cli(capsys, "-m", str(path), "--export", "mlc")
    assert rc == 2 and "invalid choice" in err


# ------------------------------------------------------------------ bad input: one clear line


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--gpu-mem", "-1"], "--gpu-mem must be a positive size"),
        (["--gpu-mem", "abc"], "--gpu-mem: cannot read 'abc'"),
        (["--ram", "0"], "--ram must be a positive size"),
        (["--gpu-bw", "fast"], "--gpu-bw: cannot read"),
        (["--gpu", "rtx9999"], "unknown GPU 'rtx9999'"),
        (["-c", "100000"], "larger than"),
        (["--dtype", "q9_z"], "unknown quant type 'q9_z'"),
        (["--kv-dtype", "int3"], "unknown quant type 'int3'"),
        (["--accept", "1.5"], "--accept must be in [0, 1)"),
        (["--cpu", "z80"], "unknown CPU profile"),
        (["-ngl", "-3"], "layer count must be >= 0"),
        (["-ngl", "many"], "expected a layer count or 'all'"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_dir, capsys, args, needle):
    rc, _, err = cli(capsys, "-m", str(tiny_dir("qwen2")), *args)
    one_line_error(rc, err, needle)


def test_context_larger_than_model_allows(tiny_dir):
    with pytest.raises(SpecdecError, match="max_position_embeddings 256"):
        plan(model=str(tiny_dir("qwen2")), context=257)
    with pytest.raises(SpecdecError, match="-cd 300"):
        plan(model=str(tiny_dir("qwen2")), draft=str(tiny_dir("qwen2")), context=128, draft_context=300)


def test_missing_and_unpulled_models(tmp_path, monkeypatch):
    with pytest.raises(SpecdecError, match="model not found"):
        load_spec(str(tmp_path / "nope.gguf"))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(SpecdecError, match="specdec models pull smollm2-135m"):
        load_spec("smollm2-135m")


def test_plan_cli_subprocess_error_has_no_traceback(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "plan", "-m", str(tmp_path / "x.gguf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0 and "model not found" in res.stderr


def test_plan_help_lists_the_flags():
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "plan", "--help"], capture_output=True, text=True, timeout=300
    )
    for flag in ("-ngl", "-ngld", "--gpu-mem", "--ram-bw", "--pcie-bw", "--export", "--task", "--kv-dtype", "-cd"):
        assert flag in res.stdout


def test_draft_with_another_vocabulary_is_planned_with_a_note(tiny_dir, tmp_path):
    """specdec drafts across tokenizers: the plan goes ahead and says so."""
    from conftest import VOCAB, make_tiny

    draft = make_tiny(tmp_path / "wide", "llama", vocab=VOCAB + 2048)
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "plan", "-m", str(tiny_dir("llama")), "-md", str(draft), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert any("drafts across tokenizers" in n for n in json.loads(res.stdout)["notes"])


# Qwen3-30B-A3B's config.json (its released shapes)
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def test_a_mixture_of_experts_plans_active_parameters_and_verify_reads(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_MOE))
    p = plan(model=str(cfg), ram="128GiB")
    spec, m = p.target.spec, p.target
    assert round(spec.params / 1e9, 1) == 30.5 and 3.3e9 < spec.active_params < 3.4e9  # "30.5B, 3.3B activated"
    # one token reads 8 of 128 experts; 16 rows read at most 1 - (120/128)^16 = 64% of them
    assert m.forward_read(1) < 0.15 * m.weights
    assert 1 < m.verify_cost(2) < m.verify_cost(4) < m.verify_cost(16) < 0.7 * m.weights / m.forward_read(1)
    assert p.recommendation.draft_max < 16  # verifying 16 drafts reads ~6.5x the weights: the planner drafts fewer
    text = render(p)
    assert "128 experts per layer, 8 per token; 3.35B of 30.53B parameters active" in text
