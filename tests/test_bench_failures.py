"""`specdec bench` loses nothing: a method that fails is recorded with its reason while the others' results are
written, a peer that cannot run a combination is skipped before it starts, generated files go under SPECDEC_HOME."""

import json
import stat

import numpy as np
import pytest
import torch

from specdec.bench.llama import eagle3_gguf, llama_methods
from specdec.bench.methods import EngineMethod
from specdec.bench.report import Outcomes
from specdec.cli import main, make_parser
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_head

HIDDEN, LAYERS, VOCAB = 32, 3, 96


def target_gguf(path, arch: str):
    """A GGUF with what the bench reads of a target: architecture, shape keys, a tokenizer, token embeddings."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "embedding_length": HIDDEN,
        "block_count": LAYERS,
        "feed_forward_length": 2 * HIDDEN,
        "attention.head_count": 4,
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_eos_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fake_server(tmp_path):
    """A `llama-server` that prints a --help with draft-eagle3, and otherwise notes its start and dies at once."""
    script = tmp_path / "llama-server"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = --help ]; then echo "--spec-type [none|draft-eagle3]"; exit 0; fi\n'
        f'echo "$*" >> {tmp_path / "started"}\necho "GGML_ASSERT failed"\nexit 1\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_llama_eagle3_skipped_before_start_where_llama_cpp_cannot_run_it(tmp_path, home, arch):
    target = target_gguf(tmp_path / f"{arch}.gguf", arch)
    args = make_parser().parse_args(
        ["bench", "-m", str(target), "--llama-server", str(fake_server(tmp_path)), "-t", "1"]
    )
    outcomes = Outcomes()
    assert llama_methods(["llama-none", "llama-eagle3"], args, 256, set(), tmp_path, outcomes, {}) == []
    # llama-none's server started and died: failed, with the log's last line
    assert outcomes.failed["llama-none"]["stage"] == "loading"
    assert "exited with code 1 (GGML_ASSERT failed" in outcomes.failed["llama-none"]["reason"]
    started = (tmp_path / "started").read_text().splitlines()
    assert len(started) == 1 and "draft-eagle3" not in started[0]  # no server for llama-eagle3
    if arch == "qwen2":
        assert outcomes.skipped == {
            "llama-eagle3": "llama.cpp's EAGLE-3 needs layer inputs its qwen2 graph does not expose"
        }
    else:  # a llama target passes the check, and then needs a head
        assert outcomes.skipped == {} and "no eagle3 head" in outcomes.failed["llama-eagle3"]["reason"]


def test_llama_eagle3_head_gguf_is_written_under_specdec_home(tmp_path, home):
    c = Eagle3Config(HIDDEN, 2 * HIDDEN, 4, 2, 8, VOCAB, 64, HIDDEN, (0, 1, 2))
    head = Eagle3Head(c)
    head.set_vocab(torch.arange(64))
    head_dir = save_head(head, tmp_path / "head")
    target = target_gguf(tmp_path / "t.gguf", "llama")
    out = eagle3_gguf("t.gguf", str(head_dir), target)
    assert out.parent == home / "llama.cpp" / "eagle3" and out.name.startswith("head-") and out.is_file()
    assert not list(head_dir.glob("*.gguf"))
    written = out.stat().st_mtime_ns
    assert eagle3_gguf("t.gguf", str(head_dir), target) == out and out.stat().st_mtime_ns == written  # kept


def test_a_failing_method_is_recorded_and_the_others_results_written(tiny_dir, tmp_path, monkeypatch, capsys):
    calls = {}
    generate = EngineMethod.generate

    def flaky(self, *a, **kw):  # ngram-simple raises on its third call: warm-up, prompt a, prompt b
        calls[self.name] = calls.get(self.name, 0) + 1
        if self.name == "ngram-simple" and calls[self.name] == 3:
            raise RuntimeError("drafter exploded")
        return generate(self, *a, **kw)

    monkeypatch.setattr(EngineMethod, "generate", flaky)
    work = tmp_path / "w.jsonl"
    work.write_text("\n".join(json.dumps({"id": i, "category": "c", "prompt": "t5 t6 t7"}) for i in "ab") + "\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "-m",
                str(tiny_dir("llama")),
                "--dtype",
                "fp32",
                "-t",
                "1",
                "-n",
                "3",
                "--workload",
                str(work),
                "--methods",
                "none,eagle3,ngram-simple",
                "--out",
                str(out),
            ]
        )
        == 1
    )
    res = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["id"]) for r in res["runs"]] == [("none", "a"), ("ngram-simple", "a"), ("none", "b")]
    assert res["failed"]["eagle3"]["stage"] == "loading" and "no eagle3 head" in res["failed"]["eagle3"]["reason"]
    assert res["failed"]["ngram-simple"] == {
        "stage": "running prompt b",
        "reason": f"RuntimeError: drafter exploded (traceback: {out / 'errors.log'})",
    }
    assert "Traceback" in (out / "errors.log").read_text() and res["skipped"] == {}
    report = (out / "report.md").read_text()
    assert "## Failed and skipped methods" in report and "| none |" in report
    assert "- ngram-simple failed while running prompt b: RuntimeError: drafter exploded" in report
    err = capsys.readouterr().err
    assert "ngram-simple failed while running prompt b: RuntimeError: drafter exploded" in err
    assert "specdec: error: 2 of 3 methods failed (eagle3, ngram-simple)" in err
