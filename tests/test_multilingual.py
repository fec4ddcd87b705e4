"""`specdec bench --workload multilingual`: the same questions in several languages, one category per language."""

import json
from collections import defaultdict

import pytest
import torch

from specdec.bench.workloads import ML_LANGUAGES, load_workload
from specdec.cli import main


def by_language(prompts) -> dict[str, list[str]]:
    """{language: question keys (the id without its language suffix), in workload order}."""
    out = defaultdict(list)
    for p in prompts:
        key, lang = p.id.rsplit("-", 1)
        assert lang == p.category
        out[lang].append(key)
    return dict(out)


def test_the_same_questions_in_every_language():
    prompts = load_workload("multilingual")
    keys = by_language(prompts)
    assert list(keys) == list(ML_LANGUAGES) == ["en", "de", "nl", "it", "ja", "ko"]
    assert all(k == keys["en"] for k in keys.values()) and len(keys["en"]) == 21
    text = {p.id: p.turns[0] for p in prompts}
    assert len(set(text.values())) == len(text)  # every question once per language, each language its own text
    assert [text[f"history-2-{lang}"] for lang in ML_LANGUAGES] == [
        "What is history?",
        "Was ist Geschichte?",
        "Wat is geschiedenis?",
        "Cosa è la storia?",
        "歴史とは何ですか？",
        "역사가 뭐니?",
    ]
    assert (
        text["food-8-nl"] == "Kan een robot dronken worden?" and text["food-8-de"] == "Kann ein Roboter sich betrinken?"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_per_category_samples_the_same_questions_in_every_language(seed):
    keys = by_language(load_workload("multilingual", per_category=3, seed=seed))
    assert len(keys) == len(ML_LANGUAGES) and all(k == keys["en"] for k in keys.values()) and len(keys["en"]) == 3
    assert by_language(load_workload("multilingual", per_category=3, seed=seed)) == keys  # deterministic
    some = by_language(load_workload("multilingual", per_category=3, seed=seed, categories=["nl", "en"]))
    assert some == {"en": keys["en"], "nl": keys["en"]}  # filtered after sampling: the same questions


def test_seeds_draw_different_questions():
    draws = {tuple(by_language(load_workload("multilingual", per_category=3, seed=s))["en"]) for s in range(4)}
    assert len(draws) > 1


@pytest.mark.real
def test_bench_multilingual_end_to_end(smollm_dir, tmp_path, capsys):
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "bench",
                    "-m",
                    str(smollm_dir),
                    "-md",
                    str(smollm_dir),
                    "--dtype",
                    "fp32",
                    "-t",
                    "1",
                    "-n",
                    "8",
                    "--workload",
                    "multilingual",
                    "--per-category",
                    "1",
                    "--methods",
                    "none,ngram-simple,draft",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    res = json.loads((out / "results.json").read_text())
    assert len(res["runs"]) == len(ML_LANGUAGES) * 3
    assert all(r["matches_baseline"] is True for r in res["runs"])  # fp32: lossless in every language
    for method, per in res["summary"].items():
        assert list(per) == list(ML_LANGUAGES) + ["all"], method
    assert all(res["summary"]["draft"][lang]["mean_accept_len"] >= 1 for lang in ML_LANGUAGES)
    header = "| method | " + " | ".join(ML_LANGUAGES) + " | all |"  # one column per language
    for title in ("Speedup by category", "Mean acceptance length by category"):
        assert (out / "report.md").read_text().split(f"## {title}")[1].split("\n")[2] == header
    assert "## Speedup by category" in capsys.readouterr().out
