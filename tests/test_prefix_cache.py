"""The prefix cache shared across requests (runtime/prefix_cache.py) and batched drafting: greedy output with and
without the cache is identical (plain, draft model, suffix, suffix-tree; tiny models and SmolLM2-135M); the byte
budget holds (LRU eviction); a block in use or with cached children is never evicted; drafters that read target
features prefill every prompt token; the server counts hits; the draft model drafts a step's sequences in one
ragged forward and stays lossless at concurrency."""

import httpx
import pytest
import torch
from test_scheduler import _run

import specdec
from specdec.drafters.base import Draft, Drafter
from specdec.engine.load_control import LoadController
from specdec.engine.scheduler import Request, Scheduler
from specdec.runtime.prefix_cache import BLOCK, PrefixCache
from specdec.runtime.runner import FeatureSpec
from specdec.sampling import SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.serve import ServerThread

DOC = " ".join(f"t{(i * 7) % 90 + 3}" for i in range(70))  # a shared 70-token "document"
PROMPTS = [DOC + " t5 t6", DOC + " t8 t9 t10", DOC + " t5 t6 t44 t45", "t11 t12 t13", DOC[:200] + " t2"]


def _fake_kv(start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One layer of K/V [1 kv_head, end - start, 4] holding the positions (1 KiB per block of 16 in all)."""
    x = torch.arange(start, end, dtype=torch.float32)[None, :, None].expand(1, end - start, 4).clone()
    return [x], [x.clone()]


BLOCK_BYTES = 2 * BLOCK * 4 * 4


def test_budget_lru_and_refcounts():
    cache = PrefixCache(budget=6 * BLOCK_BYTES)
    a, b = list(range(100, 164)), list(range(200, 264))  # 4 blocks each
    assert cache.insert(a, "t", _fake_kv) == 4
    held = cache.lookup(a, "t", limit=len(a) - 1)  # the last token is never reused: 3 blocks
    assert len(held) == 3 and held[1].kv["t"][0][0][0, 5, 0] == 21
    assert cache.insert(b, "t", _fake_kv) == 3  # a's 4th block evicted; the held chain and b's parents stay
    assert cache.used == cache.budget and cache.evicted == 1
    assert [blk.tokens[0] for blk in cache.blocks.values()] == [100, 116, 132, 200, 216, 232]
    cache.release(held[-1])
    assert cache.insert(b, "t", _fake_kv) == 4  # now a's released leaf goes
    assert cache.lookup(b, "t", 64)[-1].tokens[0] == 248 and len(cache.lookup(a, "t", 64)) == 2
    assert cache.used <= cache.budget and cache.evicted == 2
    st = cache.stats["t"]
    assert (st.lookups, st.hits, st.tokens_saved) == (3, 3, (3 + 4 + 2) * BLOCK)


def test_salts_keep_prefixes_apart_and_parents_outlive_children():
    cache = PrefixCache(budget=3 * BLOCK_BYTES)
    toks = list(range(48))
    cache.insert(toks, "t", _fake_kv, salt=1)
    assert cache.lookup(toks, "t", 48, salt=2) == []
    held = cache.lookup(toks, "t", 48, salt=1)
    assert len(held) == 3
    cache.release(held[-1])
    assert cache.insert(list(range(500, 516)), "t", _fake_kv) == 1  # room from the leaf, never a parent
    assert len(cache.lookup(toks, "t", 48, salt=1)) == 2


def _tiny_llm(tiny_dir, **kw):
    llm = specdec.LLM(
        str(tiny_dir("llama")),
        draft=str(tiny_dir("llama", seed=1, layers=1)),
        spec_type="none",
        dtype="fp32",
        context=128,
        progress=False,
        **kw,
    )
    llm.engine.stop_ids = set()
    return llm


@pytest.mark.parametrize("spec", ["none", "draft", "suffix", "suffix-tree"])
def test_tiny_greedy_equal_with_and_without_the_cache(tiny_dir, spec):
    fixed = dict(adaptive=False)  # the draft model drafts on every prompt (the setup rule could skip short ones)
    plain, cached = _tiny_llm(tiny_dir, **fixed), _tiny_llm(tiny_dir, cache_mb=1, draft_branch_p=0.3, **fixed)
    plain_tree = _tiny_llm(tiny_dir, draft_branch_p=0.3, **fixed)
    drafted = accepted = 0
    for p in PROMPTS + PROMPTS[:2]:
        ref = (plain_tree if spec == "draft" else plain).generate(p, max_tokens=24, spec_type=spec).token_ids
        r = cached.generate(p, max_tokens=24, spec_type=spec)
        assert r.token_ids == ref, p
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    # accepted not asserted for the draft model: a random one (seed 1) is right by chance alone
    assert spec == "none" or (drafted > 0 and (accepted > 0 or spec == "draft")), (drafted, accepted)
    st = cached.prefix_cache.stats["target"]
    assert st.hits >= 5 and st.tokens_saved >= 4 * 4 * BLOCK
    if spec == "draft":
        assert cached.prefix_cache.stats["draft"].hits >= 3
    assert all(
        b.refs == sum(c.parent is b for c in cached.prefix_cache.blocks.values())
        for b in cached.prefix_cache.blocks.values()
    )  # nothing held once every sequence ended


def test_tiny_eviction_keeps_the_budget_and_the_output(tiny_dir):
    plain, cached = _tiny_llm(tiny_dir), _tiny_llm(tiny_dir, cache_mb=1)
    per_block = 2 * 2 * 2 * BLOCK * 16 * 4  # k and v, 2 layers, 2 kv heads, head_dim 16, fp32
    cached.prefix_cache.budget = 5 * per_block
    for i in range(6):
        p = " ".join(f"t{(i * 13 + j * 5) % 90 + 3}" for j in range(40))
        for _ in range(2):
            assert cached.generate(p, max_tokens=8).token_ids == plain.generate(p, max_tokens=8).token_ids
            assert cached.prefix_cache.used <= cached.prefix_cache.budget
    assert cached.prefix_cache.evicted > 0 and cached.prefix_cache.stats["target"].hits >= 6


class _Reader(Drafter):
    """Drafts nothing; counts the target feature rows it is handed (a stand-in for EAGLE-3 / MTP / Medusa)."""

    name = "reader"
    features = FeatureSpec(())

    def __init__(self):
        self.rows = 0

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        return Draft([])

    def observe_features(self, seq, feats):
        self.rows += len(feats)


def test_feature_drafters_prefill_every_prompt_token(tiny_dir):
    llm = _tiny_llm(tiny_dir, cache_mb=1)
    llm.generate(PROMPTS[0], max_tokens=4)
    reader = _Reader()
    seq = llm.engine.generate(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=1), drafter=reader)
    assert reader.rows == seq.prompt_len and seq.cached_tokens == 0
    assert llm.prefix_cache.stats["target"].hits == 0


def test_tiny_batched_drafting_at_concurrency_is_lossless(tiny_dir):
    """4 slots, draft model (with trees) and suffix-tree, prompts sharing a prefix: the plain outputs; the draft
    model's forwards batch several sequences; the cache is hit by later requests, also for the draft model."""
    plain = _tiny_llm(tiny_dir)
    # fixed draft lengths: adaptive ones soon stop drafting with the random draft model (seldom accepted)
    llm = _tiny_llm(tiny_dir, cache_mb=1, parallel=4, draft_branch_p=0.3, adaptive=False)
    prompts = PROMPTS * 2
    specs = ["draft", "draft", "suffix-tree", "draft", "none", "draft", "draft", "suffix-tree", "draft", "draft"]
    bases = [plain.generate(p, max_tokens=20).token_ids for p in prompts]
    runner = llm.drafter_for("draft").runner
    batches, forward = [], runner.forward
    runner.forward = lambda chunks, *a, **k: batches.append(len(chunks)) or forward(chunks, *a, **k)
    sched = Scheduler(llm.engine, 4, controller=None, prefill_chunk=24)
    reqs = [Request(llm.encode(p), SamplingParams(max_tokens=20), llm.drafter_for(s)) for p, s in zip(prompts, specs)]
    _run(sched, reqs)
    assert [r.seq.output_ids for r in reqs] == bases
    stats = {s: [0, 0] for s in specs}  # spec -> [drafted, accepted]
    for s, r in zip(specs, reqs):
        stats[s][0] += r.seq.stats.drafted
        stats[s][1] += r.seq.stats.accepted
    # the draft model: drafted only, a random one (seed 1) is right by chance alone
    assert stats["draft"][0] > 0 and min(stats["suffix-tree"]) > 0, stats
    assert max(batches) >= 3
    assert sum(r.seq.cached_tokens for r in reqs) >= 4 * 4 * BLOCK
    assert llm.prefix_cache.stats["draft"].hits >= 1


def test_load_controller_predicts_batched_drafting_from_its_measured_costs():
    from specdec.engine.engine import StepInfo

    lc = LoadController(8)
    for b, draft_s in ((1, 0.010), (4, 0.016)):  # batched drafting: 4 sequences cost 1.6x one
        for _ in range(3):
            lc.observe(None, StepInfo(b, 3 * b, 4 * b, 5 * b, 0.02 * b, draft_s, 0.02 * b + draft_s), b)
    parts = lc.parts[None]
    assert parts.draft_cost(4) == pytest.approx(0.016) and parts.draft_cost(2) == pytest.approx(0.012)
    assert parts.draft_cost(8) == pytest.approx(0.032)  # proportional beyond the largest measured batch


def test_server_counts_hits_and_cache_prompt_false_skips_the_cache(tiny_dir):
    llm = _tiny_llm(tiny_dir, cache_mb=1, parallel=2)
    sched = Scheduler(llm.engine, 2)
    srv = ServerThread(create_app(llm, sched, ServerConfig("m", SamplingParams(max_tokens=8), ())))
    try:

        def ask(**extra):
            r = httpx.post(
                srv.url + "/v1/completions",
                timeout=60,
                json={"prompt": DOC + " t5", "max_tokens": 4, "temperature": 0, **extra},
            )
            assert r.status_code == 200, r.text
            return r.json()

        first, second, off = ask(), ask(), ask(cache_prompt=False)
        assert first["choices"][0]["text"] == second["choices"][0]["text"] == off["choices"][0]["text"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
        assert second["timings"]["cache_n"] == 4 * BLOCK and off["timings"]["cache_n"] == 0
        text = httpx.get(srv.url + "/metrics").text
        assert 'specdec_prefix_cache_hits_total{model="target"} 1' in text
        assert f'specdec_prefix_cache_tokens_saved_total{{model="target"}} {4 * BLOCK}' in text
        assert "specdec_prefix_cache_budget_bytes 1048576" in text
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "t1", "cache_prompt": 1}).status_code == 400
    finally:
        srv.close()


