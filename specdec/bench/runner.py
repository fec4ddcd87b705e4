"""`specdec bench`: warm up, then run every method on every prompt, interleaved, and record each run."""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime
from pathlib import Path

from specdec.bench.llama import HEAD_PEERS, LLAMA_METHODS, llama_methods
from specdec.bench.methods import HF_METHODS, EngineMethod, Method, Output, hf_methods, merge
from specdec.bench.report import LIKELY_BUG_GAP, Outcomes, bench_meta, report_tables, summarize, write_outputs
from specdec.bench.workloads import Prompt, load_workload
from specdec.drafters import REGISTRY, spec_types
from specdec.errors import SpecdecError
from specdec.stats import first_divergence, mean_accept_len

WARMUP = Prompt("warmup", "warmup", ("Say hello in one short sentence.",), max_tokens=16)
PEERS_NEEDING_DRAFT = ("hf-assisted", "llama-draft")


def all_methods() -> tuple[str, ...]:
    return spec_types() + HF_METHODS + tuple(LLAMA_METHODS)


def _engine_parts(method: str) -> list[str]:
    """Our spec types in a method name (`a+b` is the chain a,b); [] for a peer's method."""
    parts = method.split("+")
    return parts if all(p in spec_types() for p in parts) else []


def needs_draft(method: str) -> bool:
    return method in PEERS_NEEDING_DRAFT or any(
        p != "none" and REGISTRY.get(p).draft_model for p in _engine_parts(method)
    )


def parse_methods(spec: str) -> list[str]:
    """`--methods` (comma list, or `all`) -> method names in the given order; `a+b` is our chain `a,b`."""
    known = all_methods()
    if spec.strip() == "all":  # every lossless method; lossy ones (synthetic) and trained heads only when named
        names = [
            m
            for m in known
            if (m not in spec_types() or m in spec_types(lossy=False, heads=False)) and m not in HEAD_PEERS
        ]
    else:
        names = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in names if m not in known and not ("+" in m and _engine_parts(m))]
    if bad or not names:
        raise SpecdecError(
            f"unknown bench method(s) {', '.join(bad) or '(none given)'} (choose from "
            f"{', '.join(known)}, or all; our spec types chain as a+b)"
        )
    return list(dict.fromkeys(names))


def run_bench(args: argparse.Namespace) -> Path:
    """Run the bench described by the CLI arguments; return the output folder. A method that fails is recorded
    with its reason and the others go on; SpecdecError at the end, once every result is written, when one failed."""
    import torch

    from specdec.api import build_llm
    from specdec.models.packs import DEFAULT_DRAFT, DEFAULT_TARGET

    if args.temp < 0:
        raise SpecdecError("--temp must be >= 0")
    if args.spec_type is not None:
        raise SpecdecError("bench runs the spec types named by --methods; drop --spec-type")
    prompts = load_workload(args.workload, args.workload_dir, args.per_category, args.seed, args.categories)
    names = parse_methods(args.methods)
    if args.model is None:
        args.model, args.draft = DEFAULT_TARGET, args.draft or DEFAULT_DRAFT
    need_draft = [m for m in names if needs_draft(m)]
    if args.draft is None and need_draft:
        raise SpecdecError(f"methods {', '.join(need_draft)} need a draft model (-md)")
    if args.llama_server and any(m in LLAMA_METHODS for m in names):  # before loading any model
        _check_llama_server(args)
    args.threads = args.threads or torch.get_num_threads()  # fixed for every method, peers included
    out_dir = Path(args.out or Path("bench-out") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)

    llm = build_llm(args, spec_type="none", cache_mb=0)  # no prefix cache: each method prefills every prompt
    stop_ids = llm.engine.stop_ids
    outcomes = Outcomes(errors_log=out_dir / "errors.log")
    meta = bench_meta(args, llm, prompts)
    methods: list[Method] = []
    try:
        ours = [
            outcomes.attempt([n], "loading", lambda: EngineMethod(llm, n))
            for n in names
            if n not in HF_METHODS and n not in LLAMA_METHODS
        ]
        methods += [m for m in ours if m is not None]
        methods += hf_methods(
            [m for m in names if m in HF_METHODS], args.model, args.draft, llm.dtype, stop_ids, outcomes
        )
        methods += llama_methods(
            [m for m in names if m in LLAMA_METHODS], args, llm.context, stop_ids, out_dir, outcomes, meta
        )
        methods.sort(key=lambda m: names.index(m.name))
        for note in outcomes.notes:
            print(f"note: {note}", file=sys.stderr)
        _run_all(llm, methods, prompts, args, out_dir, meta, outcomes)
    finally:
        for m in methods:
            m.close()
    if outcomes.failed:
        raise SpecdecError(
            f"{len(outcomes.failed)} of {len(names)} methods failed ({', '.join(outcomes.failed)}); "
            f"the others' results: {out_dir}/results.json"
        )
    return out_dir


