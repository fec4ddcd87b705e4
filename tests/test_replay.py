"""`specdec bench replay`: the stand-in target, lossless replays of every model-free type, the CLI."""

import json

import pytest
import torch
from conftest import VOCAB, word_tokenizer

from specdec.bench.replay import ReplayRunner, Turn, replay_turn, replayable_types
from specdec.cli import main
from specdec.drafters import REGISTRY, BuildContext, build_drafter
from specdec.engine.adaptive import CostModel
from specdec.engine.engine import Engine, SpecConfig
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer

COSTS = {1: 0.1, 16: 0.2, 512: 1.0}


def _runner(vocab=VOCAB):
    return ReplayRunner(CostModel(verify_s=dict(COSTS), proportional_above=True, smooth=False), vocab, 256, [0])


def test_replay_runner_rows_and_costs():
    r = _runner(10)
    r.truth = [1, 2, 3, 4, 5]
    assert int(r.prefill([1, 2], 0).argmax()) == 3
    rows = r.forward([[2, 3, 9]], [1], [0])[0]  # after [1]: 2 3 match the recording, 9 leaves it
    assert rows.argmax(-1)[:2].tolist() == [3, 4] and rows[2].sum() == 0
    tree = r.verify_tree(0, 1, [2, 3, 9, 4], [-1, -1, 0])  # root 2; children 3 and 9; 4 under 3
    assert tree.argmax(-1)[[0, 1, 3]].tolist() == [3, 4, 5] and tree[2].sum() == 0
    r.prefill(list(range(1024)), 0)
    assert _cost(4) == pytest.approx(0.1 + 0.1 * 3 / 15)  # between measured sizes: interpolated
    assert _cost(1024) == pytest.approx(2.0)  # above the largest: in proportion
    assert r.virtual_s == pytest.approx(_cost(2) + _cost(3) + _cost(4) + _cost(1024))
    trees = _runner(10)
    trees.tree_costs = CostModel(verify_s={2: 1.0})  # a recording with tree costs charges them to tree verifies
    trees.truth = r.truth
    trees.verify_tree(0, 1, [2, 3, 9, 4], [-1, -1, 0])
    trees.forward([[2, 3]], [1], [0])
    assert trees.virtual_s == pytest.approx(1.0 + _cost(2))
    r.by_position = True  # a lossy drafter's forced tokens: each position answered by the recording there
    assert r.forward([[2, 9, 9]], [1], [0])[0].argmax(-1).tolist() == [3, 4, 5]


def test_replay_is_lossless_and_faster_where_drafts_hit(tmp_path):
    word_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    span = list(range(5, 25))
    turn = Turn("t", [3] + span * 2 + [4], span + [30, 31] + span, stopped=True)  # the output copies the prompt
    runner = _runner()
    seconds = {}
    ctx = BuildContext(REGISTRY.option_values())
    for name in ["none", *(n for n in replayable_types() if not REGISTRY.get(n).lossy), "ngram-mod,suffix"]:
        engine = Engine(runner, tok, SpecConfig(), clock=runner.clock)
        out = replay_turn(engine, runner, turn, build_drafter(name, ctx), 0, name)
        assert out.tokens == turn.output, name
        seconds[name] = out.seconds
        if name == "none":  # prefill (1 forward) + one forward per output token, the last one yielding the stop
            assert out.target_forwards == len(turn.output) + 1
            assert out.seconds == pytest.approx(_cost(42) + 0.1 * 42, rel=0.05)  # 42 prompt tokens
    assert all(seconds[n] < 0.6 * seconds["none"] for n in seconds if n != "none"), seconds


def _cost(tokens):
    return CostModel(verify_s=dict(COSTS), proportional_above=True, smooth=False).verify_cost(tokens)


def test_replay_runs_synthetic_by_position(tmp_path):
    """Synthetic's forced tokens leave the recording: replayed by position, not compared, and timed."""
    word_tokenizer(tmp_path)
    turn = Turn("t", [3, 5, 6, 7], list(range(8, 40)), stopped=False)
    runner = _runner()
    runner.by_position = True
    seconds = {}
    for rate in (0.0, 1.0):
        engine = Engine(runner, Tokenizer(tmp_path), SpecConfig(), clock=runner.clock)
        engine.verify_hooks["synthetic"] = REGISTRY.get("synthetic").verify_hook
        ctx = BuildContext(REGISTRY.option_values({"synth_rates": [rate], "synth_len": 4}))
        out = replay_turn(engine, runner, turn, build_drafter("synthetic", ctx), 0, "synthetic")
        assert len(out.tokens) == len(turn.output)
        seconds[rate] = out.seconds
    assert out.accepted > 0 and seconds[1.0] < 0.5 * seconds[0.0]


def test_replay_catches_a_lossy_drafter(tmp_path):
    word_tokenizer(tmp_path)
    runner = _runner()
    turn = Turn("t", [3, 5, 6, 7], [8, 9, 10, 11, 12, 13], stopped=False)
    engine = Engine(runner, Tokenizer(tmp_path), SpecConfig(adaptive=False), clock=runner.clock)
    synthetic = build_drafter("synthetic", BuildContext(REGISTRY.option_values({"synth_rates": [1.0], "synth_len": 4})))
    engine.verify_hooks["synthetic"] = REGISTRY.get("synthetic").verify_hook
    with pytest.raises(SpecdecError, match=r"replayed output differs from the recording at token 1 "):
        replay_turn(engine, runner, turn, synthetic, 0, "synthetic")


def test_replay_cli_errors(tmp_path, capsys):
    assert main(["bench", "replay"]) == 1
    assert "exactly one of --record FILE or --from FILE" in capsys.readouterr().err
    assert main(["bench", "replay", "--record", "r.json", "--temp", "0.7"]) == 1
    assert "greedy decoding only" in capsys.readouterr().err
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["bench", "replay", "--from", str(bad)]) == 1
    assert "is not a replay recording" in capsys.readouterr().err


@pytest.mark.real
def test_record_and_replay_smollm(smollm_dir, tmp_path, capsys):
    work = tmp_path / "w.jsonl"
    work.write_text(
        json.dumps(
            {"id": "e", "category": "code-edit", "prompt": "Repeat this line exactly: def add(a, b): return a + b"}
        )
        + "\n"
        + json.dumps({"id": "m", "category": "multi_turn", "turns": ["Name a fruit.", "And a vegetable?"]})
        + "\n"
    )
    rec = tmp_path / "rec.json"
    threads = torch.get_num_threads()
    try:
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
                    "12",
                    "--workload",
                    str(work),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    data = json.loads(rec.read_text())
    assert set(data["forward_s"]) >= {"1", "16", "512"} and all(s > 0 for s in data["forward_s"].values())
    assert set(data["tree_forward_s"]) >= {"2", "16", "64"} and "1" not in data["tree_forward_s"]
    assert 0 < len(data["prompts"][0]["turns"][0]["output"]) <= 12
    first, second = data["prompts"][1]["turns"]  # turn 2's prompt holds turn 1 and its answer
    assert second["prompt"][: len(first["prompt"])] == first["prompt"] and len(second["prompt"]) > len(first["prompt"])
    out = tmp_path / "out"
    assert (
        main(["bench", "replay", "--from", str(rec), "--methods", "none,suffix,ngram-simple", "--out", str(out)]) == 0
    )
    res = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in res["runs"]] == ["none", "suffix", "ngram-simple"] * 2
    assert all(r["matches_baseline"] for r in res["runs"])
    assert "virtual time" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["bench", "replay", "--from", str(rec), "--methods", "draft"]) == 1
    assert "model-free spec types only" in capsys.readouterr().err
