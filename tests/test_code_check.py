"""`specdec bench relaxed`: HumanEval completions at relaxed-acceptance thresholds, scored by the tests."""

import json

import pytest

from specdec.bench.code_check import Problem, agreement, load_problems, passes


def test_agreement_and_tests():
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert agreement([1, 2], [1, 2, 3]) == 1.0 and agreement([], []) == 1.0
    p = Problem("t/0", "def add(a, b):\n", "def check(f):\n    assert f(2, 3) == 5\n", "add")
    assert passes(p, "    return a + b\n")
    assert not passes(p, "    return a - b\n")


def test_humaneval_from_its_wheel():
    problems = load_problems(3, progress=False)
    assert [p.task_id for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all("def check" in p.test and p.entry_point in p.prompt for p in problems)


@pytest.mark.real
def test_bench_relaxed_end_to_end(smollm_dir, tmp_path):
    from test_cli import run

    res = run(
        "bench",
        "relaxed",
        "-m",
        str(smollm_dir),
        "-md",
        str(smollm_dir),
        "--dtype",
        "fp32",
        "--problems",
        "2",
        "-n",
        "24",
        "--thresholds",
        "0.5",
        "--spec-adaptive",
        "off",
        "--draft-max",
        "4",
        "--out",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["spec_type"], r["threshold"]) for r in rows] == [("none", 0.0), ("draft", 0.0), ("draft", 0.5)]
    assert rows[1]["identical"] == 2 and rows[1]["agreement"] == 1.0  # threshold 0: lossless
    assert all(not r["lossless"] for r in rows[2]["runs"])
    assert (tmp_path / "report.html").exists() and (tmp_path / "relaxed.png").exists()
