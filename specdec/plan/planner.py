"""`make_plan`: memory, placement, largest context, speed and a recommendation for a target (+ draft)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.errors import SpecdecError
from specdec.plan import devices as dev
from specdec.plan.formats import RUNTIME_DTYPES, is_runtime_format, kv_type, weight_format
from specdec.plan.memory import (
    GPU_CONTEXT,
    LLAMA_HOST,
    SPECDEC_BASE,
    Format,
    ModelMemory,
    RuntimeRSS,
    dense_matrix_types,
    model_memory,
    runtime_rss,
    tokenizer_bytes,
)
from specdec.plan.recommend import Recommendation, recommend, task
from specdec.plan.specs import ModelSpec, load_spec
from specdec.plan.speed import StepTime, Verify, best_k, break_even_alpha, step_time
from specdec.plan.units import parse_bandwidth, parse_size
from specdec.runtime import kernels as K
from specdec.runtime.placement import ALL_LAYERS, Placement, place_layers

if TYPE_CHECKING:
    from specdec.drafters.registry import HeadMemory

DEFAULT_GPU_BW = 500e9
DEFAULT_CONTEXT = 4096  # as `specdec generate -c`
LLAMA_CPP_ENGINES = ("llama.cpp", "ollama")  # exports whose plan defaults to --dtype file (the engine's own loading)


@dataclass
class PlanInputs:
    model: str | None = None  # None: the default pair
    draft: str | None = None
    context: int | None = None  # default: DEFAULT_CONTEXT capped at the model's maximum
    draft_context: int | None = None  # default: the target's (capped at the draft's maximum)
    dtype: str | None = None  # default: auto (specdec's runtime), file when exporting to llama.cpp/Ollama
    draft_dtype: str | None = None  # default: --dtype
    quant: str = "auto"  # specdec runtime (as generate's --quant): auto | gguf | int8 | int4 | none
    draft_quant: str = "auto"  # the same for the draft (generate's --draft-quant)
    kv_dtype: str = "auto"
    slots: int = 1
    gpu: str | None = None  # a named GPU, 'none', or None = detect
    gpu_mem: str | None = None
    gpu_bw: str | None = None
    ram: str | None = None
    ram_bw: str | None = None
    pcie_bw: str | None = None
    cpu: str | None = None
    ngl: int | None = None  # None: as many as fit; ALL_LAYERS: all
    ngld: int | None = None
    task: str = "code"
    accept: float | None = None
    draft_max: int = 16
    spec_type: str | None = None  # force the exported spec type (default: the recommendation)
    export: str | None = None  # the engine the plan is exported to (decides the default --dtype)
    x16: bool | None = None  # the planned CPU runs the x16 layout's kernels (None: the --cpu profile / this CPU)
    drafter_options: dict | None = None  # drafter options (e.g. a head directory) as `LLM(...)` takes them
    cache_mb: int = 0  # specdec's prefix cache budget (`serve --cache-mb`), host memory


@dataclass
class Hardware:
    gpu: str | None
    unified: bool
    gpu_mem: int | None
    gpu_bw: float | None
    pcie_bw: float | None
    ram: int
    ram_bw: float
    x16: bool  # the GGUF kernels run the x16 layout (AVX2 / AVX-512)
    sources: dict[str, str]


@dataclass
class Setup:
    """One concrete placement of the target (and draft) with its memory and step times."""

    ngl: int
    ngld: int | None
    target: Placement
    draft: Placement | None
    gpu_need: int
    ram_need: int
    fits: bool
    why: str
    target_step: StepTime
    draft_step: StepTime | None
    target_step_full: StepTime


@dataclass
class Plan:
    inputs: PlanInputs
    hw: Hardware
    target: ModelMemory
    draft: ModelMemory | None
    with_draft: Setup | None
    alone: Setup
    alpha: float
    alpha_source: str
    cost_ratio: float | None
    draft_k: int | None  # best draft length for the draft model (None without one)
    draft_gain: float | None  # its speedup at the bound
    k: int  # draft length of the chosen spec type
    gain: float  # speedup of the chosen spec type (1.0 when it has no draft model)
    break_even: float | None
    draft_pays: bool
    why_not: str | None
    recommendation: Recommendation
    spec_type: str
    max_context_gpu: int | None
    max_context: int | None
    per_1k_bytes: int
    per_1k_layers: float | None
    rss: RuntimeRSS | None
    heads: dict[str, int] = field(default_factory=dict)  # the drafters' own memory by part (trained heads)
    notes: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> Setup:
        return self.with_draft if self.uses_draft and self.with_draft is not None else self.alone

    @property
    def uses_draft(self) -> bool:
        return self.draft is not None and "draft" in self.spec_type.split(",")

    @property
    def expected_tps(self) -> float:
        s = self.chosen
        base = s.target_step.tokens_per_s
        return base * self.gain if self.uses_draft else base


def resolve_hardware(i: PlanInputs) -> Hardware:
    src: dict[str, str] = {}
    gpu_name, gpu_mem, profile = _which_gpu(i, src)
    unified = profile is not None and profile.kind == "unified"
    gpu_bw = pcie = None
    if profile is not None:
        if gpu_mem is None:
            gpu_mem = int(profile.mem * dev.UNIFIED_GPU_SHARE) if unified else profile.mem
            src["gpu_mem"] = f"{profile.name} profile" + (
                f" ({dev.UNIFIED_GPU_SHARE:.0%} of unified memory)" if unified else ""
            )
        gpu_bw, pcie = profile.bw, profile.pcie
        src["gpu_bw"] = src["pcie_bw"] = f"{profile.name} profile"
    if i.gpu_mem is not None:
        gpu_mem, src["gpu_mem"] = parse_size(i.gpu_mem, "--gpu-mem"), "--gpu-mem"
    if i.gpu_bw is not None:
        gpu_bw, src["gpu_bw"] = parse_bandwidth(i.gpu_bw, "--gpu-bw"), "--gpu-bw"
    if i.pcie_bw is not None:
        pcie, src["pcie_bw"] = parse_bandwidth(i.pcie_bw, "--pcie-bw"), "--pcie-bw"
    if gpu_name is not None:
        if gpu_bw is None:
            gpu_bw, src["gpu_bw"] = DEFAULT_GPU_BW, "default (set --gpu-bw)"
        if pcie is None and not unified:
            pcie, src["pcie_bw"] = dev.PCIE4, "default PCIe 4.0 x16"
    ram, ram_bw = _ram(i, profile if unified else None, src)
    x16, src["x16"] = _cpu_x16(i, unified)
    return Hardware(gpu_name, unified, gpu_mem, gpu_bw, pcie, ram, ram_bw, x16, src)


def _which_gpu(i: PlanInputs, src: dict[str, str]) -> tuple[str | None, int | None, dev.Device | None]:
    """(name, detected memory, profile) of the planned GPU: --gpu, else CUDA's device 0, else --gpu-mem alone."""
    if i.gpu and i.gpu.lower() != "none":
        profile = dev.gpu_device(i.gpu)
        src["gpu"] = "--gpu"
        return profile.name, None, profile
    if i.gpu is None and i.gpu_mem is None:
        found = dev.detect_gpu()
        if found:
            src["gpu"] = src["gpu_mem"] = "detected"
            return found[0], found[1], dev.match_gpu_name(found[0])
    elif i.gpu is None:
        src["gpu"] = "--gpu-mem"
        return "gpu", None, None
    return None, None, None


