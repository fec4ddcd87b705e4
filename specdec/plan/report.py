"""A plan as a human-readable report or as one JSON-able dict."""

from __future__ import annotations

from specdec.plan.memory import GPU_CONTEXT, ModelMemory, RuntimeRSS
from specdec.plan.planner import Plan, Setup
from specdec.plan.speed import best_k, expected_tokens, speedup
from specdec.plan.units import fmt_bw, fmt_bytes

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _fmt_desc(m: ModelMemory) -> str:
    return f"{m.fmt.path}, KV {m.fmt.kv.lower()}"


def _range(values: list[int]) -> str:
    lo, hi = fmt_bytes(min(values)), fmt_bytes(max(values))
    return lo if lo == hi else f"{lo.split()[0]}-{hi}"


def _n(x: float) -> str:
    return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.0f}M"


def _model_dict(m: ModelMemory) -> dict:
    s, d = m.spec, m.spec.dims
    return {
        "name": s.label,
        "kind": s.kind,
        "path": str(s.path) if s.path else None,
        "arch": d.arch,
        "params": s.params,
        "active_params": s.active_params,
        "experts": {"count": d.experts, "per_token": d.experts_used} if d.experts else None,
        "forward_read_bytes": {str(r): m.forward_read(r) for r in VERIFY_ROWS},
        "layers": d.num_layers,
        "kv_heads": d.num_kv_heads,
        "head_dim": d.head_dim_k,
        "hidden": d.hidden,
        "vocab": d.vocab,
        "max_context": d.max_ctx,
        "tied_embeddings": d.tied,
        "file_bytes": s.file_bytes,
        "stored_types": s.type_summary(),
        "runtime_supported": s.runtime_supported,
        "format": {
            "engine": m.fmt.style,
            "path": m.fmt.path,
            "weights": m.fmt.weights,
            "kv": m.fmt.kv,
            "quant": m.fmt.quant,
            "x16": m.fmt.x16,
        },
        "context": m.context,
        "kv_rows_per_slot": m.kv_rows,
        "memory": {
            "weights": m.weights,
            "per_layer": m.layer_weights,
            "embeddings": m.embed,
            "head": m.head,
            "other": m.other,
            "kv": m.kv,
            "kv_per_layer": m.kv_layer,
            "kv_per_token": m.kv_per_token,
            "compute": m.compute,
            "compute_note": m.compute_note,
            "total": m.total,
        },
    }


def _setup_dict(s: Setup | None) -> dict | None:
    if s is None:
        return None
    return {
        "ngl": s.ngl,
        "ngld": s.ngld,
        "target_gpu_layers": s.target.gpu_layers,
        "draft_gpu_layers": s.draft.gpu_layers if s.draft else None,
        "gpu_bytes": s.gpu_need,
        "ram_bytes": s.ram_need,
        "fits": s.fits,
        "why_not": s.why or None,
        "target_tps_bound": s.target_step.tokens_per_s,
        "target_tps_bound_full_context": s.target_step_full.tokens_per_s,
        "draft_tps_bound": s.draft_step.tokens_per_s if s.draft_step else None,
        "step_seconds": {"gpu": s.target_step.gpu_s, "cpu": s.target_step.cpu_s, "link": s.target_step.link_s},
    }


def to_dict(plan: Plan) -> dict:
    hw = plan.hw
    out = {
        "hardware": {
            "gpu": hw.gpu,
            "unified_memory": hw.unified,
            "gpu_mem": hw.gpu_mem,
            "gpu_bw": hw.gpu_bw,
            "pcie_bw": hw.pcie_bw,
            "ram": hw.ram,
            "ram_bw": hw.ram_bw,
            "x16": hw.x16,
            "sources": hw.sources,
            "gpu_overhead": GPU_CONTEXT if hw.gpu else 0,
        },
        "target": _model_dict(plan.target),
        "draft": _model_dict(plan.draft) if plan.draft else None,
        "slots": plan.inputs.slots,
        "setup": _setup_dict(plan.chosen),
        "with_draft": _setup_dict(plan.with_draft),
        "without_draft": _setup_dict(plan.alone),
        "context": {
            "target": plan.target.context,
            "draft": plan.draft.context if plan.draft else None,
            "max_all_on_gpu": plan.max_context_gpu,
            "max_that_fits": plan.max_context,
            "per_1k_bytes": plan.per_1k_bytes,
            "per_1k_target_layers": plan.per_1k_layers,
        },
        "speculative": {
            "alpha": plan.alpha,
            "alpha_source": plan.alpha_source,
            "cost_ratio": plan.cost_ratio,
            "draft_length": plan.draft_k,
            "speedup": plan.draft_gain,
            "break_even_alpha": plan.break_even,
            "draft_pays": plan.draft_pays,
            "why_not": plan.why_not,
            "table": _table(plan) if plan.cost_ratio is not None else [],
        },
        "chosen": {"spec_type": plan.spec_type, "draft_max": plan.k, "speedup": plan.gain},
        "expected_tps": plan.expected_tps,
        "recommendation": plan.recommendation.to_dict(),
        "spec_type": plan.spec_type,
        "specdec_runtime_rss": None
        if plan.rss is None
        else {
            "steady": plan.rss.steady,
            "load_peak": plan.rss.load_peak,
            "peak": plan.rss.peak,
            "parts": plan.rss.parts,
            "phases": plan.rss.phases,
            "load_note": plan.rss.load_note,
        },
        "drafter_memory": plan.heads,
        "notes": plan.notes,
    }
    return out


