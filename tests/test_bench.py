"""`specdec bench`: workloads, baseline checks, summary, llama-server command lines, and a small real run."""

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from specdec.bench.llama import Llama, ServerConfig, llama_methods, server_command
from specdec.bench.methods import Method, Output, merge
from specdec.bench.report import Outcomes, html_page, report_tables, summarize
from specdec.bench.runner import ceiling, compare_to_baselines, parse_methods
from specdec.bench.workloads import SPEC_BENCH_DIR, load_workload
from specdec.cli import main, make_parser
from specdec.errors import SpecdecError

SPEC_BENCH_TASKS = {"multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag"}
PNGS = ("speedup.png", "accept_len.png", "acceptance_by_position.png", "tokens_per_s.png")
RUN_KEYS = {
    "id",
    "category",
    "method",
    "new_tokens",
    "seconds",
    "tokens_per_s",
    "target_forwards",
    "verify_steps",
    "drafted",
    "accepted",
    "mean_accept_len",
    "per_position_acceptance",
    "prefill_s",
    "draft_s",
    "verify_s",
    "peak_rss_mb",
    "matches_baseline",
    "first_divergence",
}
SUMMARY_KEYS = {"speedup", "speedup_vs_hf_plain", "tokens_per_s", "acceptance_rate", "mean_accept_len"}


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.real
def test_bench_end_to_end(smollm_dir, tmp_path, capsys):
    work = write_jsonl(
        tmp_path / "w.jsonl",
        [
            {
                "id": "s1",
                "category": "summarization",
                "prompt": "Summarize: The cat sat on the mat. It slept.",
                "max_tokens": 8,
            },
            {"id": "m1", "category": "multi_turn", "turns": ["Name a fruit.", "Now name a vegetable."]},
        ],
    )
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:  # one thread: steadier on a shared 2-core machine
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
                    "--max-tokens",
                    "8",
                    "--workload",
                    str(work),
                    "--methods",
                    "none,ngram-simple,draft,hf-plain",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    res = json.loads((out / "results.json").read_text())
    runs = res["runs"]
    assert len(runs) == 2 * 4
    for r in runs:
        assert RUN_KEYS <= set(r)
        assert 0 < r["new_tokens"] <= (16 if r["id"] == "m1" else 8)  # two turns of at most 8
        assert r["matches_baseline"] is True and r["first_divergence"] is None  # fp32: lossless
    assert {m: set(per) for m, per in res["summary"].items()} == {
        m: {"summarization", "multi_turn", "all"} for m in ("none", "ngram-simple", "draft", "hf-plain")
    }
    assert all(SUMMARY_KEYS <= set(e) for per in res["summary"].values() for e in per.values())
    assert res["summary"]["none"]["all"]["speedup"] == 1.0
    assert res["summary"]["none"]["all"]["speedup_ceiling"] >= 1.0
    assert all(r["ceiling_tokens_per_s"] for r in runs if r["method"] == "none")
    assert res["summary"]["hf-plain"]["all"]["speedup"] == res["summary"]["hf-plain"]["all"]["speedup_vs_hf_plain"] == 1
    assert res["summary"]["draft"]["all"]["mean_accept_len"] >= 1
    assert {"command", "date", "machine", "versions", "dtype", "threads", "models"} <= set(res["meta"])
    assert res["meta"]["cache_mb"] == 0  # no prefix cache: a later method would skip the prefill of a prompt
    report = (out / "report.md").read_text()
    assert "## All prompts" in report and "| ngram-simple |" in report
    page = (out / "report.html").read_text()
    assert "<h2>All prompts</h2>" in page and "<td>ngram-simple</td>" in page
    assert page.count('src="data:image/png;base64,') == len(PNGS)
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Speedup by category" in capsys.readouterr().out