def _ram(i: PlanInputs, pool: dev.Device | None, src: dict[str, str]) -> tuple[int, float]:
    """(RAM bytes, RAM bytes/s): the flags, else a unified-memory device's pool, else detected / the --cpu profile."""
    if i.ram is not None:
        ram, src["ram"] = parse_size(i.ram, "--ram"), "--ram"
    elif pool is not None:
        ram, src["ram"] = pool.mem, f"{pool.name} unified memory"
    else:
        found = dev.detect_ram()
        if found is None:
            raise SpecdecError("cannot detect the RAM size here; give --ram (e.g. --ram 64GiB)")
        ram, src["ram"] = found, "detected"
    if i.ram_bw is not None:
        src["ram_bw"] = "--ram-bw"
        return ram, parse_bandwidth(i.ram_bw, "--ram-bw")
    if pool is not None:
        src["ram_bw"] = f"{pool.name} unified memory"
        return ram, pool.bw
    cpu = dev.cpu_device(i.cpu or dev.DEFAULT_CPU)
    src["ram_bw"] = f"{cpu.name} profile ({cpu.note})" + ("" if i.cpu else ", default")
    return ram, cpu.bw


def _cpu_x16(i: PlanInputs, unified: bool) -> tuple[bool, str]:
    """Whether the planned CPU runs the GGUF kernels' x16 layout (AVX2 / AVX-512), and where that comes from."""
    if i.x16 is not None:
        return i.x16, "--x16"
    if unified:
        return False, "Apple silicon (unified memory)"
    said = dev.cpu_device(i.cpu).x16 if i.cpu else None
    if said is not None:
        return said, f"{i.cpu} profile"
    return dev.this_cpu_x16(), "this CPU's flags"