@pytest.mark.real
def test_smollm_greedy_equal_with_and_without_the_cache(smollm_dir):
    kw = dict(
        draft=str(smollm_dir),
        draft_quant="int8",
        dtype="fp32",
        context=384,
        progress=False,
        adaptive=False,
        draft_max=4,
    )
    plain = specdec.LLM(str(smollm_dir), spec_type="none", **kw)
    cached = specdec.LLM(str(smollm_dir), spec_type="none", cache_mb=64, **kw)
    plain.engine.stop_ids = cached.engine.stop_ids = set()  # every answer runs its 12 tokens
    doc = (
        "The Hubble Space Telescope was launched into low Earth orbit in 1990 and remains in operation. It was "
        "not the first space telescope, but it is one of the largest and most versatile, renowned both as a vital "
        "research tool and as a public relations boon for astronomy. "
    )
    questions = ["When was it launched?", "Is it still working?", "Why is it famous?"]
    for spec in ("none", "draft", "suffix-tree"):
        drafted = accepted = 0
        for q in questions:
            p = f"{doc}\nQuestion: {q}\nAnswer:"
            ref = plain.generate(p, max_tokens=12, spec_type=spec).token_ids
            r = cached.generate(p, max_tokens=12, spec_type=spec)
            assert r.token_ids == ref, (spec, q)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
        assert spec == "none" or (drafted > 0 and accepted > 0), (spec, drafted, accepted)
    assert cached.prefix_cache.stats["target"].hits >= 8
    assert cached.prefix_cache.stats["draft"].hits >= 2


