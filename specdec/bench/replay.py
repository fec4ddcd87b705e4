"""`specdec bench replay`: tune model-free drafters in seconds instead of hours.

`--record FILE` runs plain greedy decoding once over a workload and saves every turn's prompt and
output token ids, plus the target's measured forward cost by tokens per forward. `--from FILE` then
replays any model-free spec types against the recording: the real engine and drafters, a stand-in
target (`ReplayRunner`) that answers every position with the recorded next token, and a clock that
charges each target forward its recorded cost (drafting runs, and is timed, for real). The results are
the same files as `specdec bench` writes, in virtual seconds. A replayed output that differs from the
recording is an error: the replay checks losslessness too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec.bench.methods import Method, engine_output, merge
from specdec.bench.report import Outcomes, bench_meta, report_tables, run_stamp, summarize, write_outputs
from specdec.bench.runner import compare_to_baselines, parse_methods, record
from specdec.bench.workloads import Prompt, load_workload
from specdec.config import Config
from specdec.drafters import REGISTRY, BuildContext, build_drafter, is_lossy
from specdec.engine.adaptive import CostModel
from specdec.engine.engine import Engine
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams

COST_SIZES = (1, 2, 4, 8, 16, 24, 32, 64, 128, 512)  # tokens per forward whose cost is recorded
COST_REPEATS = 3
TREE_SIZES_MAX = 64  # tree verifies are measured up to this many tokens (drafts are bounded by --draft-max)
FORMAT = "specdec-replay-1"


@dataclass
class Turn:
    text: str  # the user turn
    prompt: list[int]  # the whole prompt in the chat template, history included
    output: list[int]  # plain greedy output (stop token not included)
    stopped: bool  # True: ended by a stop token; False: by the token limit


def run_replay(args: argparse.Namespace) -> Path | None:
    """`bench replay`: record (`--record`) or replay (`--from`)."""
    if (args.record is None) == (args.replay_from is None):
        raise SpecdecError("bench replay needs exactly one of --record FILE or --from FILE")
    if args.temp != 0:
        raise SpecdecError("bench replay replays greedy decoding only; drop --temp")
    if args.spec_type is not None:
        raise SpecdecError("bench replay runs the spec types named by --methods; drop --spec-type")
    if args.record is not None:
        record_plain(args)
        return None
    return replay_file(args)


# --- recording -------------------------------------------------------------------------------------


def record_plain(args: argparse.Namespace) -> None:
    """Plain greedy decoding over the workload; write prompts, outputs and forward costs to `args.record`."""
    from specdec.api import build_llm
    from specdec.models.loader import resolve_model
    from specdec.models.packs import DEFAULT_TARGET

    prompts = load_workload(args.workload, args.workload_dir, args.per_category, args.seed, args.categories)
    args.model = args.model or DEFAULT_TARGET
    given = Path(args.model).expanduser()
    model_path = given.resolve() if given.exists() else resolve_model(args.model)  # a GGUF file stays one
    args.threads = args.threads or torch.get_num_threads()
    llm = build_llm(args, spec_type="none", cache_mb=0)  # the recorded prefill costs are fresh prefills
    out = []
    for i, p in enumerate(prompts, 1):
        messages, turns = [], []
        for text in p.turns:
            messages.append({"role": "user", "content": text})
            ids = llm.encode_chat(messages)
            r = llm.generate(ids, max_tokens=p.limit(args.max_tokens), spec_type="none")
            turns.append({"text": text, "prompt": ids, "output": r.token_ids, "stopped": r.finish_reason == "stop"})
            messages.append({"role": "assistant", "content": llm.tokenizer.decode(r.token_ids)})
        out.append({"id": p.id, "category": p.category, "turns": turns})
        print(
            f"[{i}/{len(prompts)}] {p.category}/{p.id}: {sum(len(t['output']) for t in turns)} tokens", file=sys.stderr
        )
    text = [t for p in out for turn in p["turns"] for t in turn["prompt"] + turn["output"]]
    costs = measure_forward_costs(llm.runner, text)
    tree_costs = measure_forward_costs(llm.runner, text, tuple(t for t in COST_SIZES if t <= TREE_SIZES_MAX), tree=True)
    target = {
        "path": str(model_path),
        "vocab_size": llm.runner.vocab_size,
        "eos_token_ids": list(llm.runner.model.config.eos_token_ids),
    }
    path = Path(args.record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "format": FORMAT,
                "meta": bench_meta(args, llm, prompts),
                "target": target,
                "forward_s": costs,
                "tree_forward_s": tree_costs,
                "prompts": out,
            }
        )
    )
    print(
        f"recorded {len(out)} prompts, forward costs {_costs_line(costs)} and tree verify costs "
        f"{_costs_line(tree_costs)} to {path}",
        file=sys.stderr,
    )


def measure_forward_costs(
    runner,
    text: list[int],
    sizes: tuple[int, ...] = COST_SIZES,
    repeats: int = COST_REPEATS,
    tree: bool = False,
) -> dict[str, float]:
    """Median seconds of a target forward over t tokens of `text` (cycled) at the start of slot 0's cache, for each
    t: a chain, or with `tree` a tree verify of t tokens (the root and t - 1 nodes, two children each). Text, not one
    token repeated: on a mixture of experts the rows' tokens choose the experts a forward reads."""
    costs = {}
    with torch.inference_mode():
        for t in [t for t in sizes if t < runner.context and (t > 1 or not tree)]:
            tokens = [text[i % len(text)] for i in range(t)]
            runs = []
            for _ in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                if tree:
                    runner.verify_tree(0, 0, tokens, [(j - 1) // 2 for j in range(t - 1)])
                else:
                    runner.forward([tokens], [0], [0])
                runs.append(time.perf_counter() - start)
            costs[str(t)] = statistics.median(runs[1:])
    return costs


def _costs_line(costs: dict[str, float]) -> str:
    return ", ".join(f"{t}: {s * 1000:.0f} ms" for t, s in costs.items())


# --- replaying -------------------------------------------------------------------------------------


class ReplayRunner:
    """Stands in for ModelRunner over one recorded turn at a time: row i of any forward is a one-hot of
    the recorded token after that position's context (zeros once the context has left the recording,
    where verification never looks; with `by_position`, the recorded token at that position whatever came
    before, for a lossy drafter whose forced tokens leave the recording), and every call adds its recorded cost to
    `virtual_s`."""

    capture = features = None  # no target features (drafters that read them are not replayable)
    prefix = None  # no prefix cache: every turn's prefill costs what was recorded
    recurrent = False  # no recurrent states: trees are verified as trees

    def __init__(
        self, costs: CostModel, vocab_size: int, context: int, eos_ids: list[int], tree_costs: CostModel | None = None
    ):
        self.costs, self.vocab_size, self.context = costs, vocab_size, context
        self.tree_costs = tree_costs or costs  # tree verifies (older recordings: as chains)
        self.model = SimpleNamespace(config=SimpleNamespace(eos_token_ids=eos_ids))
        self.truth: list[int] = []  # prompt + output (+ a stop token) of the turn being replayed
        self.by_position = False
        self.virtual_s = 0.0

    def clock(self) -> float:
        """Real time plus the recorded cost of every forward so far."""
        return time.perf_counter() + self.virtual_s

    def _row(self, context: list[int]) -> torch.Tensor:
        row = torch.zeros(self.vocab_size)  # [V]
        n = len(context)
        if n < len(self.truth) and (self.by_position or self.truth[:n] == context):
            row[self.truth[n]] = 1.0
        return row

    def _charge(self, tokens: int, costs: CostModel | None = None) -> None:
        self.virtual_s += (costs or self.costs).verify_cost(tokens)

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        self._charge(len(tokens))
        return self._row(self.truth[:start] + tokens)  # [V]

    def forward(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], last_only: bool = False
    ) -> list[torch.Tensor]:
        out = []
        for chunk, start in zip(chunks, starts):
            self._charge(len(chunk))
            base = self.truth[:start]
            out.append(torch.stack([self._row(base + chunk[: i + 1]) for i in range(len(chunk))]))  # [T, V]
        return out

    def verify_tree(self, slot: int, start: int, tokens: list[int], parents: list[int]) -> torch.Tensor:
        self._charge(len(tokens), self.tree_costs)
        paths: list[list[int]] = []
        for i, p in enumerate(parents):
            paths.append((paths[p] if p >= 0 else []) + [tokens[i + 1]])
        base = self.truth[:start] + tokens[:1]
        return torch.stack([self._row(base)] + [self._row(base + path) for path in paths])  # [N+1, V]

    def keep_path(self, slot: int, start: int, path: list[int]) -> None:
        """No cache to compact."""


class Replayed(Method):
    def __init__(self, name: str):
        self.name, self.baseline, self.lossy = name, "none", is_lossy(name.replace("+", ","))


def replay_file(args: argparse.Namespace) -> Path:
    """Replay the spec types named by --methods against a recording; write the bench's result files."""
    rec = load_recording(Path(args.replay_from))
    names = parse_methods(args.methods)
    replayable = replayable_types()
    bad = [n for n in names if n != "none" and not all(p in replayable for p in n.split("+"))]
    if bad:
        raise SpecdecError(
            f"bench replay runs model-free spec types only (not {', '.join(bad)}); "
            f"choose from none, {', '.join(replayable)}"
        )
    cfg = Config.from_namespace(args, spec_type="none")
    ctx = BuildContext(cfg.drafter)
    recorded, target = rec["meta"], rec["target"]
    tokenizer = _tokenizer(Path(target["path"]), recorded["models"]["target"])
    costs, tree_costs = (
        CostModel(
            verify_s={int(t): s for t, s in rec[key].items()}, proportional_above=True, smooth=False
        )  # the clock charges the recorded medians
        if rec.get(key)
        else None
        for key in ("forward_s", "tree_forward_s")
    )
    runner = ReplayRunner(costs, target["vocab_size"], recorded["context"], target["eos_token_ids"], tree_costs)
    engines = {n: Engine(runner, tokenizer, cfg.spec, clock=runner.clock) for n in names}  # one cost model each
    for name, engine in engines.items():  # an opt-in lossy drafter's verification (synthetic's forced tokens)
        hooks = {p: REGISTRY.get(p).verify_hook for p in name.split("+") if p != "none"}
        engine.verify_hooks.update({p: h for p, h in hooks.items() if h is not None})
    stop = min(engines[names[0]].stop_ids)
    records: list[dict] = []
    for p in rec["prompts"]:
        turns = [Turn(**t) for t in p["turns"]]
        prompt = Prompt(p["id"], p["category"], tuple(t.text for t in turns))
        done = []
        for r in range(args.repeat):
            for name in names:  # a fresh drafter per turn, as `specdec bench` resets them
                spec, method = name.replace("+", ","), Replayed(name)
                runner.by_position = method.lossy
                out = merge(
                    [
                        replay_turn(
                            engines[name],
                            runner,
                            turn,
                            build_drafter(spec, ctx, cfg.chain_mode),
                            stop,
                            f"{name} on prompt {p['id']}",
                        )
                        for turn in turns
                    ]
                )
                done.append((method, record(prompt, method, r, out, args.draft_max), out))
        compare_to_baselines(done)
        records += [rec_ for _, rec_, _ in done]
    out_dir = Path(args.out or Path("bench-out") / datetime.now().strftime("replay-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        **recorded,
        **run_stamp(),
        "repeat": args.repeat,
        "draft_max": args.draft_max,
        "recorded": {"file": args.replay_from, "command": recorded["command"], "date": recorded["date"]},
    }
    trees = (
        f"; tree verifies {_costs_line(rec['tree_forward_s'])}"
        if rec.get("tree_forward_s")
        else "; tree verifies as chains"
    )
    notes = [
        f"replay of {args.replay_from} (recorded {recorded['date']}): virtual time, each target forward charged "
        f"its recorded cost (chains {_costs_line(rec['forward_s'])}{trees}; above the largest, in proportion); "
        "drafting timed for real"
    ]
    outcomes = Outcomes(notes)
    summary = summarize(records, names)
    write_outputs(out_dir, records, summary, meta, outcomes)
    print(report_tables(summary, records, outcomes))
    print(f"results: {out_dir}/results.json, {out_dir}/report.md", file=sys.stderr)
    return out_dir


def _tokenizer(path: Path, model: str):
    """The recorded target's tokenizer: from its checkpoint directory or GGUF file, else by the name it was
    recorded under (a model pack)."""
    from specdec.models.gguf_convert import gguf_tokenizer
    from specdec.models.loader import resolve_model
    from specdec.models.tokenizer import Tokenizer

    if path.is_file():
        return Tokenizer(gguf_tokenizer(path))
    return Tokenizer(path if path.is_dir() else resolve_model(model))


def replayable_types() -> list[str]:
    """Spec types a recording can replay: those needing nothing but the tokens (no draft model, no target
    features). The output of a lossless one must be the recording's; an opt-in lossy one's (synthetic) is not
    compared."""
    return [n for n, t in REGISTRY.types.items() if not (t.draft_model or t.target_features or t.target_layers)]


def replay_turn(engine: Engine, runner: ReplayRunner, turn: Turn, drafter, stop: int, what: str):
    """One recorded turn through the engine; the output must be the recording's (unless `runner.by_position`: a
    lossy drafter's)."""
    runner.truth = turn.prompt + turn.output + ([stop] if turn.stopped else [])
    limit = len(turn.output) + (1 if turn.stopped else 0)
    seq = engine.generate(turn.prompt, SamplingParams(max_tokens=max(1, limit)), drafter=drafter)
    if not runner.by_position and seq.output_ids != turn.output:
        at = next(
            (i for i, (x, y) in enumerate(zip(seq.output_ids, turn.output)) if x != y),
            min(len(seq.output_ids), len(turn.output)),
        )
        raise SpecdecError(
            f"{what}: replayed output differs from the recording at token {at} "
            "(a lossless spec type must reproduce it; this is a bug)"
        )
    return engine_output(seq.output_ids, seq.stats, seq.top2_gaps)


def load_recording(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text())
    except OSError as e:
        raise SpecdecError(f"cannot read recording {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{path} is not a replay recording (not valid JSON: {e.msg})") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise SpecdecError(f"{path} is not a replay recording (make one with specdec bench replay --record)")
    return rec
