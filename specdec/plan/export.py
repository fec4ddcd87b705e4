"""The same setup in other engines: llama.cpp, Ollama, vLLM, TGI, transformers.

Flag names are those of current releases (llama.cpp's `--spec-*` names, vLLM's
`--speculative-config` JSON); each export says in comments what the engine cannot express.
"""

from __future__ import annotations

import json
import math
import shlex

from specdec.errors import SpecdecError
from specdec.plan.planner import Plan
from specdec.plan.specs import ModelSpec

ENGINES = ("llama.cpp", "ollama", "vllm", "tgi", "transformers")
# our spec type -> llama.cpp --spec-type
LLAMA_SPEC = {
    "draft": "draft-simple",
    "ngram-simple": "ngram-simple",
    "ngram-map-k": "ngram-map-k",
    "ngram-map-k4v": "ngram-map-k4v",
    "ngram-map-k-tree": "ngram-map-k",
    "ngram-mod": "ngram-mod",
    "suffix": "ngram-mod",
    "suffix-tree": "ngram-mod",
}
NGRAM_N, NGRAM_M = 3, 16  # specdec's --spec-ngram-size-n / -m defaults


def export(plan: Plan, engine: str) -> str:
    fns = {"llama.cpp": llama_cpp, "ollama": ollama, "vllm": vllm, "tgi": tgi, "transformers": transformers}
    if engine not in fns:
        raise SpecdecError(f"unknown export engine {engine!r} (choose {', '.join(ENGINES)})")
    parts = plan.spec_type.split(",")
    if "synthetic" in parts:
        raise SpecdecError("spec type synthetic is a measuring tool with non-target output; it has no export")
    return fns[engine](plan).rstrip() + "\n"


def _gguf(spec: ModelSpec) -> tuple[str, list[str]]:
    if spec.gguf_path is not None:
        return str(spec.gguf_path), []
    return f"{spec.label}.gguf", [
        f"# {spec.label} is not a GGUF file: convert it first, e.g. "
        f"python convert_hf_to_gguf.py {spec.path} --outfile {spec.label}.gguf"
    ]


def _hf(spec: ModelSpec) -> tuple[str, list[str]]:
    """A name hub-loading engines accept: the pack's Hugging Face repo, the checkpoint dir, or the GGUF path."""
    if spec.hf_repo:
        return spec.hf_repo, []
    if spec.kind == "gguf":
        return str(spec.path), [
            f"# {spec.label} is a GGUF file; these engines load GGUF experimentally, "
            "the original Hugging Face checkpoint is the safer input"
        ]
    return str(spec.path.parent if spec.kind == "config" else spec.path), []


def _cmd(args: list[str]) -> str:
    """One argument per line pair, shell-quoted, continued with backslashes."""
    out, line = [], [shlex.quote(args[0])]
    i = 1
    while i < len(args):
        group = [args[i]]
        if i + 1 < len(args) and not args[i + 1].startswith("-"):
            group.append(args[i + 1])
        i += len(group)
        piece = " ".join(shlex.quote(g) for g in group)
        if sum(len(x) + 1 for x in line) + len(piece) > 90:
            out.append(" ".join(line) + " \\")
            line = ["  " + piece]
        else:
            line.append(piece)
    out.append(" ".join(line))
    return "\n".join(out)


def _uses_draft(plan: Plan) -> bool:
    return plan.uses_draft