def _table(plan: Plan) -> list[dict]:
    c = plan.cost_ratio or 0.0
    rows = []
    for a in ALPHAS:
        v = plan.target.verify_cost
        k, g = best_k(a, c, plan.inputs.draft_max, v)
        rows.append({"alpha": a, "best_k": k, "speedup": g, "speedup_at_k": speedup(a, plan.draft_k or k, c, v)})
    return rows


def render(plan: Plan) -> str:
    models = [("target", plan.target)] + ([("draft", plan.draft)] if plan.draft else [])
    sections = [
        _header(plan),
        _models_table(models) + _experts_lines(plan.target),
        _memory_table(models),
        [_placement_line(plan, plan.chosen), _context_line(plan)],
        _speed_lines(plan),
        _recommendation_lines(plan),
    ]
    if plan.rss is not None:
        sections.append(_rss_lines(plan.rss))
    lines = [line for sec in sections for line in sec + [""]][:-1]  # sections apart by a blank line
    return "\n".join(lines + [f"note: {n}" for n in plan.notes]) + "\n"


def _header(plan: Plan) -> list[str]:
    t, d, hw = plan.target, plan.draft, plan.hw
    engine = "specdec's runtime" if t.fmt.runtime else "llama.cpp"
    if hw.gpu:
        gpu = f"GPU {hw.gpu}: {fmt_bytes(hw.gpu_mem or 0)} ({hw.sources.get('gpu_mem')}), {fmt_bw(hw.gpu_bw or 0)}" + (
            f", link {fmt_bw(hw.pcie_bw)}" if hw.pcie_bw else ", unified"
        )
    else:
        gpu = "no GPU"
    return [
        f"specdec plan · {plan.inputs.slots} slot(s) · {engine} · target {_fmt_desc(t)}"
        + (f" · draft {_fmt_desc(d)}" if d else ""),
        f"hardware: {gpu} · RAM {fmt_bytes(hw.ram)} ({hw.sources.get('ram')}) at {fmt_bw(hw.ram_bw)} "
        f"({hw.sources.get('ram_bw')}) · x16 layout {'yes' if hw.x16 else 'no'} ({hw.sources.get('x16')})",
    ]


def _models_table(models: list[tuple[str, ModelMemory]]) -> list[str]:
    L = [
        f"{'model':24} {'role':6} {'arch':7} {'params':>7} {'layers':>6} {'kv heads x dim':>14} {'max ctx':>7}  "
        "stored as"
    ]
    for role, m in models:
        sp = m.spec
        L.append(
            f"{sp.label[:24]:24} {role:6} {sp.dims.arch[:7]:7} {_n(sp.params):>7} {sp.dims.num_layers:>6} "
            f"{f'{sp.dims.num_kv_heads} x {sp.dims.head_dim_k}':>14} {sp.dims.max_ctx:>7}  "
            f"{sp.type_summary()} ({fmt_bytes(sp.file_bytes)})"
        )
    return L


VERIFY_ROWS = (1, 2, 4, 8, 16)


def _experts_lines(m: ModelMemory) -> list[str]:
    """A mixture of experts: active parameters, and the weight bytes a forward of more rows reads (a verify step of
    k drafted tokens has k + 1) against one token's, by `memory.experts_read`'s uniform-routing bound."""
    d = m.spec.dims
    if not d.experts:
        return []
    one = m.forward_read(1)
    ratios = ", ".join(f"{r} {m.forward_read(r) / one:.2f}x" for r in VERIFY_ROWS[1:])
    return [
        f"mixture of experts: {d.experts} experts per layer, {d.experts_used} per token; "
        f"{_n(m.spec.active_params)} of {_n(m.spec.params)} parameters active per token",
        f"  weights a forward reads by its rows, against one token's {fmt_bytes(one)} (uniform routing, an upper "
        f"bound): {ratios}",
    ]


def _memory_table(models: list[tuple[str, ModelMemory]]) -> list[str]:
    rows = [
        ("weights", lambda m: fmt_bytes(m.weights)),
        ("  per layer", lambda m: _range(m.layer_weights)),
        ("  embeddings, head", lambda m: f"{fmt_bytes(m.embed)}, {fmt_bytes(m.head)}"),
        ("KV cache", lambda m: fmt_bytes(m.kv)),
        ("  rows per slot x slots", lambda m: f"{m.kv_rows} x {m.slots}"),
        ("compute buffers (estimate)", lambda m: fmt_bytes(m.compute)),
        ("total", lambda m: fmt_bytes(m.total)),
    ]
    return [f"{'memory':30}" + "".join(f"{r:>18}" for r, _ in models)] + [
        f"{label:30}" + "".join(f"{fn(m):>18}" for _, m in models) for label, fn in rows
    ]


