"""GGUF model files: clear errors for bad metadata, streamed conversion, a crash-safe content-keyed cache."""

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.models import gguf_convert, packs
from specdec.models.loader import converted_gguf
from specdec.plan.specs import read_gguf


def write_gguf(
    path: Path,
    meta: dict | None = None,
    hidden: int = 32,
    ff: int = 64,
    layers: int = 1,
    vocab: int = 32,
    qtype: str = "F32",
    seed: int = 0,
) -> Path:
    """A small qwen2 GGUF with a gpt2 tokenizer; `meta` overrides `qwen2.*` keys (a None value drops the key)."""
    import gguf

    keys = {
        "embedding_length": hidden,
        "block_count": layers,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "feed_forward_length": ff,
        "context_length": 64,
        **(meta or {}),
    }
    w = gguf.GGUFWriter(str(path), "qwen2")
    for k, v in keys.items():
        if v is not None:
            w.add_uint32(f"qwen2.{k}", v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(26)] + ["ab"] + [f"<{i}>" for i in range(27, vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    rng = np.random.default_rng(seed)
    kv = hidden // 2
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.{n}": s
            for n, s in {
                "attn_norm.weight": (hidden,),
                "ffn_norm.weight": (hidden,),
                "attn_q.weight": (hidden, hidden),
                "attn_q.bias": (hidden,),
                "attn_k.weight": (kv, hidden),
                "attn_k.bias": (kv,),
                "attn_v.weight": (kv, hidden),
                "attn_v.bias": (kv,),
                "attn_output.weight": (hidden, hidden),
                "ffn_gate.weight": (ff, hidden),
                "ffn_up.weight": (ff, hidden),
                "ffn_down.weight": (hidden, ff),
            }.items()
        }
    qt = gguf.GGMLQuantizationType[qtype]
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and qtype != "F32":
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize(
    "key,value", [("embedding_length", None), ("attention.head_count", 0), ("block_count", 0), ("context_length", 0)]
)
def test_missing_or_zero_metadata(tmp_path, home, key, value):
    path = write_gguf(tmp_path / "bad.gguf", {key: value})
    for read in (converted_gguf, read_gguf):
        with pytest.raises(SpecdecError) as e:
            read(path)
        msg = str(e.value)
        assert f"qwen2.{key}" in msg and str(path) in msg and "\n" not in msg
    assert not (home / "converted").exists()


def test_converted_weights_equal_the_gguf(tmp_path, home):
    import gguf
    from safetensors.numpy import load_file

    path = write_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    out = converted_gguf(path, progress=False)
    weights = load_file(str(out / "model.safetensors"))
    reader = gguf.GGUFReader(path)
    tensors = reader.tensors
    names = gguf_convert.hf_names(reader, gguf_convert.config_from_gguf(reader, path))
    assert len(weights) == len(tensors)
    for t in tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(weights[names[t.name]], ref)
    assert json.loads((out / gguf_convert.MARKER).read_text())["sha256"] == packs.sha256_file(path)


def test_conversion_streams_tensor_by_tensor(tmp_path, home):
    """Peak Python/numpy allocation while converting stays far below the converted size."""
    converted_gguf(write_gguf(tmp_path / "warm.gguf"), progress=False)  # imports done outside the trace
    path = write_gguf(tmp_path / "big.gguf", hidden=256, ff=1024, layers=4, qtype="Q8_0")
    tracemalloc.start()
    try:
        out = gguf_convert.convert_gguf(path, tmp_path / "out", "0" * 64, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = (out / "model.safetensors").stat().st_size
    assert size > 15e6 and peak < 0.3 * size, (peak, size)


# Killed once the weights and config are written, before the tokenizer (and the finished marker).
_KILLED_CONVERSION = """
import os, signal, sys
from pathlib import Path
from specdec.models import gguf_convert
from specdec.models.loader import converted_gguf
gguf_convert._save_tokenizer = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
converted_gguf(Path(sys.argv[1]), progress=False)
"""


def test_killed_conversion_is_not_taken_for_finished_and_is_cleaned(tmp_path, home):
    path = write_gguf(tmp_path / "m.gguf")
    res = subprocess.run([sys.executable, "-c", _KILLED_CONVERSION, str(path)])  # SPECDEC_HOME=home is inherited
    assert res.returncode == -signal.SIGKILL
    converted = home / "converted"
    assert [p.name for p in converted.iterdir()] == [gguf_convert.PARTIAL]  # nothing published
    assert len(list((converted / gguf_convert.PARTIAL).iterdir())) == 1  # the dead run's temp dir
    out = converted_gguf(path, progress=False)
    assert gguf_convert.is_converted(out, packs.sha256_file(path))
    assert list((converted / gguf_convert.PARTIAL).iterdir()) == []  # its process is gone: removed


def test_directory_without_marker_is_reconverted(tmp_path, home, monkeypatch):
    """A pack directory with weights and config but no finished marker (a half copy, an old layout)."""
    path = write_gguf(tmp_path / "m.gguf")
    sha = packs.sha256_file(path)
    monkeypatch.setitem(packs.PACKS, "fake", packs.Pack("fake", (), sha, "test pack"))
    d = packs.model_dir("fake")
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"partial")
    packs.gguf_path("fake").parent.mkdir(parents=True)
    packs.gguf_path("fake").write_bytes(path.read_bytes())
    assert not packs.is_pulled("fake")
    assert packs.pull("fake", progress=False) == d and packs.is_pulled("fake")
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen2"


def test_stale_temp_dirs(tmp_path):
    import socket

    host, partial = socket.gethostname(), tmp_path / gguf_convert.PARTIAL
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {
        "dead": f"{host}.{dead.pid}.x1",
        "live": f"{host}.{os.getpid()}.x2",
        "old": f"{host}.{os.getpid()}.x3",
        "other-host": f"elsewhere.{dead.pid}.x4",
    }
    for name in names.values():
        (partial / name).mkdir(parents=True)
    week_ago = time.time() - 7 * 24 * 3600
    os.utime(partial / names["old"], (week_ago, week_ago))
    gguf_convert.clean_stale(partial)
    assert sorted(p.name for p in partial.iterdir()) == sorted([names["live"], names["other-host"]])


def test_cache_key_covers_content(tmp_path, home):
    """Same path, size and mtime, other weights: a fresh conversion, not the cached one."""
    path = write_gguf(tmp_path / "m.gguf", seed=0)
    first = converted_gguf(path, progress=False)
    st = path.stat()
    write_gguf(path, seed=1)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    second = converted_gguf(path, progress=False)
    assert second != first
    a, b = ((d / "model.safetensors").read_bytes() for d in (first, second))
    assert a != b


@pytest.mark.real
def test_real_pack_conversion_is_marked(smollm_dir):
    assert smollm_dir == packs.model_dir("smollm2-135m")
    assert gguf_convert.is_converted(smollm_dir, packs.PACKS["smollm2-135m"].sha256) and packs.is_pulled("smollm2-135m")
    cfg = json.loads((smollm_dir / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (576, 30, 9)