def _check_llama_server(args: argparse.Namespace) -> None:
    """`--llama-server auto`: build it (once); a path: it must be there."""
    if args.llama_server == "auto":
        from specdec.bench.llama_build import ensure_llama_server

        args.llama_server = str(ensure_llama_server())
    elif not Path(args.llama_server).is_file():
        raise SpecdecError(f"llama-server binary not found: {args.llama_server}")


def _run_all(
    llm,
    methods: list[Method],
    prompts: list[Prompt],
    args: argparse.Namespace,
    out_dir: Path,
    meta: dict,
    outcomes: Outcomes,
) -> None:
    """Warm up, then every method on every prompt; a method that fails is closed and left out from then on."""
    from tqdm import tqdm

    greedy = args.temp == 0
    seed = None if args.unseeded else args.seed
    order = [m.name for m in methods]
    print(f"warming up ({', '.join(order)})...", file=sys.stderr)
    for m in methods:
        _attempt_run(llm, m, WARMUP, args, seed, outcomes, "warming up")
    records: list[dict] = []
    live = lambda: [m for m in methods if m.name not in outcomes.failed]  # noqa: E731
    bar = tqdm(total=len(prompts) * args.repeat * len(live()), unit="run", file=sys.stderr, dynamic_ncols=True)
    for i, p in enumerate(prompts):
        done: list[tuple[Method, dict, Output]] = []
        for r in range(args.repeat):
            for m in live():  # interleaved (A B C A B C) so drift hits every method alike
                bar.set_postfix_str(f"{p.category}/{p.id} {m.name}")
                out = _attempt_run(llm, m, p, args, seed, outcomes, f"running prompt {p.id}")
                if out is None:  # its runs left are not coming
                    bar.total -= (len(prompts) - i) * args.repeat - r
                    continue
                done.append((m, record(p, m, r, out, args.draft_max), out))
                bar.update()
        if greedy:
            for warning in compare_to_baselines(done):
                tqdm.write(warning, file=sys.stderr)
        records += [rec for _, rec, _ in done]
        write_outputs(out_dir, records, summarize(records, order), meta, outcomes)
    bar.close()
    print(report_tables(summarize(records, order), records, outcomes))
    print(f"results: {out_dir}/results.json, {out_dir}/report.md, {out_dir}/report.html", file=sys.stderr)


def _attempt_run(
    llm, m: Method, p: Prompt, args: argparse.Namespace, seed: int | None, outcomes: Outcomes, stage: str
) -> Output | None:
    """`run_prompt`; None, the method recorded as failed and closed, when it raises."""
    out = outcomes.attempt([m.name], stage, lambda: run_prompt(llm, m, p, p.limit(args.max_tokens), args.temp, seed))
    if out is None:
        m.close()
    return out


def run_prompt(llm, method: Method, prompt: Prompt, max_tokens: int, temperature: float, seed: int | None) -> Output:
    """All turns of a prompt; each later turn follows the method's own answer to the previous one. A model without a
    chat template (a base model) reads the conversation as plain text, turns separated by blank lines."""
    messages: list[dict] = []
    outs = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        ids = (
            llm.encode_chat(messages)
            if llm.tokenizer.chat_template
            else llm.encode("\n\n".join(m["content"] for m in messages))
        )
        outs.append(method.generate(ids, max_tokens, temperature, seed))
        messages.append({"role": "assistant", "content": llm.tokenizer.decode(outs[-1].tokens)})
    return merge(outs)