def _context_line(plan: Plan) -> str:
    bits = []
    if plan.max_context_gpu is not None:
        bits.append(f"all on the GPU up to {plan.max_context_gpu}")
    elif plan.hw.gpu:
        bits.append("never all on the GPU")
    forced = " with the given -ngl/-ngld" if plan.inputs.ngl is not None or plan.inputs.ngld is not None else ""
    bits.append(
        f"fits{forced} up to {plan.max_context}" if plan.max_context else f"does not fit{forced} at any context"
    )
    per = f"each +1k context: +{fmt_bytes(plan.per_1k_bytes)}"
    if plan.per_1k_layers is not None:
        per += f" = the GPU room of {plan.per_1k_layers:.2f} target layers"
    both = " (same for both models)" if plan.uses_draft else ""
    return f"context{both}: {', '.join(bits)} (model max {plan.target.spec.dims.max_ctx}); {per}"


def _speed_lines(plan: Plan) -> list[str]:
    s = plan.chosen
    L = [
        f"speed bound (decode, bandwidth): target {s.target_step.tokens_per_s:.1f} tok/s at empty context, "
        f"{s.target_step_full.tokens_per_s:.1f} at {plan.target.context}"
        + (f"; draft {s.draft_step.tokens_per_s:.1f} tok/s" if s.draft_step else "")
    ]
    if s.target_step.link_s and s.target_step.cpu_s:
        L.append(
            f"  split cost per step: GPU {s.target_step.gpu_s * 1e3:.2f} ms + CPU {s.target_step.cpu_s * 1e3:.2f}"
            f" ms + link {s.target_step.link_s * 1e3:.3f} ms"
        )
    if plan.cost_ratio is not None:
        L += _draft_lines(plan, plan.cost_ratio)
    L.append(f"expected: {plan.expected_tps:.1f} tok/s with --spec-type {plan.spec_type} (bound x speedup)")
    return L


def _draft_lines(plan: Plan, c: float) -> list[str]:
    """The draft model's cost ratio, best length, speedup and the table over acceptance rates."""
    k, g = best_k(plan.alpha, c, plan.inputs.draft_max, plan.target.verify_cost)
    tab = _table(plan)
    L = [
        f"speculative, draft model: c = draft/target step = {c:.3f}; acceptance {plan.alpha:.0%} ({plan.alpha_source})",
        f"  best draft length {k}: E[tokens/step] = (1-a^(k+1))/(1-a) = {expected_tokens(plan.alpha, k):.2f}, "
        f"speedup = E/(k c + v) = x{g:.2f} (v: the verify forward's cost, {plan.target.verify_cost(k + 1):.2f}); "
        f"pays above acceptance {plan.break_even:.0%} at this k",
        "  acceptance  " + "".join(f"{a:>6.0%}" for a in ALPHAS),
        "  best k      " + "".join(f"{r['best_k']:>6}" for r in tab),
        "  speedup     " + "".join(f"{r['speedup']:>6.2f}" for r in tab),
    ]
    if plan.why_not:
        L.append(f"  the draft model does not pay: {plan.why_not}")
    return L


def _recommendation_lines(plan: Plan) -> list[str]:
    r = plan.recommendation
    flag = f"--spec-type {r.spec_type}" + (f" --draft-max {r.draft_max}" if r.spec_type != "none" else "")
    return [f"recommendation: {flag}", f"  {r.reason}"]


def _rss_lines(rss: RuntimeRSS) -> list[str]:
    return [
        f"specdec runtime on the CPU (predicted RSS): steady {fmt_bytes(rss.steady)}, peak {fmt_bytes(rss.peak)} "
        f"({rss.peak / 1e6:,.0f} MB)",
        "  " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in rss.phases.items()) + f"; loading holds {rss.load_note}",
        "  " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in rss.parts.items()),
    ]


def _placement_line(plan: Plan, s: Setup) -> str:
    hw = plan.hw
    tl = f"-ngl {s.ngl} ({len(s.target.gpu_layers)}/{s.target.num_layers} target layers on the GPU"
    tl += ", head too)" if s.target.head == "gpu" else ")"
    if s.draft is not None:
        tl += f" -ngld {s.ngld} ({len(s.draft.gpu_layers)}/{s.draft.num_layers})"
    mem = f"GPU {fmt_bytes(s.gpu_need)} of {fmt_bytes(hw.gpu_mem)}, " if hw.gpu else ""
    mem += f"RAM {fmt_bytes(s.ram_need)} of {fmt_bytes(hw.ram)}"
    state = "fits" if s.fits else f"DOES NOT FIT: {s.why}"
    return f"placement: {tl} · {mem} · {state}"
