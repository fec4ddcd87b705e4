"""Memory of one model under a plan: weights per tensor and per layer, KV cache, compute buffers.

KV cache = layers x kv_heads x (k_dim + v_dim) x rows x bytes x slots, where rows per slot are
`context + HEADROOM` in specdec's runtime (exactly what `ModelRunner` allocates) and `context`
in llama.cpp. Compute buffers are estimates (stated in `compute_note`); overheads live in
`OVERHEADS` with where each figure comes from.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import SpecdecError
from specdec.plan.formats import RUNTIME_DTYPES, type_bytes
from specdec.plan.specs import ModelSpec, TensorSpec
from specdec.runtime.placement import Placement

# Stated overheads (bytes). specdec figures were measured on this repo's machine (docs/planning.md):
# VmRSS of `python -c "import torch, specdec.api"` and the growth when one tokenizer.json is loaded.
SPECDEC_BASE = 225 * 10**6          # Python + torch + specdec imports
SPECDEC_TOKENIZER_PER_TOKEN = 600   # bytes of RSS per vocabulary entry (92 MB for Qwen2.5's 151,936)
LLAMA_HOST = 256 * 2**20            # llama.cpp process, tokenizer, host output buffers (approximate)
GPU_CONTEXT = 512 * 2**20           # CUDA context + cuBLAS workspace per process (approximate)
# llama-quantize's type for rows that do not fill the requested type's 256-element blocks
QUANT_FALLBACK = {**{t: "IQ4_NL" for t in ("TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                            "IQ3_XXS", "IQ3_S", "Q2_K", "Q3_K", "IQ4_XS")},
                  "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
UBATCH = 512                        # llama.cpp's default -ub; specdec's PREFILL_CHUNK is the same size


@dataclass(frozen=True)
class Format:
    """How one model's weights and KV are held."""
    weights: str          # 'file' | 'bf16'/'fp16'/'fp32' (specdec runtime) | GGML type
    kv: str               # GGML type name of the KV cache
    quant: str = "none"   # specdec runtime: draft linear weights int8 | int4 | none (specdec.runtime.quant)

    @property
    def runtime(self) -> bool:
        return self.weights in RUNTIME_DTYPES

    @property
    def style(self) -> str:
        return "specdec" if self.runtime else "llama.cpp"


@dataclass
class ModelMemory:
    spec: ModelSpec
    fmt: Format
    context: int
    slots: int
    tensor_bytes: dict[str, int]
    layer_weights: list[int]      # per decoder layer, resident
    layer_reads: list[int]        # per decoder layer, bytes a decode step reads (int4 keeps two layouts)
    embed: int                    # token embeddings
    head: int                     # final norm + LM head as resident (tied: see head_gpu_extra)
    head_read: int                # bytes of the head a decode step reads (tied: the shared matrix)
    head_gpu_extra: int           # llama.cpp duplicates tied embeddings as the output when the head is on the GPU
    other: int                    # tensors outside the layers we do not place (kept on the CPU)
    kv_rows: int                  # KV rows per slot
    kv_layer: int                 # KV bytes of one layer, all slots
    compute: int
    compute_note: str

    @property
    def weights(self) -> int:
        return sum(self.layer_weights) + self.embed + self.head + self.other

    @property
    def kv(self) -> int:
        return self.kv_layer * len(self.layer_weights)

    @property
    def kv_per_token(self) -> int:
        """KV bytes one more token of context costs (all layers, one slot)."""
        return self.kv_layer // max(self.kv_rows * self.slots, 1) * len(self.layer_weights)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def gpu_bytes(self, p: Placement) -> int:
        """Bytes this model puts on the GPU under placement `p` (no process overhead)."""
        if not p.on_gpu:
            return 0
        b = sum(w + self.kv_layer for w, d in zip(self.layer_weights, p.layers) if d == "gpu")
        b += self.embed if p.embed == "gpu" else 0
        b += self.head + self.head_gpu_extra if p.head == "gpu" else 0
        return b + self.compute

    def cpu_bytes(self, p: Placement) -> int:
        b = sum(w + self.kv_layer for w, d in zip(self.layer_weights, p.layers) if d == "cpu")
        b += (self.embed if p.embed == "cpu" else 0) + (self.head if p.head == "cpu" else 0) + self.other
        return b + (0 if p.on_gpu else self.compute)

    def read_per_token(self, p: Placement, position: int) -> tuple[int, int]:
        """(GPU, CPU) bytes one decode step reads at `position`: every layer's weights and its KV so far,
        and the LM head; of the token embeddings only one row (not counted)."""
        per_layer_kv = self.kv_layer // max(self.kv_rows * self.slots, 1) * position
        gpu = cpu = 0
        for w, d in zip(self.layer_reads, p.layers):
            if d == "gpu":
                gpu += w + per_layer_kv
            else:
                cpu += w + per_layer_kv
        if p.head == "gpu":
            gpu += self.head_read
        else:
            cpu += self.head_read
        return gpu, cpu