def default_dtype(export: str | None) -> str:
    """--dtype when not given: specdec's runtime as `generate` runs it, or the file as llama.cpp loads it when the
    plan is exported to llama.cpp or Ollama."""
    return "file" if export in LLAMA_CPP_ENGINES else "auto"


def _runtime_quant(quant: str, name: str, spec: ModelSpec, flag: str) -> str:
    """generate's `--quant` for this model: `resolve_quant` (auto: gguf for packs and GGUF files, none for checkpoint
    directories); a bare config.json is planned as the checkpoint it describes."""
    from specdec.models.loader import resolve_quant

    q = "none" if quant == "auto" and spec.kind == "config" else resolve_quant(quant, name)
    if q == "gguf" and spec.kind in ("checkpoint", "config"):
        raise SpecdecError(
            f"{flag} gguf needs a GGUF file or a model pack; {spec.label} is a checkpoint "
            "(plan it with none, int8 or int4)"
        )
    return q


def _runtime_dtype(name: str, quant: str, has_gpu: bool) -> str:
    """generate's `--dtype` for a model of this quant (`resolve_dtype`: auto is fp32 for gguf, whose kernels run on
    the CPU, else bf16 where the device computes it natively); a GPU plan's dense models get the GPU's bf16."""
    from specdec.models.loader import DTYPES, resolve_dtype

    dtype = resolve_dtype(name, "cuda" if has_gpu and quant != "gguf" else "cpu", quant)
    return next(k for k, v in DTYPES.items() if v == dtype)


def _format(fmt: str, kv: str, quant: str, hw: Hardware) -> Format:
    """One model's Format: llama.cpp's (`file`, a GGML type) or specdec's runtime with its resolved quant."""
    if not is_runtime_format(fmt):
        return Format(fmt, kv_type(kv, fmt, "fp32"))
    rt = _runtime_dtype(fmt, quant, hw.gpu is not None)
    return Format(rt, kv_type(kv, fmt, rt), quant, hw.x16 and quant == "gguf")


def _check_context(spec: ModelSpec, ctx: int, flag: str) -> None:
    if ctx < 1:
        raise SpecdecError(f"{flag} must be >= 1 (got {ctx})")
    if ctx > spec.dims.max_ctx:
        raise SpecdecError(
            f"{flag} {ctx} is larger than {spec.label} allows (max_position_embeddings {spec.dims.max_ctx})"
        )


