"""Opt-in relaxed acceptance (--spec-accept-threshold): off by default, flagged wherever it was used."""

import json

import httpx
import pytest
import torch

import specdec
from specdec.engine.scheduler import Scheduler
from specdec.sampling import SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread
from specdec.verify import Relaxed, chain, verify_tree_greedy, verify_tree_sampling

PROMPTS = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4"]


def test_relaxed_rule_on_a_chain():
    """Target probabilities at node 0: token 1 0.5, token 2 0.3, token 3 0.2. Draft [2, ...]: greedy rejects 2;
    threshold 0.5 accepts it (0.3 >= 0.5 x 0.5), threshold 0.7 does not (0.3 < 0.35)."""
    logits = torch.log(torch.tensor([[1e-9, 0.5, 0.3, 0.2], [1e-9, 0.1, 0.1, 0.8]]))  # [2, V]
    assert verify_tree_greedy([2], chain(1), logits) == ([1], [])
    loose = Relaxed([2], logits, SamplingParams(), 0.5)
    assert verify_tree_greedy([2], chain(1), logits, loose) == ([2, 3], [0]) and loose.count == 1
    strict = Relaxed([2], logits, SamplingParams(), 0.7)
    assert verify_tree_greedy([2], chain(1), logits, strict) == ([1], []) and strict.count == 0
    # sampling: the lossless test first (0.3 / 1.0 against the draw), the relaxed rule where it rejects
    g = torch.Generator().manual_seed(0)
    accepted = sum(
        verify_tree_sampling(
            [2],
            chain(1),
            None,
            logits,
            SamplingParams(temperature=1.0),
            g,
            Relaxed([2], logits, SamplingParams(temperature=1.0), 0.5),
        )[1]
        == [0]
        for _ in range(50)
    )
    assert accepted == 50


def _llm(tiny_dir, **kw):
    llm = specdec.LLM(
        str(tiny_dir("llama")),
        draft=str(tiny_dir("llama", seed=1, layers=1)),
        spec_type="draft",
        dtype="fp32",
        context=64,
        adaptive=False,
        draft_max=4,
        progress=False,
        **kw,
    )
    llm.engine.stop_ids = set()
    return llm


def test_engine_flags_relaxed_outputs(tiny_dir):
    strict, loose = _llm(tiny_dir), _llm(tiny_dir, accept_threshold=0.05)
    relaxed = drafted = 0
    for prompt in PROMPTS:
        base = strict.generate(prompt, max_tokens=30, spec_type="none")
        exact = strict.generate(prompt, max_tokens=30)
        assert exact.token_ids == base.token_ids and exact.lossless and exact.stats.relaxed == 0
        drafted += exact.stats.drafted
        r = loose.generate(prompt, max_tokens=30)
        assert not r.lossless and r.to_dict()["lossless"] is False
        relaxed += r.stats.relaxed
    assert relaxed > 0  # the weak random draft gets tokens in that the exact rule rejects
    assert drafted > 0  # drafted only: the exact rule accepts the random draft's tokens by chance alone


def test_cli_json_says_lossless_false(tiny_dir):
    from test_cli import run

    res = run(
        "generate",
        "-m",
        str(tiny_dir("llama")),
        "-p",
        "t5 t9 t5 t9",
        "-n",
        "8",
        "--dtype",
        "fp32",
        "--spec-type",
        "ngram-simple",
        "--spec-accept-threshold",
        "0.7",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["lossless"] is False and "relaxed" in out["stats"]
    res = run("generate", "-m", str(tiny_dir("llama")), "-p", "t5", "--spec-accept-threshold", "2")
    assert res.returncode != 0 and "accept_threshold must be in [0, 1]" in res.stderr


@pytest.mark.parametrize("allow", [False, True])
def test_server_takes_it_only_with_allow_lossy(tiny_dir, allow):
    llm = _llm(tiny_dir, parallel=2)
    srv = ServerThread(
        create_app(llm, Scheduler(llm.engine, 2), ServerConfig("m", SamplingParams(max_tokens=16), allow_lossy=allow))
    )
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 20, "speculative": {"accept_threshold": 0.05}}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        plain = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 20}, timeout=60)
        assert plain.status_code == 200 and plain.json()["lossless"] is True
        if not allow:
            assert r.status_code == 400 and "--allow-lossy" in r.json()["error"]["message"]
            return
        assert r.status_code == 200 and r.json()["lossless"] is False
        relaxed = r.json()["speculative"]["relaxed"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert f"specdec_draft_relaxed_tokens_total {relaxed}" in metrics
    finally:
        srv.close()
