"""A drafter is one file plus one registry line: a toy drafter defined and registered here works from the CLI,
the API, the server's `speculative` field, `specdec bench` and `bench replay`, with no other file changing; its
output is the target's (fp32, the real SmolLM2-135M)."""

import json

import httpx
import pytest
import torch

import specdec
from specdec.cli import main
from specdec.drafters import REGISTRY, Draft, Drafter, DrafterType, Option, register

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"


class RepeatDrafter(Drafter):
    """Proposes the last token `n` times: often wrong, so verification rejects and rolls back."""

    name = "toy-repeat"

    def __init__(self, n: int):
        self.n = n

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        return Draft([seq.tokens[-1]] * min(self.n, max_tokens))


TOY = DrafterType(
    "toy-repeat",
    lambda ctx: RepeatDrafter(ctx.options["toy_len"]),
    "repeat the last token",
    (Option("toy_len", "--spec-toy-len", 3, "toy-repeat: tokens per draft", int, ">= 1"),),
)


@pytest.fixture(scope="module")
def toy():
    register(TOY)  # the one line a new drafter needs
    yield
    REGISTRY.unregister(TOY.name)


@pytest.fixture(scope="module")
def smol(smollm_dir, toy):
    llm = specdec.LLM(
        str(smollm_dir),
        spec_type="toy-repeat",
        dtype="fp32",
        context=256,
        parallel=2,
        adaptive=False,
        toy_len=2,
        progress=False,
    )
    return llm, llm.generate(PROMPT, max_tokens=16, spec_type="none").token_ids


def test_toy_through_the_api(smol):
    llm, plain = smol
    r = llm.generate(PROMPT, max_tokens=16)
    assert r.token_ids == plain and r.stats.drafted > 0 and r.stats.accepted > 0
    with pytest.raises(specdec.SpecdecError, match="toy_len must be >= 1"):
        specdec.LLM(spec_type="toy-repeat", toy_len=0)  # the option's rule, before any model loads


def test_toy_through_the_cli(smollm_dir, smol, capsys):
    _, plain = smol
    assert (
        main(
            [
                "generate",
                "-m",
                str(smollm_dir),
                "--dtype",
                "fp32",
                "-c",
                "256",
                "-p",
                PROMPT,
                "-n",
                "16",
                "--spec-type",
                "toy-repeat",
                "--spec-toy-len",
                "2",
                "--spec-adaptive",
                "off",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain and out["spec_type"] == "toy-repeat" and out["stats"]["drafted"] > 0
    assert out["stats"]["accepted"] > 0
    with pytest.raises(SystemExit) as e:
        main(["generate", "-p", "x", "--spec-type", "toy-repeat", "--spec-toy-len", "0"])
    assert e.value.code == 2 and "toy_len must be >= 1" in capsys.readouterr().err


def test_toy_through_the_server(smol):
    from test_server import LiveServer

    llm, plain = smol
    srv = LiveServer(llm, load_control=False)
    try:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": {"type": "toy-repeat"}}, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == llm.tokenizer.decode(plain)
        assert r.json()["speculative"]["drafted"] > 0 and r.json()["speculative"]["accepted"] > 0, r.json()
        r = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": {"type": "toy-nope"}}, timeout=60)
        assert r.status_code == 400 and "toy-repeat" in r.json()["error"]["message"]  # the known types listed
    finally:
        srv.close()


def test_toy_through_bench_and_replay(smollm_dir, toy, tmp_path):
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"id": "e", "category": "code-edit", "prompt": PROMPT}) + "\n")
    threads = torch.get_num_threads()
    try:  # fixed draft lengths (an adaptive one may draft nothing) and 16 tokens: some drafts are accepted
        assert (
            main(
                [
                    "bench",
                    "-m",
                    str(smollm_dir),
                    "--dtype",
                    "fp32",
                    "-t",
                    "1",
                    "--max-tokens",
                    "16",
                    "--workload",
                    str(work),
                    "--methods",
                    "none,toy-repeat",
                    "--spec-toy-len",
                    "2",
                    "--spec-adaptive",
                    "off",
                    "--out",
                    str(tmp_path / "bench"),
                ]
            )
            == 0
        )
        rec = tmp_path / "rec.json"
        assert (
            main(
                [
                    "bench",
                    "replay",
                    "--record",
                    str(rec),
                    "-m",
                    str(smollm_dir),
                    "--dtype",
                    "fp32",
                    "-t",
                    "1",
                    "-n",
                    "16",
                    "--workload",
                    str(work),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    runs = json.loads((tmp_path / "bench" / "results.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["none", "toy-repeat"] and all(r["matches_baseline"] for r in runs)
    assert runs[1]["drafted"] > 0 and runs[1]["accepted"] > 0, runs[1]
    assert (
        main(
            [
                "bench",
                "replay",
                "--from",
                str(rec),
                "--methods",
                "none,toy-repeat",
                "--spec-toy-len",
                "2",
                "--spec-adaptive",
                "off",
                "--out",
                str(tmp_path / "replay"),
            ]
        )
        == 0
    )
    runs = json.loads((tmp_path / "replay" / "results.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["none", "toy-repeat"] and all(r["matches_baseline"] for r in runs)
    assert runs[1]["drafted"] > 0 and runs[1]["accepted"] > 0, runs[1]


def test_registry_rules():
    with pytest.raises(specdec.SpecdecError, match="cannot register"):
        register(DrafterType("suffix", lambda ctx: None, "a second suffix"))
    clash = Option("ngram_n", "--spec-ngram-size-n", 5, "another default", int)
    with pytest.raises(specdec.SpecdecError, match="differs"):
        register(DrafterType("toy-clash", lambda ctx: None, "reuses ngram_n differently", (clash,)))
    assert "toy-clash" not in REGISTRY.types
    with pytest.raises(specdec.SpecdecError, match="unknown drafter option 'ngram_x'"):
        REGISTRY.option_values({"ngram_x": 1})