class _Planner:
    def __init__(
        self, i: PlanInputs, hw: Hardware, tspec: ModelSpec, dspec: ModelSpec | None, tfmt: Format, dfmt: Format | None
    ):
        self.i, self.hw, self.tspec, self.dspec, self.tfmt, self.dfmt = i, hw, tspec, dspec, tfmt, dfmt
        self.use_draft = dspec is not None
        self.draft_head_rows = 0  # LM-head rows a draft step reads: specdec's `--draft-vocab` (0 = all)
        if dspec is not None and dfmt is not None and dfmt.runtime and abs(dspec.dims.vocab - tspec.dims.vocab) <= 1024:
            from specdec.drafters.draft_model import head_rows  # not across tokenizers (notes below)

            self.draft_head_rows = head_rows((i.drafter_options or {}).get("draft_vocab", "auto"), dspec.dims.vocab)

    def memories(self, ctx: int, dctx: int | None) -> tuple[ModelMemory, ModelMemory | None]:
        t = model_memory(self.tspec, self.tfmt, ctx, self.i.slots, self.i.draft_max)
        d = None
        if self.dspec is not None and self.dfmt is not None:
            d = model_memory(self.dspec, self.dfmt, dctx or ctx, self.i.slots, self.i.draft_max, self.draft_head_rows)
        return t, d

    def host_overhead(self, t: ModelMemory, d: ModelMemory | None) -> int:
        if t.fmt.runtime:
            return SPECDEC_BASE + sum(tokenizer_bytes(m.spec) for m in (t, d) if m) + (self.i.cache_mb << 20)
        return LLAMA_HOST

    @staticmethod
    def n_all(m: ModelMemory) -> int:
        """The -ngl that puts everything placeable on the GPU."""
        return m.spec.dims.num_layers + (1 if m.fmt.style == "llama.cpp" else 0)

    def place(self, m: ModelMemory, n: int) -> Placement:
        return place_layers(m.spec.dims.num_layers, min(n, self.n_all(m)), m.fmt.style)

    def max_layers(self, m: ModelMemory, budget: int) -> int:
        best = 0
        for n in range(self.n_all(m) + 1):
            if m.gpu_bytes(self.place(m, n)) <= budget:
                best = n
        return best

    def choose(
        self, t: ModelMemory, d: ModelMemory | None, ngl: int | None, ngld: int | None
    ) -> tuple[int, int | None]:
        """-ngl/-ngld: the flags if given, else the draft whole on the GPU first, then as many target layers as fit."""
        if self.hw.gpu is None:
            return 0, (0 if d else None)
        budget = (self.hw.gpu_mem or 0) - GPU_CONTEXT
        nd = None
        if d is not None:
            if ngld is not None:
                nd = min(ngld, self.n_all(d))
            else:
                full = d.gpu_bytes(self.place(d, self.n_all(d)))
                nd = self.n_all(d) if full <= budget else self.max_layers(d, budget)
            budget -= d.gpu_bytes(self.place(d, nd))
        nt = min(ngl, self.n_all(t)) if ngl is not None else self.max_layers(t, budget)
        return nt, nd

    def setup(self, t: ModelMemory, d: ModelMemory | None, ngl: int | None = None, ngld: int | None = None) -> Setup:
        nt, nd = self.choose(t, d, ngl, ngld)
        pt = self.place(t, nt)
        pd = self.place(d, nd or 0) if d is not None else None
        on_gpu = pt.on_gpu or bool(pd and pd.on_gpu)
        gpu_need = t.gpu_bytes(pt) + (d.gpu_bytes(pd) if d and pd else 0) + (GPU_CONTEXT if on_gpu else 0)
        ram_need = t.cpu_bytes(pt) + (d.cpu_bytes(pd) if d and pd else 0) + self.host_overhead(t, d)
        why = ""
        if self.hw.gpu is not None and gpu_need > (self.hw.gpu_mem or 0):
            why = f"GPU needs {gpu_need / 2**30:.2f} GiB of {(self.hw.gpu_mem or 0) / 2**30:.2f} GiB"
        pool = ram_need + (gpu_need if self.hw.unified else 0)
        if pool > self.hw.ram:
            why = (why + "; " if why else "") + f"RAM needs {pool / 2**30:.2f} GiB of {self.hw.ram / 2**30:.2f} GiB"
        return Setup(
            nt,
            nd,
            pt,
            pd,
            gpu_need,
            ram_need,
            not why,
            why,
            self.step(t, pt, 0),
            self.step(d, pd, 0) if d and pd else None,
            self.step(t, pt, t.context),
        )

    def step(self, m: ModelMemory, p: Placement, position: int) -> StepTime:
        gpu_b, cpu_b = m.read_per_token(p, position)
        act = 4 if m.fmt.style == "llama.cpp" else (2 if m.fmt.weights != "fp32" else 4)
        return step_time(
            gpu_b, cpu_b, p.crossings, m.spec.dims.hidden * act, self.hw.gpu_bw, self.hw.ram_bw, self.hw.pcie_bw
        )

    def fits(self, ctx: int, all_on_gpu: bool) -> bool:
        """Whether the chosen setup (with the draft only if it is used) fits at context `ctx`."""
        dctx = min(ctx, self.dspec.dims.max_ctx) if self.dspec else None
        t, d = self.memories(ctx, dctx)
        d = d if self.use_draft else None
        if all_on_gpu:
            s = self.setup(t, d, self.n_all(t), self.n_all(d) if d else None)
        else:
            s = self.setup(t, d, self.i.ngl, self.i.ngld)
        return s.fits

    def largest_context(self, all_on_gpu: bool) -> int | None:
        lo, hi = 0, self.tspec.dims.max_ctx
        if not self.fits(1, all_on_gpu):
            return None
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(mid, all_on_gpu):
                lo = mid
            else:
                hi = mid - 1
        return lo


