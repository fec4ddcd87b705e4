"""Build llama.cpp's `llama-server` once, for `specdec bench --llama-server auto`.

The source is the llama.cpp that the `llama-cpp-python==0.3.36` sdist vendors (`vendor/llama.cpp`):
downloaded with `pip download --no-deps --no-binary :all:` (never installed or imported) and checked
against a pinned SHA-256. The binary is built for this CPU's instruction sets, read from /proc/cpuinfo
and passed to cmake one by one (never `-DGGML_NATIVE=ON`; AMX always off: its kernels die with SIGILL
where the kernel does not grant AMX tile state), and cached under
`$SPECDEC_HOME/llama.cpp/bin/KEY/llama-server`, KEY naming the source and the flags, so another CPU
builds its own. A build happens in `$SPECDEC_HOME/llama.cpp/build/KEY` (kept, so a killed build resumes)
and counts as done only once the binary and its marker have been moved into place together.

    python -m specdec.bench.llama_build        # build (or find) it and print its path
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

from specdec.errors import SpecdecError, run_command
from specdec.models.packs import sha256_file
from specdec.paths import file_lock, home

SDIST_PACKAGE, SDIST_VERSION = "llama-cpp-python", "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SOURCE_TAG = f"{SDIST_PACKAGE}-{SDIST_VERSION}"  # the source version in the cache key
MARKER = "build.json"
INSTALL_HINT = "install it: apt-get install cmake g++"

# cmake option -> /proc/cpuinfo flags it needs (x86). GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw.
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
AMX_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# llama-server alone: static (the binary moves out of the build dir), no HTTPS, no tests/examples, no web UI
# download (LLAMA_USE_PREBUILT_UI fetches it from Hugging Face at build time). This source has no LLAMA_CURL.
BASE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
TARGETS = ("llama-server", "llama-quantize")  # llama-quantize: Q4_K_M files for the model-family conformance checks
PROGRESS = re.compile(r"^\[\s*\d+%\]|^\[\d+/\d+\]")  # make's "[ 45%] Building ..." / ninja's "[12/200] ..."


def root() -> Path:
    return home() / "llama.cpp"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature words of /proc/cpuinfo's first `flags` (x86) or `Features` (Arm) line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cmake_cpu_options(cpuinfo: str, machine: str | None = None) -> list[str]:
    """cmake flags for this CPU: on x86 each instruction set ON or OFF explicitly, AMX always OFF."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "i386", "x86"):
        # explicit flags are x86-only in ggml; elsewhere let the compiler target this CPU (no AMX there)
        return ["-DGGML_NATIVE=ON"]
    have = cpu_flags(cpuinfo)
    opts = ["-DGGML_NATIVE=OFF"]
    opts += [f"-D{name}={'ON' if all(f in have for f in need) else 'OFF'}" for name, need in X86_OPTIONS]
    return opts + [f"-D{name}=OFF" for name in AMX_OFF]


def enabled(options: list[str]) -> list[str]:
    """The instruction sets switched on, for messages: ["AVX2", "FMA", ...]."""
    return [o[len("-DGGML_") : -len("=ON")] for o in options if o.startswith("-DGGML_") and o.endswith("=ON")]


def cache_key(cpu_options: list[str], machine: str | None = None) -> str:
    """Source version + machine + a digest of everything that changes the binary."""
    machine = (machine or platform.machine()).lower()
    blob = json.dumps(
        {"sdist": SDIST_SHA256, "machine": machine, "options": [*BASE_OPTIONS, *cpu_options]}, sort_keys=True
    )
    return f"{SOURCE_TAG}-{machine}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def installed(key: str) -> Path | None:
    """The finished binary for `key`: only with its marker beside it, naming the same key."""
    d = root() / "bin" / key
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None
    binary = d / "llama-server"
    if marker.get("key") != key or not binary.is_file() or not os.access(binary, os.X_OK):
        return None
    return binary


def check_tools() -> tuple[str, list[str]]:
    """cmake and a C/C++ compiler and a build tool, or a one-line error naming what is missing."""
    missing = []
    cmake = shutil.which("cmake")
    if cmake is None:
        missing.append("cmake")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++)")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler (gcc)")
    ninja, make = shutil.which("ninja"), shutil.which("make")
    if not ninja and not make:
        missing.append("make")
    if missing:
        what = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
        raise SpecdecError(
            f"cannot build llama-server: {what} not found ({INSTALL_HINT}"
            f"{' make' if 'make' in missing else ''}), or pass --llama-server PATH"
        )
    # make prints "[ 45%]" progress; ninja only when make is absent
    return cmake, ([] if make else ["-G", "Ninja"])


def download_sdist(progress: bool = True) -> Path:
    """The pinned sdist, downloaded once and checked."""
    dl = home() / "downloads" / SDIST_PACKAGE
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / SDIST_FILE
    if sdist.is_file() and sha256_file(sdist) == SDIST_SHA256:
        return sdist
    sdist.unlink(missing_ok=True)
    if progress:
        print(
            f"llama-server: downloading the {SDIST_PACKAGE}=={SDIST_VERSION} sdist (llama.cpp source, ~77 MB)",
            file=sys.stderr,
        )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "-q",
        "-d",
        str(dl),
        f"{SDIST_PACKAGE}=={SDIST_VERSION}",
    ]
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0 or not sdist.is_file():
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecdecError(f"cannot download {SDIST_PACKAGE}=={SDIST_VERSION}: {last}")
    got = sha256_file(sdist)
    if got != SDIST_SHA256:
        sdist.unlink(missing_ok=True)
        raise SpecdecError(f"{SDIST_FILE}: SHA-256 mismatch (got {got}, want {SDIST_SHA256})")
    return sdist