def record(p: Prompt, m: Method, repeat: int, out: Output, draft_max: int) -> dict:
    """The per-run record written to results.json."""
    n = len(out.tokens)
    r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    ppa = (
        None
        if out.drafted_at is None
        else [r4(acc / d if d else 0.0) for acc, d in zip(out.accepted_at, out.drafted_at)]
    )
    decode_s = None if out.prefill_s is None else out.seconds - out.prefill_s
    steps = None if out.target_forwards is None else out.target_forwards - len(p.turns)  # a prefill per turn
    return {
        "id": p.id,
        "category": p.category,
        "method": m.name,
        "baseline": m.baseline,
        "repeat": repeat,
        "first_seen": repeat == 0 or m.fresh_repeats,
        "new_tokens": n,
        "seconds": r4(out.seconds),
        "tokens_per_s": r4(n / out.seconds if out.seconds > 0 else 0.0),
        "decode_tokens_per_s": r4(n / decode_s) if decode_s and decode_s > 0 else None,
        "target_forwards": out.target_forwards,
        "drafted": out.drafted,
        "accepted": out.accepted,
        "verify_steps": steps,
        "mean_accept_len": r4(mean_accept_len(out.accepted or 0, steps)) if steps is not None else None,
        "per_position_acceptance": ppa,
        "drafted_at": out.drafted_at,
        "accepted_at": out.accepted_at,
        "prefill_s": r4(out.prefill_s),
        "draft_s": r4(out.draft_s),
        "verify_s": r4(out.verify_s),
        "server_s": r4(out.server_s),
        "peak_rss_mb": r4(out.peak_rss_mb),
        "ceiling_tokens_per_s": r4(ceiling(out, len(p.turns), draft_max)) if m.name == "none" else None,
        "matches_baseline": None,
        "first_divergence": None,
    }


def ceiling(plain: Output, turns: int, draft_max: int) -> float | None:
    """Tokens/s a speculative run could reach at best, from a plain run's times: the same prefill, and the
    plain run's decode forwards F (one per token) packed draft_max + 1 to a forward at the plain forward's
    cost (every draft accepted; drafting free; verifying k+1 tokens as cheap as one)."""
    if plain.prefill_s is None or not plain.target_forwards or plain.target_forwards <= turns:
        return None
    forwards = plain.target_forwards - turns  # prefill counts as one forward per turn
    per_forward = (plain.seconds - plain.prefill_s) / forwards
    best_s = plain.prefill_s + math.ceil(forwards / (draft_max + 1)) * per_forward
    return len(plain.tokens) / best_s if best_s > 0 else None


def compare_to_baselines(done: list[tuple[Method, dict, Output]]) -> list[str]:
    """Fill `matches_baseline` / `first_divergence` against each method's baseline (its first run of the
    prompt); return loud warnings for divergences that are not near-ties."""
    first = {}
    for m, rec, out in done:
        first.setdefault(m.name, out)
    warnings = []
    for m, rec, out in done:
        base = first.get(m.baseline)
        if base is None or m.lossy:  # synthetic output is not meant to match
            continue
        rec["matches_baseline"] = out.tokens == base.tokens
        if rec["matches_baseline"] or base.top2_gaps is None:
            continue
        div = first_divergence(base.tokens, base.top2_gaps, out.tokens)
        rec["first_divergence"] = div
        gap = div["top2_gap"]
        if gap is None or gap >= LIKELY_BUG_GAP:
            what = "LIKELY BUG" if gap is not None else "WARNING"
            warnings.append(
                f"!!! {what}: {m.name} differs from {m.baseline} on prompt {rec['id']} (repeat "
                f"{rec['repeat']}) at output token {div['index']}, where {m.baseline}'s top-2 logit "
                f"gap is {gap if gap is not None else 'unknown'} (>= {LIKELY_BUG_GAP} is not rounding)"
            )
    return warnings