def _check_inputs(i: PlanInputs) -> None:
    """Numbers and choices that need no model."""
    from specdec.models.loader import QUANT_CHOICES

    if i.slots < 1:
        raise SpecdecError(f"--parallel must be >= 1 (got {i.slots})")
    if i.draft_max < 1:
        raise SpecdecError(f"--draft-max must be >= 1 (got {i.draft_max})")
    if i.accept is not None and not 0 <= i.accept < 1:
        raise SpecdecError(f"--accept must be in [0, 1) (got {i.accept})")
    for flag, q in (("--quant", i.quant), ("--draft-quant", i.draft_quant)):
        if q not in QUANT_CHOICES:
            raise SpecdecError(f"unknown {flag} {q!r} (choose {', '.join(QUANT_CHOICES)})")
    for flag, n in (("-ngl", i.ngl), ("-ngld", i.ngld)):
        if n is not None and n < 0:
            raise SpecdecError(f"{flag} must be >= 0 or 'all' (got {n})")


def _formats(
    i: PlanInputs, model: str, draft: str | None, tspec: ModelSpec, dspec: ModelSpec | None, hw: Hardware
) -> tuple[Format, Format | None]:
    """The target's and draft's Format from --dtype/--draft-dtype, --quant/--draft-quant and the planned CPU."""
    fmt = weight_format(i.dtype or default_dtype(i.export))
    dfmt = weight_format(i.draft_dtype) if i.draft_dtype else fmt
    runtime = is_runtime_format(fmt)
    if runtime != is_runtime_format(dfmt):
        raise SpecdecError(
            "--dtype and --draft-dtype must both be specdec runtime dtypes (auto/bf16/fp16/fp32) "
            "or both file/GGML types: one engine runs both models"
        )
    if not runtime and (i.quant, i.draft_quant) != ("auto", "auto"):
        raise SpecdecError(
            f"--quant/--draft-quant plan specdec's runtime; --dtype {fmt} plans the file as llama.cpp "
            "loads it (use --dtype auto|bf16|fp16|fp32 with them)"
        )
    tquant = _runtime_quant(i.quant, model, tspec, "--quant") if runtime else "none"
    tfmt = _format(fmt, i.kv_dtype, tquant, hw)
    if dspec is None or draft is None:
        return tfmt, None
    dquant = _runtime_quant(i.draft_quant, draft, dspec, "--draft-quant") if runtime else "none"
    return tfmt, _format(dfmt, i.kv_dtype, dquant, hw)


@dataclass
class _Verdict:
    """Whether the draft model pays at the planned acceptance (all None without a draft model)."""

    cost: float | None = None  # c = draft step / target step
    k: int | None = None  # best draft length
    gain: float | None = None  # its speedup at the bound
    break_even: float | None = None  # acceptance below which drafting k tokens is slower
    pays: bool = False
    why_not: str | None = None


