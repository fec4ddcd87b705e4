"""`specdec generate | models | bench | serve | plan | train` with llama.cpp-style flags."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.errors import SpecdecError, run_command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _hub(s: str) -> str:
    raise argparse.ArgumentTypeError(
        f"model hubs are not reachable from here ({s}): download the GGUF file and pass "
        "it with -m FILE, or use a model pack (specdec models list)"
    )


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def _spec_type(s: str) -> str:
    """A spec type or a comma-separated chain of them, normalized ('ngram-mod, draft' -> 'ngram-mod,draft')."""
    from specdec.drafters import parse_spec_type

    try:
        return ",".join(parse_spec_type(s))
    except SpecdecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _layers(s: str) -> int:
    """-ngl/-ngld: a layer count or 'all'."""
    from specdec.plan.planner import parse_layers

    try:
        return parse_layers(s)
    except SpecdecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads models."""
    from specdec import compat
    from specdec.config import DTYPES, Config
    from specdec.drafters import DEFAULT_MODEL_FREE, DEFAULT_WITH_DRAFT_MODEL, REGISTRY, spec_types
    from specdec.drafters.chain import CHAIN_MODES
    from specdec.models.loader import QUANT_CHOICES

    D = Config  # defaults live on the Config class
    g = p.add_argument_group("models")
    g.add_argument(
        "-m",
        "--model",
        help="target: model pack name, GGUF file or checkpoint directory "
        "(default: qwen2.5-coder-1.5b with draft qwen2.5-coder-0.5b)",
    )
    g.add_argument(
        "-hf", "--hf-repo", type=_hub, metavar="REPO", help="not supported: hubs are not reachable here; use -m FILE"
    )
    g.add_argument(
        "-md",
        "--model-draft",
        dest="draft",
        help="draft model; with another tokenizer than the target's "
        "its drafts are re-tokenized for the target (docs/cross-tokenizer.md)",
    )
    g.add_argument(
        "-c",
        "--ctx-size",
        dest="context",
        type=_positive_int,
        default=D.context,
        help=f"context length (default {D.context})",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default=D.dtype,
        help="compute dtype; auto = fp32 for a gguf model on the CPU (its kernels take fp32), else bf16 "
        "on CPUs with native bf16, else fp32",
    )
    g.add_argument(
        "--quant",
        choices=QUANT_CHOICES,
        default=D.quant,
        help="target weights: auto (default) = gguf for a model pack or GGUF file, none for a checkpoint "
        "directory; gguf = the GGUF file's own blocks (Q4_K/Q5_0/Q6_K/Q8_0) through CPU kernels (on "
        "AVX-512 repacked at load, 16 outputs at a time), other types dequantized to --dtype; int8 / "
        "int4 = weight-only (lossless against that quantized target, not the unquantized one); none = "
        "dequantized to --dtype",
    )
    g.add_argument("-t", "--threads", type=_positive_int, help="CPU threads (default: torch's choice)")
    g.add_argument(
        "--fast-prefill",
        action="store_true",
        default=None,
        help="opt-in: forwards of more than 64 rows (prompt chunks) dequantize the GGUF weights (bf16 where "
        "the CPU has it) for torch's matmul and use torch's attention; faster on some CPUs, but a prompt's "
        'tokens may then differ with chunking, batching and the prompt cache (outputs say "fast_prefill"); '
        "default off: one arithmetic per token",
    )
    g.add_argument(
        "-ngl",
        "--n-gpu-layers",
        dest="n_gpu_layers",
        type=_layers,
        metavar="N",
        help="target layers on the GPU (N or all): embeddings and the first N layers (norm and head "
        "too when N covers all) on CUDA, the rest on the CPU; without CUDA accepted, said on stderr, "
        "ignored (`specdec plan` shows the placement)",
    )
    g.add_argument(
        "-ngld",
        "--n-gpu-layers-draft",
        dest="n_gpu_layers_draft",
        type=_layers,
        metavar="N",
        help="draft-model layers on the GPU (N or all), as -ngl; GPU layers of the draft stay unquantized",
    )
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--spec-type",
        type=_spec_type,
        metavar="TYPE[,TYPE...]",
        help=f"drafter: {' | '.join(spec_types())}; a comma list is a chain, the first that drafts wins "
        f"(default: {DEFAULT_WITH_DRAFT_MODEL} with -md or no -m, else {DEFAULT_MODEL_FREE})",
    )
    s.add_argument(
        "--spec-chain",
        dest="chain_mode",
        choices=CHAIN_MODES,
        default=D.chain_mode,
        help="with a chain a,b: first = the first drafter that drafts (llama.cpp); gain = the draft with "
        "the most expected accepted tokens by each drafter's measured acceptance (default first)",
    )
    s.add_argument(
        "--draft-max",
        type=_positive_int,
        default=D.draft_max,
        help=f"max drafted tokens per step (default {D.draft_max})",
    )
    s.add_argument("--draft-min", type=int, default=D.draft_min, help="skip drafts shorter than this (default 0)")
    s.add_argument(
        "--spec-adaptive",
        choices=["on", "off"],
        default="on" if D.adaptive else "off",
        help="choose each step's draft length (<= --draft-max) by measured costs and acceptance, "
        "0 when no draft pays, with a one-token probe now and then (default on); off = always --draft-max",
    )
    s.add_argument(
        "--spec-accept-threshold",
        dest="accept_threshold",
        type=float,
        default=D.accept_threshold,
        metavar="T",
        help="opt-in, LOSSY: also accept a drafted token whose target probability is at least "
        'T x the target\'s top probability (0.7 is a common start); outputs are flagged "lossless": '
        "false; 0 = off, lossless (default 0)",
    )
    s.add_argument(
        "--draft-quant",
        choices=QUANT_CHOICES,
        default=D.draft_quant,
        help="weights of the draft model, as --quant: auto (default) = gguf for a pack or GGUF file (its "
        "own blocks through the kernels), none for a checkpoint directory; int4 (groups of 64, bf16 "
        "layers; int8 elsewhere) or int8 (per channel) weight-only; the output stays the target's",
    )
    for o in REGISTRY.options.values():  # every drafter's own options, from the registry
        s.add_argument(o.flag, dest=o.name, type=_option_type(o), default=o.default, help=o.help)
    compat.add_flags(p)