def test_report_html_has_the_tables_lists_and_embedded_plots(tmp_path):
    (tmp_path / "speedup.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    md = (
        "# specdec bench\n\n`specdec bench -m x`\n\n## All prompts\n\n| method | tok/s |\n|---|---|\n"
        "| none | 1.00 |\n| draft <b> | 2.50x |\n\n## Notes\n\n- a **LIKELY BUG**\n\n## Plots\n\n"
        "![speedup.png](speedup.png)\n![gone.png](gone.png)\n"
    )
    page = html_page(md, tmp_path)
    assert "<title>specdec bench</title>" in page and "<p><code>specdec bench -m x</code></p>" in page
    assert "<thead><tr><th>method</th><th>tok/s</th></tr></thead>" in page
    assert "<tr><td>draft &lt;b&gt;</td><td>2.50x</td></tr>" in page  # escaped
    assert "<ul><li>a <strong>LIKELY BUG</strong></li></ul>" in page
    assert 'src="data:image/png;base64,iVBORw0KGgpmYWtl"' in page and 'src="gone.png"' in page


@pytest.mark.parametrize(
    "line,needle",
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "not a JSON object"),
        ('{"id": "b", "prompt": "hi"}', "needs 'category'"),
        ('{"id": "b", "category": "c"}', "exactly one of 'prompt' or 'turns'"),
        ('{"id": "b", "category": "c", "turns": []}', "non-empty list"),
        ('{"id": "b", "category": "c", "prompt": "hi", "max_tokens": 0}', "'max_tokens' must be a positive integer"),
        ('{"id": "a", "category": "c", "prompt": "again"}', "duplicate id 'a'"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, line, needle):
    path = write_jsonl(tmp_path / "w.jsonl", [{"id": "a", "category": "c", "prompt": "hi"}, "", line])
    with pytest.raises(SpecdecError, match=rf"w\.jsonl:3: .*{needle}"):
        load_workload(str(path))


def test_malformed_workload_cli_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "category": "c", "prompt": "hi"}, '{"id": "b"}'])
    res = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--workload", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{path}:2:" in lines[0], res.stderr


def test_jsonl_prompts_and_limits(tmp_path):
    path = write_jsonl(
        tmp_path / "w.jsonl",
        [
            {"id": 7, "category": "c", "prompt": "hi", "max_tokens": 64},
            {"id": "t", "category": "d", "turns": ["a", "b"]},
        ],
    )
    p, t = load_workload(str(path))
    assert (p.id, p.turns, t.turns) == ("7", ("hi",), ("a", "b"))
    assert (p.limit(None), p.limit(16), p.limit(100)) == (64, 16, 64)
    assert (t.limit(None), t.limit(256)) == (128, 256)


@pytest.mark.skipif(not (SPEC_BENCH_DIR / "question.jsonl").exists(), reason="no Spec-Bench workload in ../shared")
def test_spec_bench_per_category():
    prompts = load_workload("spec_bench", per_category=1, seed=0)
    assert len(prompts) == 6 and {p.category for p in prompts} == SPEC_BENCH_TASKS
    assert [len(p.turns) for p in prompts if p.category == "multi_turn"] == [2]
    assert load_workload("spec_bench", per_category=1, seed=0) == prompts  # fixed seed, same sample
    assert len(load_workload("spec_bench")) == 480
    assert len(load_workload("spec_bench", per_category=3, seed=1)) == 18
    two = load_workload("spec_bench", per_category=2, seed=0, categories=["summarization", "rag"])
    every = load_workload("spec_bench", per_category=2, seed=0)
    assert two == [p for p in every if p.category in ("summarization", "rag")]  # the same questions


def test_workload_categories_filter():
    assert [p.id for p in load_workload("quick", categories=["summary", "code-edit"])] == ["code-edit", "summary"]
    with pytest.raises(SpecdecError, match="no prompts in category qa .this workload has: code-question"):
        load_workload("quick", categories=["qa"])