def _judge_draft(alpha: float, alone: Setup, with_draft: Setup | None, draft_max: int, verify: Verify) -> _Verdict:
    """The draft model against the target alone with all the GPU memory (`verify`: the target forward's cost by its
    rows)."""
    if with_draft is None or with_draft.draft_step is None:
        return _Verdict()
    cost = with_draft.draft_step.seconds / with_draft.target_step.seconds
    k, gain = best_k(alpha, cost, draft_max, verify)
    v = _Verdict(cost, k, gain, break_even_alpha(cost, k, verify))
    tps_draft = with_draft.target_step.tokens_per_s * gain
    tps_alone = alone.target_step.tokens_per_s
    if gain <= 1:
        v.why_not = f"x{gain:.2f} at acceptance {alpha:.0%}; it pays above {v.break_even:.0%}"
    elif tps_draft <= tps_alone:
        moved = alone.ngl - with_draft.ngl
        v.why_not = (
            f"it pushes {moved} target layers off the GPU: {tps_draft:.1f} tok/s with it vs {tps_alone:.1f} without"
        )
    elif not with_draft.fits and alone.fits:
        v.why_not = f"target + draft do not fit ({with_draft.why})"
    else:
        v.pays = True
    return v


def _contexts(i: PlanInputs, tspec: ModelSpec, dspec: ModelSpec | None) -> int | None:
    """Sets the target's context (default: DEFAULT_CONTEXT capped at the model's) and returns the draft's."""
    if i.context is None:
        i.context = min(DEFAULT_CONTEXT, tspec.dims.max_ctx)
    _check_context(tspec, i.context, "-c")
    if dspec is None:
        return i.draft_context
    dctx = i.draft_context if i.draft_context is not None else min(i.context, dspec.dims.max_ctx)
    _check_context(dspec, dctx, "-cd")
    return dctx


def _context_room(
    pl: _Planner, t: ModelMemory, d: ModelMemory | None
) -> tuple[int | None, int | None, int, float | None]:
    """(largest context all on the GPU, largest that fits, KV bytes of 1k more context, in target layers)."""
    has_gpu = pl.hw.gpu is not None
    max_gpu = pl.largest_context(True) if has_gpu else None
    per_1k = (t.kv_per_token + (d.kv_per_token if d and pl.use_draft else 0)) * 1024 * pl.i.slots
    avg_layer = (sum(t.layer_weights) + t.kv) / t.spec.dims.num_layers
    return max_gpu, pl.largest_context(False), per_1k, per_1k / avg_layer if has_gpu else None


def _notes(plan: Plan) -> list[str]:
    """What the figures leave out: per-model notes, the runtime's own choices."""
    runtime, drafting = plan.target.fmt.runtime, "draft" in plan.spec_type.split(",")
    notes = []
    for m in (plan.target, plan.draft):
        if m is None:
            continue
        s = m.spec
        notes += [f"{s.label}: {n}" for n in s.notes]
        if runtime and not s.runtime_supported:
            notes.append(f"{s.label}: architecture {s.dims.arch!r} is not one specdec's runtime runs")
        dense = dense_matrix_types(s, m.fmt)
        if dense:
            notes.append(
                f"{s.label}: {'/'.join(dense)} matrices (and a q/k/v or gate/up they are fused with) are "
                f"held dense in {m.fmt.weights}: the kernels take {', '.join(K.TYPES)}"
            )
    d = plan.draft.spec.dims if plan.draft else None
    if d and d.vocab and plan.target.spec.dims.vocab and abs(d.vocab - plan.target.spec.dims.vocab) > 1024:
        notes.append(
            f"the draft's vocabulary ({d.vocab}) is not the target's ({plan.target.spec.dims.vocab}): "
            "specdec drafts across tokenizers (drafts re-tokenized through text, docs/cross-tokenizer.md); "
            "the --export configurations assume a shared tokenizer"
        )
    if runtime and drafting and d and plan.draft and plan.draft.head_rows:
        notes.append(
            f"the draft computes its logits over its first {plan.draft.head_rows} of {d.vocab} token ids "
            "(--draft-vocab); the draft step's bytes count those rows of its LM head"
        )
    if runtime and drafting:
        notes.append(
            "specdec picks each step's draft length itself (--spec-adaptive on, up to --draft-max) "
            "from measured costs; the k above is for fixed-length engines (llama.cpp, vLLM)"
        )
    if runtime and plan.hw.gpu is not None and "gguf" in (plan.target.fmt.quant, plan.draft and plan.draft.fmt.quant):
        notes.append(
            "specdec's runtime puts -ngl/-ngld layers on the CUDA device dequantized to the compute dtype "
            "(the GGUF kernels run on the CPU), so a GGUF model takes its dense size there"
        )
    return notes