def _option_type(o):
    """argparse type for a drafter option: its parser and rule, errors as one line."""

    def parse(text: str):
        try:
            return o.check(text)
        except (SpecdecError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = o.name  # argparse names the type in "invalid <name> value"
    return parse


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "-n", "--n-predict", dest="max_tokens", type=_positive_int, default=128, help="max new tokens (default 128)"
    )
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens; 0 = off (default 0)")
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the most likely tokens up to this total probability; 1 = off (default 1)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below this fraction of the top token's probability; 0 = off (default 0)",
    )
    g.add_argument(
        "--seed", type=int, help="seed for sampling: the same text for every drafter and load (default: none, random)"
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constrained output (as llama-cli's)")
    g.add_argument(
        "-j", "--json-schema", help="the output is JSON valid under this schema (JSON text; {} = any object)"
    )
    g.add_argument("--grammar", help="the output matches this GBNF grammar (llama.cpp's format)")
    g.add_argument("--grammar-file", help="read the GBNF grammar from a file")


def grammar_of(args: argparse.Namespace):
    """The Grammar the flags ask for (at most one of them), or None."""
    from specdec.constraint import Grammar, schema_text

    given = [k for k in ("json_schema", "grammar", "grammar_file") if getattr(args, k) is not None]
    if len(given) > 1:
        raise SpecdecError("give one of --json-schema, --grammar, --grammar-file")
    if args.json_schema is not None:
        schema = schema_text(args.json_schema)
        return Grammar.json_schema(schema or None)
    if args.grammar_file is not None:
        try:
            return Grammar.gbnf(Path(args.grammar_file).read_text())
        except OSError as e:
            raise SpecdecError(f"cannot read grammar file {args.grammar_file}: {e.strerror}") from None
    return None if args.grammar is None else Grammar.gbnf(args.grammar)


def sampling_of(args: argparse.Namespace) -> dict:
    """LLM.generate's sampling keywords from the flags."""
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        grammar=grammar_of(args),
    )


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on stdin/stdout; earlier turns' K/V kept in the prompt cache."""
    from specdec.api import build_llm
    from specdec.chat import run
    from specdec.runtime.prefix_cache import SERVE_BUDGET_MB

    sampling = sampling_of(args)
    llm = build_llm(args, cache_mb=SERVE_BUDGET_MB)
    if args.ignore_eos:
        llm.engine.stop_ids = set()
    return run(llm, args.system, **sampling)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.chat and args.prompt is None and args.file is None:
        return cmd_chat(args)  # as llama-cli -cnv: a conversation
    if (args.prompt is None) == (args.file is None):
        raise SpecdecError("give exactly one of -p PROMPT or -f FILE (or -cnv alone for a conversation)")
    if args.file == "-":
        prompt = sys.stdin.read()
    elif args.file is not None:
        try:
            prompt = Path(args.file).read_text()
        except OSError as e:
            raise SpecdecError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    else:
        prompt = args.prompt
    from specdec.api import build_llm
    from specdec.chat import footer

    sampling = sampling_of(args)
    llm = build_llm(args, progress=not args.json)
    if args.ignore_eos:
        llm.engine.stop_ids = set()
    stream = None if args.json else lambda s: print(s, end="", flush=True)
    r = llm.generate(prompt, chat=args.chat, system=args.system, on_text=stream, **sampling)
    if args.json:
        keys = (
            "new_tokens",
            "target_forwards",
            "drafted",
            "accepted",
            "relaxed",
            "acceptance_rate",
            "mean_accept_len",
            "tokens_per_s",
        )
        d = r.stats.to_dict()
        print(
            json.dumps(
                {
                    "text": r.text,
                    "token_ids": r.token_ids,
                    "stats": {k: d[k] for k in keys},
                    "timings": {k: d[k] for k in ("prefill_s", "draft_s", "verify_s", "total_s")},
                    "per_position_acceptance": d["per_position_acceptance"],
                    "spec_type": llm.spec_type,
                    "quant": llm.quant_info,
                    "fast_prefill": llm.config.fast_prefill,
                    "finish_reason": r.finish_reason,
                    "synthetic": r.synthetic,
                    "lossless": r.lossless,
                }
            )
        )
    else:
        print("\n\n" + footer(llm, r), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specdec.models import packs

    if args.action == "list":
        for name in args.names or []:
            print(_describe(name))
        if args.names:
            return 0
        for p in packs.PACKS.values():
            state = "pulled" if packs.is_pulled(p.name) else "not pulled"
            print(f"{p.name:22} {state:11} {p.description}")
        _list_heads()
        return 0
    for name in args.names or []:
        print(f"{name}: {packs.pull(name)}")
    if not args.names:
        raise SpecdecError("models pull needs at least one NAME")
    return 0


def _describe(name: str) -> str:
    """One line for a GGUF file or a checkpoint directory: its family, layers and the MTP layers it ships."""
    from specdec.models.config import ModelConfig
    from specdec.models.gemma4_assistant import is_assistant
    from specdec.models.gguf_convert import config_from_gguf, open_gguf
    from specdec.models.mtp import native_blocks
    from specdec.models.packs import local_path

    path = local_path(name)
    if is_assistant(path):
        return f"{name}: a Gemma 4 assistant, the drafter of a gemma4 target (--spec-type mtp -md {name})"
    if path.is_dir():
        cfg = ModelConfig.from_file(path / "config.json")
    else:
        cfg = config_from_gguf(open_gguf(path), path)
    linear = f" ({len(cfg.linear_layers)} linear-attention)" if cfg.linear_layers else ""
    mtp = native_blocks(path)
    own = f", {mtp} MTP layer{'s' * (mtp > 1)} (--spec-type mtp)" if mtp else ", no MTP layers"
    return f"{name}: {cfg.family}, {cfg.num_layers} layers{linear}{own}"


def _list_heads() -> None:
    """The trained drafter heads `--spec-type KIND` finds, per target (the first of a kind and target is used)."""
    from specdec.drafters.heads import list_heads

    heads = list_heads()
    if heads:
        print("\ntrained heads (--spec-type KIND uses the first of its kind for the target):")
    for h in heads:
        state = ("finished" if h.finished else "unfinished") + (", shipped" if h.shipped else "")
        tau = f"tau {h.tau:.2f}" if h.tau is not None else "tau -"
        print(f"{h.kind:8} {h.target:22} {state:20} {tau:9} {h.megabytes:7.1f} MB  {h.path}")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "serve":
        from specdec.bench.serve_bench import run_serve_bench

        run_serve_bench(args)
        return 0
    if args.what == "replay":
        from specdec.bench.replay import run_replay

        run_replay(args)
        return 0
    if args.what == "relaxed":
        from specdec.bench.code_check import run_relaxed

        run_relaxed(args)
        return 0
    from specdec.bench.runner import run_bench

    run_bench(args)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.server.serve import run_server

    return run_server(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from specdec.plan import PlanInputs, make_plan
    from specdec.plan.export import export
    from specdec.plan.report import render, to_dict

    plan = make_plan(
        PlanInputs(
            model=args.model,
            draft=args.draft,
            context=args.context,
            draft_context=args.draft_context,
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            quant=args.quant,
            draft_quant=args.draft_quant,
            kv_dtype=args.kv_dtype,
            slots=args.parallel,
            gpu=args.gpu,
            gpu_mem=args.gpu_mem,
            gpu_bw=args.gpu_bw,
            ram=args.ram,
            ram_bw=args.ram_bw,
            pcie_bw=args.pcie_bw,
            cpu=args.cpu,
            ngl=args.n_gpu_layers,
            ngld=args.n_gpu_layers_draft,
            task=args.task,
            accept=args.accept,
            draft_max=args.draft_max,
            spec_type=args.spec_type,
            export=args.export,
            x16={"yes": True, "no": False}.get(args.x16),
            cache_mb=args.cache_mb,
        )
    )
    if args.export:
        print(export(plan, args.export), end="")
    elif args.json:
        print(json.dumps(to_dict(plan), indent=2))
    else:
        print(render(plan), end="")
    return 0


def _add_plan_parser(sub) -> None:
    from specdec.models.loader import QUANT_CHOICES
    from specdec.plan.devices import CPUS, DEVICES
    from specdec.plan.export import ENGINES
    from specdec.plan.recommend import TASKS
    from specdec.runtime.prefix_cache import SERVE_BUDGET_MB

    pl = sub.add_parser(
        "plan",
        help="memory, context, GPU layers, speed and drafter for a model pair; "
        "the same setup for llama.cpp, Ollama, vLLM, TGI, transformers",
    )
    m = pl.add_argument_group("models")
    m.add_argument(
        "-m",
        "--model",
        help="target: pack name, GGUF file, checkpoint directory or config.json "
        "(default: qwen2.5-coder-1.5b with draft qwen2.5-coder-0.5b)",
    )
    m.add_argument("-md", "--model-draft", dest="draft", help="draft model (same forms as -m)")
    m.add_argument(
        "-c",
        "--ctx-size",
        dest="context",
        type=_positive_int,
        help="context per slot (default 4096, capped at the model's); more than the model allows is an error",
    )
    m.add_argument(
        "-cd",
        "--ctx-size-draft",
        dest="draft_context",
        type=_positive_int,
        help="draft context (default: -c, capped at the draft's maximum)",
    )
    m.add_argument("-np", "--parallel", type=_positive_int, default=1, help="parallel slots (default 1)")
    m.add_argument(
        "--cache-mb",
        type=int,
        default=SERVE_BUDGET_MB,
        metavar="MIB",
        help=f"specdec's prefix cache budget, as serve --cache-mb: counted in host memory (default "
        f"{SERVE_BUDGET_MB}, serve's)",
    )
    m.add_argument(
        "--dtype",
        help="auto|bf16|fp16|fp32: specdec's runtime with this compute dtype, as generate --dtype "
        "(default: auto; weights per --quant/--draft-quant); file: each tensor as stored, what llama.cpp "
        "and Ollama load (default with --export llama.cpp|ollama); or a GGML type such as q8_0, q4_k, "
        "iq4_xs (the file requantized, loaded by llama.cpp)",
    )
    m.add_argument("--draft-dtype", help="the draft's --dtype (default: --dtype)")
    for flag, who in (("--quant", "target"), ("--draft-quant", "draft")):
        m.add_argument(
            flag,
            choices=QUANT_CHOICES,
            default="auto",
            help=f"specdec's runtime, as generate {flag}: the {who}'s weights as gguf (the file's blocks "
            "through the kernels; x16 layout on AVX-512), int8, int4 or none (dense); auto: gguf for "
            "packs and GGUF files, none for checkpoints (default)",
        )
    m.add_argument(
        "--kv-dtype",
        default="auto",
        help="KV cache type: auto (the runtime's compute dtype; f16 with --dtype file or a GGML type), "
        "f32, f16, bf16, q8_0, q4_0...",
    )
    h = pl.add_argument_group("hardware")
    h.add_argument("--gpu", help=f"a named GPU ({', '.join(DEVICES)}) or none (default: detected with CUDA)")
    h.add_argument("--gpu-mem", help="GPU memory, e.g. 24GiB (default: the named or detected GPU's)")
    h.add_argument("--gpu-bw", help="GPU memory bandwidth, e.g. 1008GB/s")
    h.add_argument("--ram", help="system RAM, e.g. 64GiB (default: detected)")
    h.add_argument("--ram-bw", help="RAM bandwidth, e.g. 90GB/s (default: the --cpu profile)")
    h.add_argument("--cpu", help=f"CPU memory profile for --ram-bw: {', '.join(CPUS)} (default cpu-ddr5)")
    h.add_argument(
        "--x16",
        "--avx512",
        dest="x16",
        choices=["auto", "yes", "no"],
        default="auto",
        help="whether the planned CPU runs the kernels' x16 layout (AVX2 or AVX-512; --avx512 is the old "
        "name); auto: the --cpu profile's when it says, else this CPU's",
    )
    h.add_argument("--pcie-bw", help="GPU host link bandwidth (default: the GPU's PCIe generation, x16)")
    h.add_argument(
        "-ngl",
        "--n-gpu-layers",
        dest="n_gpu_layers",
        type=_layers,
        metavar="N",
        help="target layers on the GPU, N or all (default: as many as fit)",
    )
    h.add_argument(
        "-ngld",
        "--n-gpu-layers-draft",
        dest="n_gpu_layers_draft",
        type=_layers,
        metavar="N",
        help="draft layers on the GPU, N or all (default: all when they fit)",
    )
    w = pl.add_argument_group("workload and output")
    w.add_argument("--task", choices=list(TASKS), default="code", help="workload for the recommendation (code)")
    w.add_argument("--accept", type=float, help="draft acceptance rate to plan with (default: the task's)")
    w.add_argument("--draft-max", type=_positive_int, default=16, help="longest draft considered (16)")
    w.add_argument(
        "--spec-type",
        type=_spec_type,
        metavar="TYPE[,TYPE...]",
        help="export this spec type instead of the recommended one",
    )
    w.add_argument("--json", action="store_true", help="one JSON object")
    w.add_argument("--export", choices=list(ENGINES), help="print the equivalent setup for this engine")
    pl.set_defaults(func=cmd_plan)


TRAINERS = {
    "eagle3": "specdec.train.eagle3",
    "medusa": "specdec.train.medusa",
    "mtp": "specdec.train.mtp",
    "dflash": "specdec.train.dflash",
    "dspark": "specdec.train.dflash",
}  # kind -> trainer module


def _trainer(kind: str):
    import importlib

    return importlib.import_module(TRAINERS[kind])


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses
    import inspect

    import torch

    trainer = _trainer(args.kind)
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = args.cache
    if cache is None:
        from specdec.paths import home
        from specdec.train.data import build_cache

        name = f"{Path(args.model).name}-sharegpt-{args.prompts}x{args.max_new_tokens}"
        cache = build_cache(
            args.model,
            home() / "train" / name,
            args.prompts,
            max_new_tokens=args.max_new_tokens,
            threads=args.threads,
            progress=not args.no_progress,
        )
    own = {f.name for f in dataclasses.fields(trainer.TrainConfig)}
    other = {f.name for k in TRAINERS for f in dataclasses.fields(_trainer(k).TrainConfig)} - own
    wrong = sorted(f"--{n.replace('_', '-')}" for n in other if getattr(args, n, None) is not None)
    if wrong:
        raise SpecdecError(f"{', '.join(wrong)}: not a setting of specdec train {args.kind}")
    given = {n: getattr(args, n) for n in own if getattr(args, n, None) is not None}
    cfg = trainer.TrainConfig(**given, progress=not args.no_progress)
    kind = {"kind": args.kind} if "kind" in inspect.signature(trainer.train).parameters else {}  # one module, kinds
    m = trainer.train(
        args.model, cache, args.out, cfg, resume=args.resume, command=" ".join(["specdec", *sys.argv[1:]]), **kind
    )
    v, t = m["validation"], m["training"]
    print(
        f"{args.model}: validation tau {v['tau']} (acceptance per step {v['accept']}); {t['tokens']} tokens, "
        f"{t['epochs']} epochs, {t['hours']} h, {t['tok_s']} tok/s",
        file=sys.stderr,
    )
    return 0


def _default(name: str) -> str:
    """A training setting's default per kind: "3" when every trainer agrees, else "eagle3 3, medusa 2"."""
    values = {k: getattr(_trainer(k).TrainConfig, name, None) for k in TRAINERS}
    values = {k: v for k, v in values.items() if v is not None}
    if len(set(values.values())) == 1:
        return f"{next(iter(values.values()))}"
    return ", ".join(f"{k} {v}" for k, v in values.items())


def _add_train_parser(sub) -> None:
    kinds = "|".join(TRAINERS)
    t = sub.add_parser("train", help=f"train a drafter head on the target's own features ({kinds})")
    t.add_argument("kind", choices=list(TRAINERS), help="the head to train")
    t.add_argument("-m", "--model", required=True, help="target: model pack name, GGUF file or checkpoint directory")
    t.add_argument("-t", "--threads", type=_positive_int, help="CPU threads (default: torch's)")
    d = t.add_argument_group("data")
    d.add_argument(
        "--cache",
        help="a feature cache (specdec.train.data.build_cache); default: build or continue one "
        "under $SPECDEC_HOME/train from ShareGPT prompts (--prompts, --max-new-tokens)",
    )
    d.add_argument("--prompts", type=_positive_int, default=1000, help="conversations in the built cache (1000)")
    d.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=128,
        help="the target's response length cap in the built cache (128)",
    )
    h = t.add_argument_group("training (defaults per kind)")
    h.add_argument(
        "--draft-vocab",
        type=_positive_int,
        help=f"draft vocabulary: the most frequent response tokens ({_default('draft_vocab')}; mtp: "
        "the target's whole vocabulary)",
    )
    h.add_argument("--epochs", type=int, help=f"passes over the training split ({_default('epochs')})")
    h.add_argument("--lr", type=float, help=f"peak learning rate, cosine after warmup ({_default('lr')})")
    h.add_argument("--warmup", type=float, help=f"share of the steps spent warming up ({_default('warmup')})")
    h.add_argument(
        "--max-len",
        type=_positive_int,
        help=f"tokens per packed row; longer conversations are cut ({_default('max_len')})",
    )
    h.add_argument("--batch-tokens", type=_positive_int, help=f"tokens per optimizer step ({_default('batch_tokens')})")
    h.add_argument(
        "--max-hours",
        type=float,
        help="stop after this many hours over all runs of the checkpoint; the learning rate decays to zero by then",
    )
    h.add_argument(
        "--val-share", type=float, help=f"share of conversations held out for validation ({_default('val_share')})"
    )
    h.add_argument("--device", choices=["cpu", "cuda"], help="where to train (the same code; cpu)")
    h.add_argument(
        "--autocast",
        choices=["auto", "bf16", "fp32"],
        help="bf16 autocast; auto (default): on a GPU or a CPU with bf16 instructions",
    )
    e = t.add_argument_group("eagle3 and mtp")
    e.add_argument("--intermediate", type=_positive_int, help="the head's MLP width (default: the target's)")
    e.add_argument("--ttt", type=int, help=f"training-time test: unrolled draft steps ({_default('ttt')})")
    m = t.add_argument_group("medusa")
    m.add_argument("--num-heads", type=_positive_int, help=f"heads, one per future token ({_default('num_heads')})")
    m.add_argument(
        "--num-layers",
        type=_positive_int,
        help=f"medusa: residual blocks per head; dflash, dspark: draft layers ({_default('num_layers')})",
    )
    m.add_argument(
        "--labels", choices=["soft", "hard"], help="soft: the target's distribution (default); hard: the data token"
    )
    b = t.add_argument_group("dflash and dspark")
    b.add_argument(
        "--block-size", type=_positive_int, help="tokens per block, the anchor included (dflash 8, dspark 7)"
    )
    b.add_argument("--anchors", type=_positive_int, help=f"blocks per packed row ({_default('anchors')})")
    b.add_argument("--gamma", type=float, help="loss decay over draft positions (7 for blocks of 16+, else 4)")
    b.add_argument("--markov-rank", type=_positive_int, help=f"dspark: Markov head rank ({_default('markov_rank')})")
    b.add_argument(
        "--confidence-alpha", type=float, help=f"dspark: confidence head loss weight ({_default('confidence_alpha')})"
    )
    o = t.add_argument_group("output")
    o.add_argument(
        "--out", help="the head's directory (default $SPECDEC_HOME/heads/KIND-TARGET, where --spec-type KIND finds it)"
    )
    o.add_argument(
        "--save-dtype",
        choices=["fp32", "bf16", "int8"],
        help="the saved weights (fp32); int8: weight matrices in int8 with per-row scales, read back in fp32",
    )
    o.add_argument(
        "--checkpoint-minutes",
        type=float,
        help=f"checkpoint, validate and save the head this often ({_default('checkpoint_minutes')})",
    )
    o.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)


def make_parser() -> argparse.ArgumentParser:
    from specdec import __version__
    from specdec.bench.runner import all_methods
    from specdec.drafters import spec_types
    from specdec.runtime.prefix_cache import SERVE_BUDGET_MB

    p = _Parser(prog="specdec", description="Lossless speculative decoding for local LLMs.")
    p.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("-p", "--prompt", help="prompt text")
    g.add_argument("-f", "--file", help="read the prompt from a file (- = standard input)")
    g.add_argument(
        "-cnv",
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template; without -p/-f: a conversation, as `specdec chat`",
    )
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past end-of-text tokens, to -n tokens (as llama.cpp's --ignore-eos)",
    )
    add_sampling_args(g)  # the common flags first in --help, drafter options after
    add_grammar_args(g)
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat",
        help="a conversation on standard input (/bye or Ctrl-D to leave, /clear to start over)",
        description="Answer each line typed (or piped) in the model's chat template, keeping the conversation; "
        "earlier turns stay in the prompt cache. " + "/bye or Ctrl-D: leave; /clear: forget the conversation.",
    )
    c.add_argument("--system", help="system message")
    c.add_argument("--ignore-eos", action="store_true", help="go on past end-of-text tokens, to -n tokens")
    add_sampling_args(c)
    add_grammar_args(c)
    add_model_args(c)
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list or pull model packs; list FILE/DIR: what a model is and ships")
    m.add_argument("action", choices=["list", "pull"])
    m.add_argument(
        "names", nargs="*", help="pack names for pull; for list, GGUF files or checkpoint directories to describe"
    )
    m.set_defaults(func=cmd_models)

    b = sub.add_parser(
        "bench",
        help="measure speculative methods against plain decoding and the peers",
        epilog="A method that fails in a bench run (an error while loading, warming up or running "
        "it: a drafter error, llama-server dying) is left out and the others go on: results.json and "
        "report.md record it with its reason, stderr has a line for it, and the exit status is 1 once "
        "the others' results are written. A peer that cannot run a combination (no --llama-server, "
        "llama-eagle3 on a target whose llama.cpp graph lacks what EAGLE-3 reads) is skipped before it "
        "starts, with its reason, and leaves the exit status 0.",
    )
    b.add_argument(
        "what",
        nargs="?",
        choices=["serve", "replay", "relaxed"],
        help="serve: sweep concurrency against the live server (off / on / auto speculation); replay: "
        "record plain outputs and forward costs once (--record), then replay model-free spec types "
        "against them in virtual time (--from); relaxed: --spec-type (default draft) at each of "
        "--thresholds on HumanEval problems: speed, agreement with plain decoding, pass rate",
    )
    w = b.add_argument_group("workload")
    w.add_argument(
        "--workload",
        default="quick",
        help="quick (3 built-in prompts), multi-turn (4 built-in code conversations of 4 turns), rag (8 "
        "questions about one ~850-token document), spec_bench (the Spec-Bench questions), multilingual (21 "
        "questions in en, de, nl, it, ja, ko; category = language) or a JSONL file of "
        '{"id", "category", "prompt" | "turns", "max_tokens"} lines; several comma-separated '
        "(default quick)",
    )
    w.add_argument("--quick", dest="workload", action="store_const", const="quick", help="same as --workload quick")
    w.add_argument(
        "--workload-dir",
        help="folder with Spec-Bench's question.jsonl (default ../shared/workloads/spec_bench beside the repo)",
    )
    w.add_argument("--per-category", type=_positive_int, help="sample N prompts per category (fixed --seed)")
    w.add_argument(
        "--categories",
        type=lambda v: [c.strip() for c in v.split(",") if c.strip()],
        help="only these categories, comma-separated (after --per-category sampling, so the same "
        "prompts as a run over all categories)",
    )
    w.add_argument(
        "-n",
        "--max-tokens",
        "--n-predict",
        dest="max_tokens",
        type=_positive_int,
        help="cap on new tokens per turn (default: the prompt's max_tokens, else 128; 64 for bench serve)",
    )
    w.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy, outputs checked (default 0)")
    w.add_argument("--seed", type=int, default=0, help="seed for --per-category sampling and sampled runs (0)")
    w.add_argument(
        "--unseeded",
        action="store_true",
        help="sampled runs without a seed (rejection sampling); default: seeded, each token a function "
        "of (seed, position) and verified by exact match",
    )
    r = b.add_argument_group("methods and measurement")
    r.add_argument(
        "--methods",
        default=",".join((*spec_types(lossy=False, heads=False), "hf-plain")),
        help=f"comma-separated, or all: {', '.join(all_methods())} (default: ours but trained heads, and "
        "hf-plain; all: every lossless method but trained heads)",
    )
    r.add_argument("--repeat", type=_positive_int, default=1, help="runs per prompt and method (median reported)")
    r.add_argument(
        "--llama-server",
        metavar="PATH|auto",
        help="llama-server binary for the llama-* methods; auto: build it once (~20-30+ min on 2 cores; "
        "needs cmake and g++) from the llama.cpp source pinned in the llama-cpp-python 0.3.36 sdist, "
        "for this CPU, cached under $SPECDEC_HOME/llama.cpp",
    )
    r.add_argument("--out", help="output folder (default bench-out/DATE-TIME)")
    sb = b.add_argument_group("bench serve")
    sb.add_argument("--concurrency", default="1,2,4,8,16", help="client concurrency levels (default 1,2,4,8,16)")
    sb.add_argument(
        "--modes",
        default="off,on,auto",
        help="off (no speculation), on (speculate at any load), auto (load controller), each also as "
        "MODE-nocache (cache_prompt: false; with --cache-mb); default off,on,auto",
    )
    sb.add_argument(
        "--passes",
        type=_positive_int,
        default=2,
        help="runs of every mode per level, alternating the order (as given, then reversed, ...); "
        "figures: means over passes, ratios: geometric means of each pass's (default 2)",
    )
    sb.add_argument(
        "--requests",
        type=_positive_int,
        help="conversations per level and mode, a request per turn (default max(4, 2 x concurrency))",
    )
    sb.add_argument(
        "--cache-mb",
        type=int,
        default=SERVE_BUDGET_MB,
        metavar="MIB",
        help=f"bench serve: the server's prefix cache, as serve --cache-mb (default {SERVE_BUDGET_MB})",
    )
    rp = b.add_argument_group("bench replay")
    rp.add_argument("--record", metavar="FILE", help="run plain decoding over the workload; save outputs and costs")
    rp.add_argument("--from", dest="replay_from", metavar="FILE", help="replay --methods against a recording")
    rx = b.add_argument_group("bench relaxed")
    rx.add_argument(
        "--thresholds",
        default="0.5,0.7,0.9",
        help="relaxed-acceptance thresholds to measure, besides 0 (lossless); default 0.5,0.7,0.9",
    )
    rx.add_argument("--problems", type=_positive_int, default=20, help="HumanEval problems, the first N (default 20)")
    add_model_args(b)
    b.set_defaults(func=cmd_bench)

    from specdec.server.serve import add_serve_args

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative decoding")
    add_serve_args(sv, _positive_int)
    add_sampling_args(sv)
    add_model_args(sv)
    sv.set_defaults(func=cmd_serve)

    _add_plan_parser(sub)
    _add_train_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `specdec` alone: the usage with the commands, as a usage error
        parser.print_help(sys.stderr)
        return 2
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