@pytest.mark.real
def test_bench_serve_rag_and_multi_turn_with_and_without_the_cache(smollm_dir, tmp_path):
    import json

    from specdec.cli import main

    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"id": "c", "category": "chat", "turns": ["Say hi.", "Say bye."]}) + "\n")
    out = tmp_path / "serve"
    assert (
        main(
            [
                "bench",
                "serve",
                "-m",
                str(smollm_dir),
                "--dtype",
                "fp32",
                "-c",
                "1024",
                "--spec-type",
                "suffix",
                "--concurrency",
                "1",
                "--requests",
                "2",
                "-n",
                "3",
                "--workload",
                f"rag,{work}",
                "--per-category",
                "1",
                "--modes",
                "on,on-nocache",
                "--cache-mb",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    runs = {r["mode"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    reqs = runs["on"]["requests"]
    assert [(r["index"], r["turn"]) for r in reqs] == [(0, 0), (1, 0), (1, 1)] and runs["on"]["errors"] == 0
    assert reqs[2]["cached_tokens"] >= BLOCK and runs["on-nocache"]["cached_tokens"] == 0
    assert "on TTFT nocache/cache" in (out / "report.md").read_text()


def test_plan_counts_the_cache_budget(tiny_dir):
    from specdec.plan import PlanInputs, make_plan

    def ram(mb: int) -> int:
        p = make_plan(PlanInputs(model=str(tiny_dir("llama")), gpu="none", ram="16GiB", cache_mb=mb, spec_type="none"))
        return p.chosen.ram_need

    assert ram(256) - ram(0) == 256 << 20


@pytest.mark.real
def test_soak_with_a_small_cache_stays_in_budget_and_lossless(smollm_dir, tmp_path):
    from specdec.bench import soak

    report = soak.run(str(smollm_dir), requests=48, concurrency=8, parallel=4, cache_mb=1, sample_s=2.0, minutes=2)
    assert report.ok(rss_limit_mb=64.0), report.problems
    assert report.compared > 0 and len(report.samples) >= 2 and max(c for _, _, c in report.samples) > 0
    soak.write_samples(report, tmp_path / "rss.csv")
    assert (tmp_path / "rss.png").exists() and len((tmp_path / "rss.csv").read_text().splitlines()) > 2


def test_server_keys_do_not_share_cached_prefixes(tiny_dir):
    llm = _tiny_llm(tiny_dir, cache_mb=1)
    srv = ServerThread(
        create_app(llm, Scheduler(llm.engine, 1), ServerConfig("m", SamplingParams(max_tokens=4), ("key-a", "key-b")))
    )
    try:

        def cached(key: str) -> int:
            r = httpx.post(
                srv.url + "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
                json={"prompt": DOC, "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached("key-a"), cached("key-b"), cached("key-a"), cached("key-b")] == [0, 0, 4 * BLOCK, 4 * BLOCK]
    finally:
        srv.close()