def make_plan(i: PlanInputs) -> Plan:
    """Formats, memory, placement and speed of the target (+ draft), whether the draft pays, the recommendation."""
    from specdec.models import packs

    _check_inputs(i)
    t_task = task(i.task)
    model, draft = i.model, i.draft
    if model is None:
        model, draft = packs.DEFAULT_TARGET, draft or packs.DEFAULT_DRAFT
    hw = resolve_hardware(i)
    tspec = load_spec(model)
    dspec = load_spec(draft) if draft else None
    dctx = _contexts(i, tspec, dspec)
    tfmt, dfmt = _formats(i, model, draft, tspec, dspec, hw)
    pl = _Planner(i, hw, tspec, dspec, tfmt, dfmt)
    t, d = pl.memories(i.context, dctx)
    alone = pl.setup(t, None, i.ngl)
    with_draft = pl.setup(t, d, i.ngl, i.ngld) if d is not None else None
    alpha = i.accept if i.accept is not None else t_task.alpha
    alpha_src = "--accept" if i.accept is not None else f"assumed for --task {t_task.name}"
    v = _judge_draft(alpha, alone, with_draft, i.draft_max, t.verify_cost)
    free_k = best_k(alpha, 0.0, i.draft_max, t.verify_cost)[0]  # model-free drafts: the most that pays to verify
    rec = recommend(t_task, d is not None, v.pays, v.k or free_k, v.gain or 1.0, free_k, v.why_not)
    spec_type = i.spec_type or rec.spec_type
    drafting = "draft" in spec_type.split(",")
    if drafting and d is None:
        raise SpecdecError(f"spec type {spec_type} needs a draft model (-md)")
    k, gain = (v.k, v.gain) if v.k is not None and v.gain is not None and drafting else (i.draft_max, 1.0)
    pl.use_draft = d is not None and drafting
    heads = drafter_memory(spec_type, model, tspec, t, i.slots, i.drafter_options, i.draft)
    parts = {k: v for h in heads for k, v in h.parts.items()}
    rss = runtime_rss(t, d if pl.use_draft else None, parts) if tfmt.runtime else None
    plan = Plan(
        i,
        hw,
        t,
        d,
        with_draft,
        alone,
        alpha,
        alpha_src,
        v.cost,
        v.k,
        v.gain,
        k,
        gain,
        v.break_even,
        v.pays,
        v.why_not,
        rec,
        spec_type,
        *_context_room(pl, t, d),
        rss,
        heads=parts,
    )
    plan.notes = _notes(plan) + [h.note for h in heads]
    return plan


def drafter_memory(
    spec_type: str,
    model: str,
    tspec: ModelSpec,
    t: ModelMemory,
    slots: int,
    options: dict | None = None,
    draft: str | None = None,
) -> list[HeadMemory]:
    """The memory of each drafter in the chain that holds its own (a trained head), as the drafter estimates it."""
    from specdec.drafters import REGISTRY, parse_spec_type
    from specdec.drafters.registry import MemoryQuery

    d = tspec.dims
    q = MemoryQuery(
        model,
        d.hidden,
        d.num_layers,
        d.num_heads,
        d.num_kv_heads,
        d.head_dim_k,
        d.intermediate,
        d.vocab,
        t.context,
        slots,
        RUNTIME_DTYPES.get(t.fmt.weights, 4) if t.fmt.quant != "gguf" else 4,
        REGISTRY.option_values(options),
        draft,
    )
    kinds = [REGISTRY.get(p) for p in parse_spec_type(spec_type) if p != "none"]
    return [k.memory(q) for k in kinds if k.memory is not None]


def parse_layers(text: str) -> int:
    """-ngl/-ngld value: a count or 'all'."""
    if text.lower() == "all":
        return ALL_LAYERS
    try:
        n = int(text)
    except ValueError:
        raise SpecdecError(f"expected a layer count or 'all', got {text!r}") from None
    if n < 0:
        raise SpecdecError(f"layer count must be >= 0, got {n}")
    return n
