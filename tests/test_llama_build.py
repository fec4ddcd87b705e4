"""`--llama-server auto`: CPU flags, cache key, missing tools, finished marker; no real build (fake cmake)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from specdec.bench import llama_build as lb
from specdec.errors import SpecdecError

# AMD EPYC Zen 3: AVX2, no AVX-512
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sse sse2 ht syscall nx lm pni pclmulqdq ssse3 fma cx16 sse4_1 \
sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm sse4a bmi1 avx2 smep bmi2 erms invpcid rdseed adx \
smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves vaes vpclmulqdq rdpid fsrm
processor\t: 1
flags\t\t: fpu sse2 avx2
"""
# Intel Sapphire Rapids: AVX-512 with VBMI/VNNI/BF16, AVX-VNNI, and AMX (which must stay off)
SPR = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 avx512f avx512dq avx512ifma avx512cd \
avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq \
amx_bf16 avx512_fp16 amx_tile amx_int8
"""


def opts(cpuinfo: str) -> dict[str, str]:
    out = {}
    for o in lb.cmake_cpu_options(cpuinfo, machine="x86_64"):
        name, _, value = o[2:].partition("=")
        out[name] = value
    return out


def test_avx2_only_cpu():
    o = opts(ZEN3)
    assert o["GGML_NATIVE"] == "OFF"
    assert all(o[k] == "ON" for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_SSE42"))
    assert all(
        o[k] == "OFF"
        for k in ("GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16")
    )
    assert all(o[k] == "OFF" for k in lb.AMX_OFF)


def test_avx512_cpu_keeps_amx_off():
    o = opts(SPR)
    assert o["GGML_NATIVE"] == "OFF"
    assert all(
        o[k] == "ON"
        for k in (
            "GGML_AVX2",
            "GGML_FMA",
            "GGML_F16C",
            "GGML_BMI2",
            "GGML_AVX_VNNI",
            "GGML_AVX512",
            "GGML_AVX512_VBMI",
            "GGML_AVX512_VNNI",
            "GGML_AVX512_BF16",
        )
    )
    assert all(o[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert "-DGGML_NATIVE=ON" not in lb.cmake_cpu_options(SPR, machine="x86_64")


def test_avx512_needs_every_base_subset():
    no_bw = SPR.replace(" avx512bw", "")
    assert "avx512bw" not in lb.cpu_flags(no_bw)
    assert opts(no_bw)["GGML_AVX512"] == "OFF"  # ggml compiles AVX512 with -mavx512bw too
    assert opts(no_bw)["GGML_AVX512_VNNI"] == "ON"


def test_non_x86_builds_for_its_own_cpu():
    assert lb.cmake_cpu_options("Features\t: fp asimd", machine="aarch64") == ["-DGGML_NATIVE=ON"]


def test_cache_key_changes_with_flags_and_source(monkeypatch):
    a = lb.cache_key(lb.cmake_cpu_options(ZEN3, "x86_64"), "x86_64")
    b = lb.cache_key(lb.cmake_cpu_options(SPR, "x86_64"), "x86_64")
    assert a != b
    assert a == lb.cache_key(lb.cmake_cpu_options(ZEN3, "x86_64"), "x86_64")
    assert a.startswith(f"llama-cpp-python-{lb.SDIST_VERSION}-x86_64-")
    monkeypatch.setattr(lb, "SDIST_SHA256", "0" * 64)
    assert lb.cache_key(lb.cmake_cpu_options(ZEN3, "x86_64"), "x86_64") != a


def _home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    return tmp_path / "llama.cpp"


@pytest.mark.parametrize("gone", ["cmake", "g++"])
def test_missing_tool_is_one_clear_line(tmp_path, monkeypatch, gone):
    _home(tmp_path, monkeypatch)
    real = lb.shutil.which
    blocked = {"cmake"} if gone == "cmake" else {"c++", "g++", "clang++"}
    monkeypatch.setattr(lb.shutil, "which", lambda n: None if n in blocked else real(n))
    monkeypatch.setattr(lb, "download_sdist", lambda *a, **k: pytest.fail("must not download without tools"))
    with pytest.raises(SpecdecError) as e:
        lb.ensure_llama_server(progress=False, cpuinfo=ZEN3)
    msg = str(e.value)
    assert "\n" not in msg and "apt-get install cmake g++" in msg
    if gone == "cmake":
        assert "cmake not found" in msg
    else:
        assert "C++ compiler (g++) not found" in msg and "cmake not found" not in msg


def _fake_binary(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho usage\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_finished_marker_required(tmp_path, monkeypatch):
    root = _home(tmp_path, monkeypatch)
    key = lb.cache_key(lb.cmake_cpu_options(ZEN3))
    binary = root / "bin" / key / "llama-server"
    _fake_binary(binary)
    assert lb.installed(key) is None  # a binary without its marker (e.g. a killed copy) is not finished
    (binary.parent / lb.MARKER).write_text(json.dumps({"key": "another-cpu"}))
    assert lb.installed(key) is None
    (binary.parent / lb.MARKER).write_text(json.dumps({"key": key}))
    assert lb.installed(key) == binary
    # found in the cache: no tools needed, nothing built
    monkeypatch.setattr(lb.shutil, "which", lambda n: None)
    assert lb.ensure_llama_server(progress=False, cpuinfo=ZEN3) == binary
    # another CPU's flags never reuse it
    with pytest.raises(SpecdecError, match="cmake, .* not found"):
        lb.ensure_llama_server(progress=False, cpuinfo=SPR)


FAKE_CMAKE = """#!/bin/sh
# configure: nothing; build: progress lines, then bin/llama-server (or a failure when FAKE_FAIL is set)
if [ "$1" = "--build" ]; then
  echo "[ 50%] Building CXX object ggml.cpp.o"
  if [ -n "$FAKE_FAIL" ]; then echo "ggml.c:1:1: error: boom"; exit 2; fi
  mkdir -p "$2/bin" && printf '#!/bin/sh\\necho usage\\n' > "$2/bin/llama-server" && chmod +x "$2/bin/llama-server"
  echo "[100%] Linking CXX executable bin/llama-server"