def test_several_workloads(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "category": "c", "prompt": "hi"} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "b1", "category": "d", "prompt": "yo"}])
    both = load_workload(f"quick, {a},{b}", per_category=2, seed=0)
    assert both[:3] == load_workload("quick") and both[3:5] == load_workload(str(a), per_category=2, seed=0)
    assert [p.id for p in load_workload(f"quick,{b}", categories=["d", "summary"])] == ["summary", "b1"]
    with pytest.raises(SpecdecError, match="prompt ids a0, a1, a2 occur in more than one workload"):
        load_workload(f"{a},{a}")
    with pytest.raises(SpecdecError, match="no workload named"):
        load_workload(" , ")


def test_ceiling_packs_plain_forwards():
    # 2 s prefill, 20 decode forwards of 0.1 s (+1 prefill forward), 21 tokens; draft_max 4 -> 4 forwards
    plain = Output(list(range(21)), 4.0, target_forwards=21, prefill_s=2.0)
    assert ceiling(plain, 1, 4) == pytest.approx(21 / (2.0 + 4 * 0.1))
    assert ceiling(plain, 1, 0) == pytest.approx(21 / 4.0)  # no drafts: the plain run itself
    assert ceiling(Output([1], 1.0), 1, 4) is None  # transformers: no prefill time


def test_cli_workload_and_methods():
    a = make_parser().parse_args(["bench", "--quick", "-n", "4"])
    assert (a.workload, a.max_tokens) == ("quick", 4)
    assert [p.category for p in load_workload("quick")] == ["code-question", "code-edit", "summary"]
    assert parse_methods(" none, hf-pld,none,ngram-simple+draft ") == ["none", "hf-pld", "ngram-simple+draft"]
    assert "llama-ngram-mod" in parse_methods("all") and "llama-eagle3" not in parse_methods("all")
    for bad in ("none,magic", "draft+magic", ""):
        with pytest.raises(SpecdecError, match="unknown bench method"):
            parse_methods(bad)


class _M(Method):
    def __init__(self, name, baseline):
        self.name, self.baseline = name, baseline


def test_compare_to_baselines_flags_real_divergences():
    none, draft, hf = _M("none", "none"), _M("draft", "none"), _M("hf-pld", "hf-plain")
    base = Output([1, 2, 3, 4], 1.0, top2_gaps=[3.0, 0.1, 2.0, 1.0])
    done = [
        (none, {"id": "p", "repeat": 0}, base),
        (draft, {"id": "p", "repeat": 0}, Output([1, 9, 3], 1.0)),  # near-tie at index 1: rounding
        (draft, {"id": "p", "repeat": 1}, Output([1, 2, 5, 4], 1.0)),  # gap 2.0 at index 2: a bug
        (hf, {"id": "p", "repeat": 0}, Output([1, 2], 1.0)),
    ]  # no hf-plain run: no baseline
    warnings = compare_to_baselines(done)
    recs = [rec for _, rec, _ in done]
    assert [r.get("matches_baseline") for r in recs] == [True, False, False, None]
    assert recs[1]["first_divergence"] == {"index": 1, "top2_gap": 0.1}
    assert recs[2]["first_divergence"] == {"index": 2, "top2_gap": 2.0}
    assert len(warnings) == 1 and "LIKELY BUG" in warnings[0] and "token 2" in warnings[0]


def test_merge_turns():
    a = Output([1, 2], 1.0, [0.5, 0.5], 2, 3, 1, 0.1, 0.2, 0.3, [2, 1], [1, 0], peak_rss_mb=10)
    b = Output([3], 0.5, [0.1], 1, 1, 1, 0.1, 0.0, 0.1, [1], [1], peak_rss_mb=12)
    m = merge([a, b])
    assert (m.tokens, m.seconds, m.drafted, m.drafted_at, m.accepted_at, m.peak_rss_mb) == (
        [1, 2, 3],
        1.5,
        4,
        [3, 1],
        [2, 0],
        12,
    )
    assert merge([Output([1], 1.0), b]).drafted is None