def source_dir(progress: bool = True) -> Path:
    """The unpacked llama.cpp source (`vendor/llama.cpp` of the sdist), unpacked once, atomically."""
    src = root() / "src" / SOURCE_TAG
    vendored = src / "vendor" / "llama.cpp"
    if (src / ".complete").is_file():
        return vendored
    sdist = download_sdist(progress)
    tmp = src.with_name(f"{src.name}.tmp-{uuid.uuid4().hex}")
    try:
        with tarfile.open(sdist) as tf:
            prefix = f"llama_cpp_python-{SDIST_VERSION}/"
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            if hasattr(tarfile, "data_filter"):
                tf.extractall(tmp, members=members, filter="data")
            else:  # Python < 3.11.4
                tf.extractall(tmp, members=members)  # noqa: S202
        if not (tmp / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise SpecdecError(f"{SDIST_FILE} has no vendor/llama.cpp/CMakeLists.txt")
        (tmp / ".complete").write_text(SDIST_SHA256 + "\n")
        shutil.rmtree(src, ignore_errors=True)
        os.replace(tmp, src)
    except (OSError, tarfile.TarError) as e:
        raise SpecdecError(f"cannot unpack {sdist}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return vendored


def jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _run_logged(cmd: list[str], log: Path, step: str, progress: bool) -> None:
    """Run `cmd`, appending its output to `log`; progress lines go to stderr; a failure is one line."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                bufsize=1,
            )
        except OSError as e:
            raise SpecdecError(f"cannot run {cmd[0]}: {e.strerror or e} ({INSTALL_HINT})") from None
        first_error, last = None, None
        try:
            for line in proc.stdout:
                f.write(line)
                if PROGRESS.match(line):
                    if progress:
                        print(f"llama-server: {line.rstrip()}", file=sys.stderr, flush=True)
                    continue
                if first_error is None and re.search(r"error:|CMake Error", line, re.IGNORECASE):
                    first_error = line.strip()
                last = line.strip() or last
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        why = f": {(first_error or last)[:300]}" if first_error or last else ""
        raise SpecdecError(f"llama-server build failed at {step} (exit {rc}){why}; full log: {log}")


def build_command(
    cmake: str, src: Path, build: Path, generator: list[str], cpu_options: list[str], n_jobs: int
) -> tuple[list[str], list[str]]:
    """The configure and build command lines."""
    configure = [cmake, "-S", str(src), "-B", str(build), *generator, *BASE_OPTIONS, *cpu_options]
    compile_ = [cmake, "--build", str(build), "--config", "Release", "--target", *TARGETS, "-j", str(n_jobs)]
    return configure, compile_


def ensure_llama_server(progress: bool = True, cpuinfo: str | None = None) -> Path:
    """The path of a `llama-server` built for this CPU from the pinned source; builds it on first use."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cpu_options = cmake_cpu_options(cpuinfo)
    key = cache_key(cpu_options)
    found = installed(key)
    if found is not None:
        return found
    cmake, generator = check_tools()
    build = root() / "build" / key
    build.mkdir(parents=True, exist_ok=True)
    with file_lock(build.with_name(key + ".lock"), "llama-server: waiting for another build of it" if progress else ""):
        found = installed(key)  # another process may have finished it while we waited
        if found is not None:
            return found
        src = source_dir(progress)
        n = jobs()
        configure, compile_ = build_command(cmake, src, build, generator, cpu_options, n)
        log = build / "build.log"
        resumed = (build / "CMakeCache.txt").is_file()
        if progress:
            print(
                f"llama-server: building llama.cpp ({SOURCE_TAG} sdist) for this CPU "
                f"({' '.join(enabled(cpu_options)) or 'native'}; AMX off), -j {n}: this takes ~20-30+ minutes "
                f"on 2 cores{' (resuming the last build)' if resumed else ''}; log: {log}",
                file=sys.stderr,
            )
        t0 = time.monotonic()
        _run_logged(configure, log, "cmake configure", progress)
        _run_logged(compile_, log, "cmake --build", progress)
        built = build / "bin" / "llama-server"
        if not built.is_file():
            raise SpecdecError(f"llama-server build finished but {built} is missing; full log: {log}")
        dest = root() / "bin" / key
        tmp = dest.with_name(f"{key}.tmp-{uuid.uuid4().hex}")
        try:
            tmp.mkdir(parents=True)
            for target in TARGETS:
                if (build / "bin" / target).is_file():
                    shutil.copy2(build / "bin" / target, tmp / target)
            (tmp / MARKER).write_text(
                json.dumps(
                    {
                        "key": key,
                        "sdist": f"{SDIST_PACKAGE}=={SDIST_VERSION}",
                        "sdist_sha256": SDIST_SHA256,
                        "configure": configure,
                        "build": compile_,
                        "seconds": round(time.monotonic() - t0, 1),
                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    },
                    indent=1,
                )
                + "\n"
            )
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            print(
                f"llama-server: built in {(time.monotonic() - t0) / 60:.1f} min: {dest / 'llama-server'}",
                file=sys.stderr,
            )
        return dest / "llama-server"


def main() -> int:
    def build() -> int:
        print(ensure_llama_server())
        return 0

    return run_command(build, "interrupted (the build resumes where it stopped next time)")


if __name__ == "__main__":
    sys.exit(main())