def llama_cpp(plan: Plan) -> str:
    s, t, d = plan.chosen, plan.target, plan.draft
    notes: list[str] = []
    tpath, n1 = _gguf(t.spec)
    notes += n1
    slots = plan.inputs.slots
    args = [
        "llama-server",
        "-m",
        tpath,
        "-c",
        str(t.context * slots),
        "-np",
        str(slots),
        "-ngl",
        str(s.ngl),
        "-fa",
        "on",
    ]
    if t.fmt.kv != "F16":
        args += ["-ctk", t.fmt.kv.lower(), "-ctv", t.fmt.kv.lower()]
    parts = plan.spec_type.split(",")
    if parts != ["none"]:
        missing = [p for p in parts if p not in LLAMA_SPEC]
        if missing:
            raise SpecdecError(f"spec type {missing[0]} has no llama.cpp equivalent")
        kinds = [LLAMA_SPEC[p] for p in parts]
        if {"suffix", "suffix-tree"} & set(parts):
            notes.append(
                "# llama.cpp has no suffix drafter; ngram-mod (one hash pool shared by all requests) is the closest"
            )
        if any(p.endswith("-tree") for p in parts):
            notes.append("# llama.cpp drafts chains only: the tree spec types export as their chain drafters")
        if _uses_draft(plan) and d is not None:
            dpath, n2 = _gguf(d.spec)
            notes += n2
            args += ["-md", dpath, "-cd", str(d.context * slots), "-ngld", str(s.ngld or 0)]
            if d.fmt.kv != "F16":
                args += ["--spec-draft-type-k", d.fmt.kv.lower(), "--spec-draft-type-v", d.fmt.kv.lower()]
        args += [
            "--spec-type",
            ",".join(dict.fromkeys(kinds)),
            "--spec-draft-n-max",
            str(plan.k),
            "--spec-draft-n-min",
            "0",
        ]
        if "ngram-simple" in kinds:
            args += ["--spec-ngram-simple-size-n", str(NGRAM_N), "--spec-ngram-simple-size-m", str(NGRAM_M)]
        for kind in ("ngram-map-k", "ngram-map-k4v"):
            if kind in kinds:
                args += [f"--spec-{kind}-size-n", str(NGRAM_N), f"--spec-{kind}-size-m", str(NGRAM_M)]
        if "ngram-mod" in kinds:
            args += ["--spec-ngram-mod-n-match", str(NGRAM_N)]
        notes.append(
            "# builds before the --spec-draft-* names: --draft-max/--draft-min for --spec-draft-n-max/-n-min"
            + (", and -md alone selects the draft model" if _uses_draft(plan) else "")
        )
    if t.fmt.runtime:
        notes.append(
            "# layer counts come from a specdec-runtime plan (--dtype auto|bf16...); `specdec plan --dtype "
            "file` sizes them for llama.cpp"
        )
    if plan.hw.gpu is None:
        notes.append("# CPU only: -ngl 0")
    notes.append(f"# -c is the total over -np {slots} slot(s): {t.context} tokens each")
    return "\n".join([_cmd(args), *notes])


def ollama(plan: Plan) -> str:
    s, t = plan.chosen, plan.target
    tpath, notes = _gguf(t.spec)
    lines = [
        "# Modelfile",
        f"FROM {tpath}",
        f"PARAMETER num_ctx {t.context}",
        f"PARAMETER num_gpu {s.ngl}",
        "PARAMETER temperature 0",
        *notes,
    ]
    if plan.spec_type != "none":
        lines.append(
            f"# Ollama has no speculative decoding (ollama/ollama#5800): --spec-type {plan.spec_type} "
            "and the draft model are dropped; the llama.cpp export keeps them"
        )
    if t.fmt.kv != "F16":
        lines.append(f"# KV cache {t.fmt.kv.lower()}: OLLAMA_KV_CACHE_TYPE={t.fmt.kv.lower()} OLLAMA_FLASH_ATTENTION=1")
    lines += [
        f"# parallel requests: OLLAMA_NUM_PARALLEL={plan.inputs.slots} (each gets num_ctx)",
        "ollama create specdec-plan -f Modelfile && ollama run specdec-plan",
    ]
    return "\n".join(lines)


def _hf_dtype(plan: Plan) -> str | None:
    """The torch dtype name for engines that load the Hugging Face weights: the plan's compute dtype when specdec's
    runtime holds them dense or int8/int4 (a gguf plan's fp32 is the CPU kernels' choice: None, the engine's own)."""
    f = plan.target.fmt
    if not f.runtime or f.quant == "gguf":
        return None
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[f.weights]


HF_MARGIN = 2 * 2**30  # CUDA context, CUDA graphs and activation peaks in hub-loading engines (approximate)


def _hf_need(plan: Plan) -> int:
    """GPU bytes for engines that load the Hugging Face weights: bf16 weights, f16 KV for every slot, a margin."""
    t, d = plan.target, plan.draft
    need = 2 * t.spec.params + _kv_f16(t) + HF_MARGIN
    if plan.uses_draft and d is not None:
        need += 2 * d.spec.params + _kv_f16(d)
    return need


def _kv_f16(m) -> int:
    dims = m.spec.dims
    return dims.num_layers * dims.num_kv_heads * (dims.head_dim_k + dims.head_dim_v) * m.context * m.slots * 2


def _gpu_fraction(plan: Plan) -> float | None:
    if not plan.hw.gpu_mem:
        return None
    return max(0.05, min(0.95, math.ceil(100 * _hf_need(plan) / plan.hw.gpu_mem) / 100))


def _cpu_offload_gib(plan: Plan) -> int:
    if not plan.hw.gpu_mem:
        return 0
    over = _hf_need(plan) - int(0.95 * plan.hw.gpu_mem)
    return math.ceil(over / 2**30) if over > 0 else 0


