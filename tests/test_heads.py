"""Finding trained heads: finished before unfinished, newest first; `specdec models list` shows them."""

from __future__ import annotations

import json
import os

import pytest

from specdec.drafters.heads import find_head, list_heads
from specdec.errors import SpecdecError


def _head(root, name, kind, target, finished, mtime, tau=1.5):
    d = root / "heads" / name
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"0" * 1000)
    m = d / "manifest.json"
    m.write_text(json.dumps({"kind": kind, "target": target, "finished": finished, "validation": {"tau": tau}}))
    os.utime(m, (mtime, mtime))
    return d


def test_finished_heads_come_first(tmp_path, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    old = _head(tmp_path, "a", "eagle3", "smollm2-135m", True, 1_000)
    _head(tmp_path, "b", "eagle3", "smollm2-135m", False, 2_000)  # newer, but mid-training
    newest = _head(tmp_path, "c", "eagle3", "/models/smollm2-135m", True, 3_000)  # a path: its last part counts
    _head(tmp_path, "d", "medusa", "smollm2-135m", True, 4_000)
    (tmp_path / "heads" / "broken").mkdir()
    (tmp_path / "heads" / "broken" / "manifest.json").write_text("{")
    assert find_head("smollm2-135m", "eagle3", "--x") == newest
    (newest / "manifest.json").unlink()
    assert find_head("/elsewhere/smollm2-135m", "eagle3", "--x") == old
    assert [h.path.name for h in list_heads() if not h.shipped] == ["d", "a", "b"]
    with pytest.raises(SpecdecError, match="no mtp head for 'qwen2.5-coder-1.5b'.*--x DIR"):
        find_head("qwen2.5-coder-1.5b", "mtp", "--x")
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "trained heads" in out and "unfinished" in out and "tau 1.50" in out


@pytest.mark.real
def test_plan_counts_the_heads_memory(smollm_dir, tmp_path):
    """`specdec plan --spec-type medusa,mtp`: the found head's weights in the runtime dtype; without one, an
    estimate for a default head (with its KV cache), both in the RSS parts and the notes."""
    import torch
    from safetensors.torch import save_file

    from specdec.plan import PlanInputs, make_plan

    d = _head(tmp_path, "m", "medusa", "smollm2-135m", True, 1_000)
    save_file({"w": torch.zeros(10, 20), "b": torch.zeros(5)}, str(d / "model.safetensors"))
    plan = make_plan(
        PlanInputs(
            model="smollm2-135m",
            spec_type="medusa,mtp",
            context=1024,
            drafter_options={"medusa_head": str(d), "mtp_head": str(tmp_path / "none")},
        )
    )
    assert plan.heads["medusa head weights"] == 205 * 4
    assert plan.heads["mtp head KV"] == 2 * 3 * 64 * 1024 * 4  # one layer: 3 KV heads x 64, K and V, fp32
    assert plan.heads["mtp head weights"] > 4 * 576 * 576
    assert plan.rss.parts["medusa head weights"] == 820 and plan.rss.steady >= sum(plan.heads.values())
    assert any(n.startswith("mtp: no mtp head found") for n in plan.notes)


def test_server_drafts_with_every_head_at_concurrency(tiny_dir, tmp_path):
    """`specdec serve` with EAGLE-3, Medusa and MTP heads picked per request (`speculative.type`), 12 greedy
    requests at once across the three and a chain with suffix: every output is plain decoding's, drafts accepted
    or not."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_eagle3 import random_head as eagle3_head
    from test_medusa import random_heads
    from test_mtp import random_head as mtp_head
    from test_server import LiveServer

    import specdec
    from specdec.models.config import ModelConfig
    from specdec.models.eagle3 import save_head as save_eagle3
    from specdec.models.medusa import save_heads
    from specdec.models.mtp import MtpConfig
    from specdec.models.mtp import save_head as save_mtp

    target = tiny_dir("llama", layers=3)
    save_eagle3(eagle3_head(target), tmp_path / "eagle3", {"kind": "eagle3", "target": "t"})
    save_heads(random_heads(target), tmp_path / "medusa", {"kind": "medusa", "target": "t"})
    cfg = MtpConfig.for_target(ModelConfig.from_file(target / "config.json"))
    save_mtp(mtp_head(cfg, scale=0.05), tmp_path / "mtp", str(target), {"kind": "mtp", "target": "t"})
    llm = specdec.LLM(
        str(target),
        spec_type="eagle3",
        dtype="fp32",
        context=96,
        parallel=6,
        adaptive=False,
        draft_max=3,
        progress=False,
        eagle3_head=str(tmp_path / "eagle3"),
        medusa_head=str(tmp_path / "medusa"),
        mtp_head=str(tmp_path / "mtp"),
    )
    llm.engine.stop_ids = set()
    prompts = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4", "t1 t2 t3"]
    plain = {p: llm.generate(p, max_tokens=20, spec_type="none").text for p in prompts}
    kinds = ["eagle3", "medusa", "mtp", "mtp,suffix"]
    srv = LiveServer(llm, load_control=False)
    try:

        def one(i: int) -> tuple[str, str, dict]:
            p, kind = prompts[i % 4], kinds[i // 4 % 4]
            r = httpx.post(
                srv.url + "/v1/completions",
                timeout=300,
                json={"prompt": p, "max_tokens": 20, "temperature": 0, "speculative": {"type": kind}},
            )
            assert r.status_code == 200, r.text
            return p, kind, r.json()

        drafted = dict.fromkeys(kinds, 0)
        with ThreadPoolExecutor(12) as ex:
            for p, kind, out in ex.map(one, range(16)):
                assert out["choices"][0]["text"] == plain[p], (kind, p)
                drafted[kind] += out["speculative"]["drafted"]
        assert all(drafted.values()), drafted  # drafted only: random heads are right by chance alone
    finally:
        srv.close()


@pytest.mark.real
def test_the_shipped_smollm_head_is_lossless_and_accepted(smollm_dir):
    """The EAGLE-3 head committed with specdec (specdec/heads/eagle3-smollm2-135m, trained here: its manifest says
    how): at most 40 MB, found for the target, greedy decoding with it is plain decoding's, drafts accepted."""
    import specdec
    from specdec.drafters.heads import SHIPPED

    head = SHIPPED / "eagle3-smollm2-135m"
    m = json.loads((head / "manifest.json").read_text())
    assert m["kind"] == "eagle3" and m["target"] == "smollm2-135m" and m["command"] and m["data"]["rules"]
    assert sum(f.stat().st_size for f in head.iterdir()) <= 40e6
    assert any(h.shipped and h.path == head for h in list_heads())
    llm = specdec.LLM(
        "smollm2-135m",
        spec_type="eagle3",
        eagle3_head=str(head),
        dtype="fp32",
        adaptive=False,
        draft_max=3,
        progress=False,
    )
    prompt = "Write a short story about a cat who learns to play the piano."
    plain = llm.generate(prompt, max_tokens=64, chat=True, spec_type="none")
    spec = llm.generate(prompt, max_tokens=64, chat=True)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


def test_learning_curve_plot(tmp_path):
    from specdec.train.plots import plot_heads

    m = tmp_path / "manifest.json"
    m.write_text(
        json.dumps(
            {
                "kind": "eagle3",
                "target": "t",
                "training": {"hours": 0.1},
                "learning_curve": [[0, 1.0], [1000, 1.3]],
                "validation": {"accept": [0.3, 0.1]},
            }
        )
    )
    out = plot_heads([m], tmp_path / "lc.png")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.real
def test_the_shipped_qwen_coder_head_is_lossless_and_accepted():
    """The EAGLE-3 head for the default target committed with specdec (specdec/heads/eagle3-qwen2.5-coder-1.5b,
    stored in int8; its manifest says how it was trained): at most 40 MB, listed as shipped, and decoding the GGUF
    target with it (Q8_0 head, the default) is plain greedy decoding's text, with drafts accepted."""
    import specdec
    from specdec.drafters.heads import SHIPPED

    head = SHIPPED / "eagle3-qwen2.5-coder-1.5b"
    m = json.loads((head / "manifest.json").read_text())
    assert m["kind"] == "eagle3" and m["target"] == "qwen2.5-coder-1.5b" and m["head"]["storage"] == "int8"
    assert m["command"] and m["data"]["rules"]["deny_list_sha256"]
    assert sum(f.stat().st_size for f in head.iterdir()) <= 40e6
    assert any(h.shipped and h.path == head for h in list_heads())
    llm = specdec.LLM(
        "qwen2.5-coder-1.5b", spec_type="eagle3", eagle3_head=str(head), adaptive=False, draft_max=3, progress=False
    )
    prompt = "Explain what a hash map is and when to use one."
    plain = llm.generate(prompt, max_tokens=48, chat=True, spec_type="none")
    spec = llm.generate(prompt, max_tokens=48, chat=True)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0