def _run(method, pid, cat, tps, repeat=0, first_seen=True, **kw):
    return {
        "method": method,
        "id": pid,
        "category": cat,
        "tokens_per_s": tps,
        "repeat": repeat,
        "baseline": {"hf-plain": "hf-plain", "hf-pld": "hf-plain"}.get(method, "none"),
        "first_seen": first_seen,
        "new_tokens": 10,
        "drafted": kw.get("drafted"),
        "accepted": kw.get("accepted"),
        "target_forwards": kw.get("forwards"),
        "verify_steps": None if kw.get("forwards") is None else kw["forwards"] - 1,  # one turn: one prefill
        "drafted_at": kw.get("drafted_at"),
        "accepted_at": kw.get("accepted_at"),
        "matches_baseline": True,
        "decode_tokens_per_s": kw.get("decode"),
        "ceiling_tokens_per_s": kw.get("ceiling"),
    }


def test_summary_spec_bench_style():
    recs = [
        _run(
            "none",
            "1",
            "qa",
            10,
            forwards=10,
            drafted=0,
            accepted=0,
            drafted_at=[],
            accepted_at=[],
            decode=12,
            ceiling=40,
        ),
        _run(
            "none",
            "2",
            "rag",
            20,
            forwards=10,
            drafted=0,
            accepted=0,
            drafted_at=[],
            accepted_at=[],
            decode=28,
            ceiling=50,
        ),
        _run(
            "draft", "1", "qa", 20, forwards=5, drafted=10, accepted=5, drafted_at=[5, 5], accepted_at=[4, 1], decode=30
        ),
        _run(
            "draft",
            "2",
            "rag",
            30,
            forwards=5,
            drafted=10,
            accepted=5,
            drafted_at=[5, 5],
            accepted_at=[4, 1],
            decode=50,
        ),
        _run("draft", "2", "rag", 50, repeat=1, first_seen=False),  # not first-seen: left out
        _run("hf-plain", "1", "qa", 5),
        _run("hf-pld", "1", "qa", 10),
    ]
    s = summarize(recs, ["none", "draft", "hf-plain", "hf-pld"])
    assert s["draft"]["all"]["speedup"] == round(25 / 15, 4)  # ratio of mean tok/s on the same prompts
    assert s["draft"]["qa"]["speedup"] == 2.0 and s["draft"]["qa"]["speedup_vs_hf_plain"] == 4.0
    assert s["draft"]["all"]["speedup_vs_hf_plain"] == 4.0  # only prompt 1 has an hf-plain run
    # mean acceptance length: 1 + 10 accepted / 8 verify steps
    assert s["draft"]["all"]["acceptance_rate"] == 0.5 and s["draft"]["all"]["mean_accept_len"] == 2.25
    assert s["draft"]["all"]["per_position_acceptance"] == [0.8, 0.2]
    assert s["none"]["all"]["acceptance_rate"] is None and s["hf-plain"]["all"]["mean_accept_len"] is None
    assert set(s["hf-plain"]) == {"qa", "all"}
    assert s["hf-pld"]["all"]["speedup"] == 2.0  # over its own engine's plain decoding, hf-plain
    assert s["draft"]["all"]["decode_speedup"] == 2.0  # (30 + 50) / (12 + 28): prefill left out
    assert s["hf-pld"]["all"]["decode_speedup"] is None  # transformers does not report its prefill
    assert (s["none"]["qa"]["speedup_ceiling"], s["none"]["all"]["speedup_ceiling"]) == (4.0, 3.0)  # 90 / 30
    assert s["draft"]["all"]["speedup_ceiling"] is None
    assert "| ceiling: every draft accepted | 4.00x | 2.50x | 3.00x |" in report_tables(s, recs, Outcomes())


NEW_HELP = """
-md,   --model-draft FNAME     draft model
--spec-type [none|draft-simple|draft-eagle3|ngram-simple|ngram-map-k|ngram-map-k4v|ngram-mod|ngram-cache]
--spec-draft-n-max N           number of tokens to draft (default: 16)
--spec-draft-n-min N           minimum number of draft tokens (default: 0)
--spec-draft-p-min P           minimum speculative decoding probability (default: 0.75)
--spec-ngram-simple-size-n N   ngram-simple: lookup n-gram length
--spec-ngram-simple-size-m N   ngram-simple: draft length
--spec-ngram-map-k-size-n N    ngram-map-k: lookup n-gram length
--spec-ngram-map-k-size-m N    ngram-map-k: draft length
"""
OLD_HELP = """
-md,   --model-draft FNAME     draft model
--draft-max, --draft, --draft-n N   number of tokens to draft (default: 16)
--draft-min, --draft-n-min N        minimum number of draft tokens (default: 0)
--draft-p-min P                     minimum speculative decoding probability (default: 0.8)
"""