INT4_GROUP = 64  # specdec.runtime.quant.Int4Linear.GROUP


def _runtime_linear(n: int, rows: int, row_len: int, fmt: Format) -> tuple[int, int]:
    """(resident, read per decode step) of one linear weight under specdec's draft quantization."""
    rb = RUNTIME_DTYPES[fmt.weights]
    if fmt.quant == "int4" and fmt.weights == "bf16" and row_len % INT4_GROUP == 0:
        groups = n // INT4_GROUP
        # Int4Linear: packed kernel layout + nibbles (n/2 bytes each), scales_zeros, scale and low (per group)
        return n + 4 * groups * rb, n // 2 + 2 * groups * rb
    if fmt.quant in ("int8", "int4"):
        return n + rows * rb, n + rows * rb  # Int8Linear: int8 weight + one scale per output row
    return n * rb, n * rb


def tensor_bytes(t: TensorSpec, fmt: Format) -> int:
    """Bytes of one tensor in format `fmt` (see formats.py for what each format means)."""
    return _tensor_sizes(t, fmt)[0]


def _tensor_sizes(t: TensorSpec, fmt: Format) -> tuple[int, int]:
    """(resident, read per decode step)."""
    if fmt.runtime:
        if t.rows > 1 and t.role in ("layer", "output"):
            return _runtime_linear(t.n_elements, t.rows, t.row_len, fmt)
        b = t.n_elements * RUNTIME_DTYPES[fmt.weights]
        return b, b
    b = _ggml_bytes(t, fmt)
    return b, b


def _ggml_bytes(t: TensorSpec, fmt: Format) -> int:
    matrix = t.rows > 1
    if fmt.weights == "file":
        return t.file_bytes
    if not matrix:
        return t.n_elements * 4  # llama-quantize keeps vectors (norms, biases) in F32
    for qtype in (fmt.weights, QUANT_FALLBACK.get(fmt.weights, "F16"), "F16"):
        try:
            return type_bytes(qtype, t.n_elements, t.row_len)
        except SpecdecError:
            continue
    return t.n_elements * 2


def kv_rows(context: int, style: str) -> int:
    from specdec.runtime.runner import HEADROOM
    return context + HEADROOM if style == "specdec" else context


def kv_layer_bytes(spec: ModelSpec, kv_type: str, rows: int, slots: int) -> int:
    """One layer's K and V for `rows` positions in each of `slots` sequences."""
    d = spec.dims
    elems = d.num_kv_heads * (d.head_dim_k + d.head_dim_v) * rows * slots
    try:
        return type_bytes(kv_type, elems, d.num_kv_heads * d.head_dim_k)
    except SpecdecError:
        raise SpecdecError(f"KV cache type {kv_type} needs rows divisible by its block size; "
                           f"{spec.label} has {d.num_kv_heads * d.head_dim_k} per position") from None