def vllm(plan: Plan) -> str:
    t, d = plan.target, plan.draft
    model, notes = _hf(t.spec)
    args = ["vllm", "serve", model, "--max-model-len", str(t.context), "--max-num-seqs", str(plan.inputs.slots)]
    dtype = _hf_dtype(plan)
    if dtype:
        args += ["--dtype", dtype]
    frac = _gpu_fraction(plan)
    if frac is not None:
        args += ["--gpu-memory-utilization", f"{frac:.2f}"]
        notes.append(
            f"# sized for bf16 weights, f16 KV for {t.context} x {plan.inputs.slots} tokens and 2 GiB "
            "for CUDA graphs and activations; raise it to batch more requests"
        )
    offload = _cpu_offload_gib(plan)
    if offload:
        args += ["--cpu-offload-gb", str(offload)]
        notes.append(f"# {offload} GiB of weights stay in CPU memory (vLLM's counterpart of a partial -ngl)")
    parts = [p for p in plan.spec_type.split(",") if p != "none"]
    cfg = None
    if "draft" in parts and d is not None:
        dmodel, n2 = _hf(d.spec)
        notes += n2
        cfg = {"method": "draft_model", "model": dmodel, "num_speculative_tokens": plan.k}
    elif {"suffix", "suffix-tree"} & set(parts):
        cfg = {"method": "suffix", "num_speculative_tokens": plan.k}
    elif parts:
        cfg = {
            "method": "ngram",
            "num_speculative_tokens": plan.k,
            "prompt_lookup_max": NGRAM_N,
            "prompt_lookup_min": NGRAM_N,
        }
    if cfg is not None:
        args += ["--speculative-config", json.dumps(cfg)]
        if len(parts) > 1:
            notes.append(f"# vLLM runs one drafter: {cfg['method']} from the chain {plan.spec_type}")
    if plan.hw.gpu is None:
        notes.append("# vLLM targets GPUs; on this CPU-only plan use specdec or llama.cpp")
    return "\n".join([_cmd(args), *notes])


def tgi(plan: Plan) -> str:
    t = plan.target
    model, notes = _hf(t.spec)
    args = [
        "text-generation-launcher",
        "--model-id",
        model,
        "--max-input-tokens",
        str(max(t.context - 1, 1)),
        "--max-total-tokens",
        str(t.context),
    ]
    if plan.spec_type != "none":
        args += ["--speculate", str(plan.k)]
        notes.append(
            "# TGI's --speculate drafts with n-grams (or the model's Medusa heads); it has no separate "
            f"draft model, so --spec-type {plan.spec_type} maps to n-gram speculation"
        )
    frac = _gpu_fraction(plan)
    if frac is not None:
        args += ["--cuda-memory-fraction", f"{frac:.2f}"]
    return "\n".join([_cmd(args), *notes])


def transformers(plan: Plan) -> str:
    t, d = plan.target, plan.draft
    model, notes = _hf(t.spec)
    load = f"dtype=torch.{_hf_dtype(plan) or 'bfloat16'}"
    if plan.hw.gpu is not None:
        mem = {0: f"{plan.hw.gpu_mem // 2**30}GiB", "cpu": f"{plan.hw.ram // 2**30}GiB"}
        load += f', device_map="auto", max_memory={mem!r}'
    gguf = ""
    if t.spec.kind == "gguf" and t.spec.path is not None:
        model, gguf = str(t.spec.path.parent), f", gguf_file={t.spec.path.name!r}"
    lines = [
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"tok = AutoTokenizer.from_pretrained({model!r}{gguf})",
        f"model = AutoModelForCausalLM.from_pretrained({model!r}{gguf}, {load})",
    ]
    parts = plan.spec_type.split(",")
    extra = ""
    if "draft" in parts and d is not None:
        dmodel, n2 = _hf(d.spec)
        notes += n2
        dg = ""
        if d.spec.kind == "gguf" and d.spec.path is not None:
            dmodel, dg = str(d.spec.path.parent), f", gguf_file={d.spec.path.name!r}"
        lines.append(f"draft = AutoModelForCausalLM.from_pretrained({dmodel!r}{dg}, {load})")
        extra = f", assistant_model=draft, num_assistant_tokens={plan.k}"
        if len(parts) > 1:
            notes.append(f"# transformers runs one drafter: the assistant model from the chain {plan.spec_type}")
    elif parts != ["none"]:
        extra = f", prompt_lookup_num_tokens={min(plan.k, 10)}"
        if parts != ["ngram-simple"]:
            notes.append(f"# transformers has prompt lookup only: --spec-type {plan.spec_type} maps to it")
    lines += [
        'msgs = [{"role": "user", "content": "Write a quicksort in Python"}]',
        'inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", '
        "return_dict=True).to(model.device)",
        f"out = model.generate(**inputs, max_new_tokens=256, do_sample=False{extra})",
        'print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
    ]
    return "\n".join(lines + notes)