def _cfg(draft="d.gguf"):
    return ServerConfig("/bin/llama-server", "t.gguf", draft, 2, 4096, 0.0, 16, 0, 0.0, 3, 16)


def test_llama_server_command():
    base = [
        "/bin/llama-server",
        "-m",
        "t.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "8080",
        "-c",
        "4096",
        "-np",
        "1",
        "-t",
        "2",
        "-tb",
        "2",
        "--temp",
        "0.0",
    ]
    draft_args = ["--spec-draft-n-max", "16", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.0"]
    assert server_command("llama-none", _cfg(), NEW_HELP, 8080) == base
    assert (
        server_command("llama-draft", _cfg(), NEW_HELP, 8080)
        == base + ["-md", "d.gguf", "--spec-type", "draft-simple"] + draft_args
    )
    assert server_command("llama-ngram-simple", _cfg(), NEW_HELP, 8080) == base + [
        "--spec-type",
        "ngram-simple",
    ] + draft_args + ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"]
    assert server_command("llama-ngram-map-k", _cfg(), NEW_HELP, 8080) == base + [
        "--spec-type",
        "ngram-map-k",
    ] + draft_args + ["--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "16"]
    assert (
        server_command("llama-ngram-map-k4v", _cfg(), NEW_HELP, 8080)
        == base + ["--spec-type", "ngram-map-k4v"] + draft_args
    )  # this help lists no k4v sizes
    # an older server: -md alone selects the draft model, the counts have their old names, no n-gram types
    assert server_command("llama-draft", _cfg(), OLD_HELP, 8080) == base + [
        "-md",
        "d.gguf",
        "--draft-max",
        "16",
        "--draft-min",
        "0",
        "--draft-p-min",
        "0.0",
    ]
    with pytest.raises(SpecdecError, match="no --spec-type ngram-mod"):
        server_command("llama-ngram-mod", _cfg(), OLD_HELP, 8080)
    with pytest.raises(SpecdecError, match="needs the draft model as a GGUF"):
        server_command("llama-draft", _cfg(draft=None), NEW_HELP, 8080)
    eagle3 = dataclasses.replace(_cfg(), eagle3_gguf="h.gguf")
    assert (
        server_command("llama-eagle3", eagle3, NEW_HELP, 8080)
        == base + ["-md", "h.gguf", "--spec-type", "draft-eagle3"] + draft_args
    )
    with pytest.raises(SpecdecError, match="needs an EAGLE-3 head"):
        server_command("llama-eagle3", _cfg(), NEW_HELP, 8080)
    with pytest.raises(SpecdecError, match="no --spec-type draft-eagle3"):
        server_command("llama-eagle3", eagle3, OLD_HELP, 8080)


def test_llama_methods_skipped_without_binary(tmp_path):
    outcomes = Outcomes()
    a = argparse.Namespace(llama_server=None)
    assert llama_methods(["llama-none", "llama-draft"], a, 4096, set(), tmp_path, outcomes, {}) == []
    assert outcomes.skipped == dict.fromkeys(["llama-none", "llama-draft"], "no --llama-server PATH given")
    assert outcomes.failed == {} and outcomes.notes == []


@pytest.mark.real
def test_bench_serve_sweep(smollm_dir, tmp_path, capsys):
    work = write_jsonl(
        tmp_path / "w.jsonl",
        [
            {"id": "a", "category": "code", "prompt": "Write 1, 2, 3, 4.", "max_tokens": 3},
            {"id": "b", "category": "chat", "prompt": "Say hi."},
        ],
    )
    out = tmp_path / "serve"
    assert (
        main(
            [
                "bench",
                "serve",
                "-m",
                str(smollm_dir),
                "-md",
                str(smollm_dir),
                "--dtype",
                "fp32",
                "-c",
                "256",
                "--concurrency",
                "1,2",
                "--requests",
                "2",
                "-n",
                "6",
                "--workload",
                str(work),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())
    order = ("off", "on", "auto", "auto", "on", "off")  # two passes by default, the second reversed
    assert [(r["concurrency"], r["mode"], r["pass"]) for r in res["runs"]] == [
        (c, m, i // 3) for c in (1, 2) for i, m in enumerate(order)
    ]
    for r in res["runs"]:
        # a: the workload's 3 tokens, b: -n 6
        assert r["errors"] == 0 and 0 < r["tokens"] <= 9 and r["throughput_tok_s"] > 0 and r["ttft_s"] > 0
        # the engine's time split: decode steps are faster per token than the whole level (prefill left out)
        assert r["prefill_s"] > 0 and 0 < r["step_s"] < r["wall_s"] and r["step_tok_s"] > r["throughput_tok_s"]
    assert all((out / p).exists() for p in ("report.md", "serve_throughput.png", "serve_ttft.png", "serve_tpot.png"))
    assert "## Engine time" in (out / "report.md").read_text()
    assert "auto/off" in capsys.readouterr().out


def test_bench_serve_report_combines_passes(capsys):
    """Figures are means over passes; a ratio to off is the geometric mean of each pass's ratio, shown beside it;
    a mode given twice is refused (--passes repeats)."""
    from specdec.bench.serve_bench import pass_order, render, render_engine

    assert pass_order(["off", "auto"], 3) == [(0, "off"), (0, "auto"), (1, "auto"), (1, "off"), (2, "off"), (2, "auto")]
    tok = {(0, "off"): 10.0, (0, "auto"): 20.0, (1, "auto"): 9.0, (1, "off"): 12.0}
    runs = [
        {"concurrency": 4, "mode": m, "pass": p, "throughput_tok_s": v, "ttft_s": 1.0, "tpot_s": None}
        for (p, m), v in tok.items()
    ]
    row = render(runs, {"modes": ["off", "auto"], "concurrency": [4]}).splitlines()[-1]
    assert row == "| 4 | 11.00 | 1.00 |  | 14.50 | 1.00 |  | 1.22x (2.00, 0.75) |"  # sqrt(2 x 0.75)
    for r in runs:
        r.update(prefill_s=2.0, step_s=4.0 if r["mode"] == "off" else 2.0, step_tok_s=r["throughput_tok_s"] * 2)
    row = render_engine(runs, {"modes": ["off", "auto"], "concurrency": [4]}).splitlines()[-1]
    assert row == "| 4 | 2.0 | 4.0 | 22.00 | 2.0 | 2.0 | 29.00 |"
    assert main(["bench", "serve", "--modes", "off,auto,off", "-m", "x"]) == 1
    assert "each mode once" in capsys.readouterr().err


class _FakeServer:
    def __init__(self, resp):
        self.resp = resp

    def complete(self, body):
        return self.resp

    def peak_rss_mb(self):
        return 1.0


def test_llama_output_counts():
    resp = {
        "tokens": [5, 6, 7, 8, 2],
        "timings": {"prompt_ms": 100.0, "predicted_ms": 400.0, "draft_n": 6, "draft_n_accepted": 2},
    }
    out = Llama("llama-ngram-mod", _FakeServer(resp), {2}).generate([1], 8, 0.0, None)
    assert (out.tokens, out.drafted, out.accepted, out.target_forwards) == ([5, 6, 7, 8], 6, 2, 2)
    assert (out.prefill_s, out.server_s) == (0.1, 0.5)
    none = Llama("llama-none", _FakeServer({"tokens": [5, 6], "timings": {}}), {2}).generate([1], 8, 0.0, None)
    assert (none.drafted, none.accepted, none.target_forwards) == (0, 0, 2)  # no draft counts: nothing drafted