def model_memory(spec: ModelSpec, fmt: Format, context: int, slots: int, draft_max: int = 16) -> ModelMemory:
    d = spec.dims
    both = {t.name: _tensor_sizes(t, fmt) for t in spec.tensors}
    sizes = {k: v[0] for k, v in both.items()}
    layers, reads = [0] * d.num_layers, [0] * d.num_layers
    embed = head = head_read = other = 0
    for t in spec.tensors:
        b, r = both[t.name]
        if t.role == "layer" and t.layer is not None and t.layer < d.num_layers:
            layers[t.layer] += b
            reads[t.layer] += r
        elif t.role == "embed":
            embed += b
        elif t.role in ("output", "norm"):
            head += b
            head_read += r
        else:
            other += b
    emb = next((t for t in spec.tensors if t.role == "embed"), None)
    head_gpu_extra = 0
    if d.tied and emb is not None:
        if fmt.runtime and fmt.quant != "none":  # the quantized LM head is its own copy of the tied matrix
            b, r = _runtime_linear(emb.n_elements, emb.rows, emb.row_len, fmt)
            head += b
            head_read += r
        else:
            head_read += embed  # the shared matrix (llama.cpp: or its GPU copy) is read as the LM head
            if not fmt.runtime:
                head_gpu_extra = embed
    rows = kv_rows(context, fmt.style)
    kv_layer = kv_layer_bytes(spec, fmt.kv, rows, slots)
    compute, note = _compute(spec, fmt, context, slots, draft_max)
    return ModelMemory(spec, fmt, context, slots, sizes, layers, reads, embed, head, head_read, head_gpu_extra,
                       other, rows, kv_layer, compute, note)


def _compute(spec: ModelSpec, fmt: Format, context: int, slots: int, draft_max: int) -> tuple[int, str]:
    """Activation buffers of one prefill chunk / ubatch (estimate)."""
    d = spec.dims
    chunk = min(UBATCH, context)
    width = 2 * d.hidden + (d.num_heads + 2 * d.num_kv_heads) * d.head_dim_k + 3 * d.intermediate
    if fmt.runtime:
        rb = RUNTIME_DTYPES[fmt.weights]
        b = chunk * width * rb + chunk * kv_rows(context, "specdec") + 2 * (draft_max + 1) * d.vocab * 4
        return b, f"one {chunk}-token prefill chunk of activations + its mask + fp32 logits of a verify step"
    b = chunk * (width + d.vocab) * 4 + d.vocab * 4 * slots
    return b, (f"one {chunk}-token ubatch of f32 activations and logits (flash attention on); "
               "llama.cpp logs the real figure")


@dataclass
class RuntimeRSS:
    """specdec's own process on the CPU: predicted resident memory, steady and at the load peak."""
    steady: int
    load_peak: int
    peak: int
    parts: dict[str, int]
    phases: dict[str, int]


def runtime_rss(target: ModelMemory, draft: ModelMemory | None) -> RuntimeRSS:
    """What `specdec generate` holds: weights at the compute dtype (draft linears int8/int4), KV, buffers,
    torch + tokenizers. The load peak adds the checkpoint that `load_checkpoint` reads through mmap:
    all of its pages are resident until the file is closed, beside the converted weights."""
    def tok(m: ModelMemory) -> int:
        return SPECDEC_TOKENIZER_PER_TOKEN * m.spec.dims.vocab

    def ckpt(m: ModelMemory) -> int:  # GGUF/packs are converted to float32 safetensors; checkpoints as stored
        return m.spec.file_bytes if m.spec.kind in ("checkpoint", "config") else m.spec.params * 4

    def loaded(m: ModelMemory) -> int:  # right after load_checkpoint, before quantization
        rb = RUNTIME_DTYPES[m.fmt.weights]
        return m.spec.params * rb

    parts = {"torch + Python": SPECDEC_BASE, "target weights": target.weights, "target KV": target.kv,
             "target buffers": target.compute, "target tokenizer": tok(target)}
    steady_t = sum(parts.values())
    phases = {"loading the target": SPECDEC_BASE + ckpt(target) + loaded(target)}
    if draft is not None:
        parts.update({"draft weights": draft.weights, "draft KV": draft.kv, "draft buffers": draft.compute,
                      "draft tokenizer": tok(draft)})
        before = steady_t - target.compute
        phases["loading the draft"] = before + ckpt(draft) + loaded(draft)
    steady = sum(parts.values())
    phases["generating"] = steady
    return RuntimeRSS(steady, max(v for k, v in phases.items() if k != "generating"), max(phases.values()), parts,
                      phases)