fi
exit 0
"""


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    root = _home(tmp_path / "home", monkeypatch)
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in (("cmake", FAKE_CMAKE), ("c++", "#!/bin/sh\n"), ("cc", "#!/bin/sh\n"), ("make", "#!/bin/sh\n")):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.setattr(lb, "source_dir", lambda progress=True: src)
    return root


def test_build_moves_into_place_with_progress(fake_build, capsys):
    path = lb.ensure_llama_server(progress=True, cpuinfo=ZEN3)
    key = lb.cache_key(lb.cmake_cpu_options(ZEN3))
    assert path == fake_build / "bin" / key / "llama-server" and lb.installed(key) == path
    marker = json.loads((path.parent / lb.MARKER).read_text())
    assert "-DGGML_AMX_TILE=OFF" in marker["configure"] and "-DGGML_NATIVE=OFF" in marker["configure"]
    assert marker["build"][-5:-2] == ["--target", *lb.TARGETS] and marker["build"][-1] == str(lb.jobs())
    err = capsys.readouterr().err
    assert "minutes on 2 cores" in err and "[ 50%] Building" in err and "built in" in err
    assert not list((fake_build / "bin").glob("*.tmp-*"))


def test_failed_build_is_one_line_and_not_finished(fake_build, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(SpecdecError) as e:
        lb.ensure_llama_server(progress=False, cpuinfo=ZEN3)
    msg = str(e.value)
    assert "\n" not in msg and "cmake --build" in msg and "error: boom" in msg and "build.log" in msg
    key = lb.cache_key(lb.cmake_cpu_options(ZEN3))
    assert lb.installed(key) is None and not (fake_build / "bin" / key).exists()
    assert (fake_build / "build" / key).is_dir()  # kept, so the next run resumes


def test_sdist_hash_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    dl = tmp_path / "downloads" / lb.SDIST_PACKAGE

    def fake_run(cmd, **kw):
        (dl / lb.SDIST_FILE).write_bytes(b"not the sdist")
        return lb.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(lb.subprocess, "run", fake_run)
    with pytest.raises(SpecdecError, match="SHA-256 mismatch"):
        lb.download_sdist(progress=False)
    assert not (dl / lb.SDIST_FILE).exists()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("methods,built", [("llama-none", True), ("none", False)])
def test_bench_llama_server_auto(monkeypatch, methods, built):
    """`--llama-server auto` builds (here: a stub) before any model loads, only when a llama-* method runs."""
    import specdec.api as api
    import specdec.cli as cli
    from specdec.bench.runner import run_bench

    seen = {}

    def fake_build_llm(a, **override):
        seen["llama_server"] = a.llama_server
        raise _Stop

    monkeypatch.setattr(lb, "ensure_llama_server", lambda: Path("/cache/llama-server"))
    monkeypatch.setattr(api, "build_llm", fake_build_llm)
    a = cli.make_parser().parse_args(
        ["bench", "--quick", "--llama-server", "auto", "--methods", methods, "-m", "x.gguf", "-t", "1"]
    )
    with pytest.raises(_Stop):
        run_bench(a)
    assert seen["llama_server"] == ("/cache/llama-server" if built else "auto")
