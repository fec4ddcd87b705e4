"""Memory of one model under a plan: weights per tensor and per layer, KV cache, compute buffers.

Weights as llama.cpp holds them (the file's types, or requantized) or as specdec's runtime does: `gguf` (matrices
of a kernel type stay GGUF blocks, on AVX-512 repacked to the x16 layout; the rest dense in the compute dtype),
`int8`/`int4` (`specdec.runtime.quant`) or `none` (dense).

KV cache = layers x kv_heads x (k_dim + v_dim) x rows x bytes x slots, where rows per slot are
`context + HEADROOM` in specdec's runtime (exactly what `ModelRunner` allocates) and `context` in llama.cpp.
Compute buffers are estimates (stated in `compute_note`); the overhead constants below say where each figure
comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec.errors import SpecdecError
from specdec.plan.formats import RUNTIME_DTYPES, type_bytes
from specdec.plan.specs import ModelSpec, TensorSpec, is_expert
from specdec.runtime.placement import Placement

# Stated overheads (bytes). specdec figures were measured on this repo's machine (docs/planning.md, "specdec's own
# process"): VmRSS after the imports, the first model build and the kernel library; the growth when one
# tokenizer.json is loaded; the growth when `gguf.GGUFReader` opens a GGUF, per numpy view it makes.
SPECDEC_BASE = 312 * 10**6  # Python + torch + specdec; the first model build imports torch._dynamo + sympy
SPECDEC_TOKENIZER_PER_TOKEN = 600  # bytes of RSS per vocabulary entry (92 MB for Qwen2.5's 151,936)
GGUF_READER_PER_PART = 313  # bytes per view (238 MB for the 760,735 of the Qwen2.5 packs' headers)
LLAMA_HOST = 256 * 2**20  # llama.cpp process, tokenizer, host output buffers (approximate)
GPU_CONTEXT = 512 * 2**20  # CUDA context + cuBLAS workspace per process (approximate)
# llama-quantize's type for rows that do not fill the requested type's 256-element blocks
QUANT_FALLBACK = {
    **{
        t: "IQ4_NL"
        for t in (
            "TQ1_0",
            "TQ2_0",
            "IQ1_S",
            "IQ1_M",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ2_S",
            "IQ3_XXS",
            "IQ3_S",
            "Q2_K",
            "Q3_K",
            "IQ4_XS",
        )
    },
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}
UBATCH = 512  # llama.cpp's default -ub; specdec's PREFILL_CHUNK is the same size


@dataclass(frozen=True)
class Format:
    """How one model's weights and KV are held."""

    weights: str  # llama.cpp: 'file' | GGML type; specdec runtime: its compute dtype 'bf16'/'fp16'/'fp32'
    kv: str  # GGML type name of the KV cache
    quant: str = "none"  # specdec runtime: gguf | int8 | int4 | none (as generate's --quant, resolved)
    x16: bool = False  # gguf: matrices repacked at load to the AVX-512 x16 layout

    @property
    def runtime(self) -> bool:
        return self.weights in RUNTIME_DTYPES

    @property
    def style(self) -> str:
        return "specdec" if self.runtime else "llama.cpp"

    @property
    def path(self) -> str:
        """How the engine (`style`) holds the weights, e.g. 'gguf kernels, x16 layout, fp32 compute'."""
        if not self.runtime:
            return "as stored in the file" if self.weights == "file" else f"requantized to {self.weights}"
        if self.quant == "gguf":
            return f"gguf kernels, {'x16' if self.x16 else 'file'} layout, {self.weights} compute"
        if self.quant in ("int8", "int4"):
            return f"{self.quant} linears, rest {self.weights}"
        return f"dense {self.weights}"


@dataclass
class DenseOnGpu:
    """The gguf runtime's parts as `-ngl` puts them on a GPU: dequantized to the compute dtype (`densify`; the GGUF
    kernels run on the CPU only), so a layer there takes its parameter count times the dtype's bytes."""

    layers: list[int]  # per decoder layer
    embed: int
    head: int  # final norm + LM head (tied: its own dense copy of the embeddings)


@dataclass
class ModelMemory:
    spec: ModelSpec
    fmt: Format
    context: int
    slots: int
    tensor_bytes: dict[str, int]
    layer_weights: list[int]  # per decoder layer, resident
    layer_reads: list[int]  # per decoder layer, bytes a decode step reads (int4 keeps two layouts)
    embed: int  # token embeddings
    head: int  # final norm + LM head as resident (tied: see head_gpu_extra)
    head_read: int  # bytes of the head a decode step reads (tied: the shared matrix)
    head_gpu_extra: int  # llama.cpp duplicates tied embeddings as the output when the head is on the GPU
    other: int  # tensors outside the layers we do not place (kept on the CPU)
    kv_rows: int  # KV rows per slot
    kv_layer: int  # KV bytes of one layer, all slots
    compute: int
    compute_note: str
    head_rows: int = 0  # LM-head rows a decode step reads (a draft's `--draft-vocab`); 0 = all
    dense_gpu: DenseOnGpu | None = None  # gguf runtime: what goes to the GPU instead of the blocks
    expert_bytes: int = 0  # mixture of experts: all layers' experts, read in full (`layer_reads` holds one token's)

    def forward_read(self, rows: int) -> int:
        """Weight bytes a forward of `rows` tokens reads (layers and head): a dense model's whatever the rows; a
        mixture of experts reads the union of the experts its rows choose (`experts_read`)."""
        one = sum(self.layer_reads) + self.head_read
        d = self.spec.dims
        return one + round(self.expert_bytes * (experts_read(d.experts, d.experts_used, rows) - self.routed))

    def verify_cost(self, rows: int) -> float:
        """A forward of `rows` tokens' weight reads over one token's (1.0 for a dense model)."""
        return self.forward_read(rows) / self.forward_read(1)

    @property
    def routed(self) -> float:
        """The fraction of the experts one token reads."""
        d = self.spec.dims
        return experts_read(d.experts, d.experts_used, 1)

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
        g = self.dense_gpu
        b = sum(w + self.kv_layer for w, d in zip(g.layers if g else self.layer_weights, p.layers) if d == "gpu")
        b += (g.embed if g else self.embed) if p.embed == "gpu" else 0
        b += (g.head if g else self.head + self.head_gpu_extra) if p.head == "gpu" else 0
        return b + self.compute

    def cpu_bytes(self, p: Placement) -> int:
        b = sum(w + self.kv_layer for w, d in zip(self.layer_weights, p.layers) if d == "cpu")
        b += (self.embed if p.embed == "cpu" else 0) + (self.head if p.head == "cpu" else 0) + self.other
        return b + (0 if p.on_gpu else self.compute)

    def read_per_token(self, p: Placement, position: int) -> tuple[int, int]:
        """(GPU, CPU) bytes one decode step reads at `position`: every layer's weights and its KV so far,
        and the LM head; of the token embeddings only one row (not counted)."""
        per_layer_kv = self.kv_layer // max(self.kv_rows * self.slots, 1) * position
        g = self.dense_gpu
        gpu = cpu = 0
        for i, (w, d) in enumerate(zip(self.layer_reads, p.layers)):
            if d == "gpu":
                gpu += (g.layers[i] if g else w) + per_layer_kv
            else:
                cpu += w + per_layer_kv
        if p.head == "gpu":
            vocab = self.spec.dims.vocab
            gpu += self.head_read if g is None else g.head * (self.head_rows or vocab) // vocab
        else:
            cpu += self.head_read
        return gpu, cpu


def experts_read(experts: int, used: int, rows: int) -> float:
    """The fraction of a layer's experts a forward of `rows` tokens reads, each token routed to `used` of `experts`
    uniformly and independently of the others: 1 - (1 - used/experts)^rows (1.0 for a dense layer). Routers are
    skewed and a sequence's tokens share experts, so real steps read less: an upper bound."""
    return 1.0 if not experts else 1 - (1 - used / experts) ** rows


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


def _sizes(spec: ModelSpec, fmt: Format) -> dict[str, tuple[int, int]]:
    """(resident, read per decode step) of every tensor in format `fmt` (formats.py says what each means)."""
    if fmt.quant == "gguf":
        return _gguf_sizes(spec, fmt)
    return {t.name: _tensor_sizes(t, fmt) for t in spec.tensors}


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


def _gguf_sizes(spec: ModelSpec, fmt: Format) -> dict[str, tuple[int, int]]:
    """What `quantize_from_gguf` holds: matrices of a kernel type as blocks (`_blocks`), everything else dense in
    the compute dtype. A fused q/k/v or gate/up with a part of another type is dense as a whole; a quantized one
    keeps its parts' biases and their concatenation (`GGUFConcatLinear.bias`), read once per step."""
    rb = RUNTIME_DTYPES[fmt.weights]
    kept = block_tensors(spec, fmt)
    out = {t.name: (_blocks(t, fmt.x16) if t.name in kept else t.n_elements * rb,) * 2 for t in spec.tensors}
    for weights, biases in _fused(spec):
        if all(w.name in kept for w in weights):
            for b in biases:
                out[b.name] = (2 * b.n_elements * rb, b.n_elements * rb)
    return out


def block_tensors(spec: ModelSpec, fmt: Format) -> set[str]:
    """Names of the tensors the gguf runtime keeps as blocks: matrices of a kernel type (`kernels.TYPES`)
    whose fused group (q/k/v, gate/up), if any, is all of kernel types."""
    from specdec.runtime import kernels as K

    kept = {t.name for t in spec.tensors if t.rows > 1 and t.file_type in K.TYPES}
    for weights, _ in _fused(spec):
        if not all(w.name in kept for w in weights):
            kept -= {w.name for w in weights}
    return kept


def dense_matrix_types(spec: ModelSpec, fmt: Format) -> list[str]:
    """gguf runtime: the stored types of matrices the kernels do not take (held dense, as `describe` reports)."""
    from specdec.runtime import kernels as K

    if fmt.quant != "gguf":
        return []
    return sorted({t.file_type for t in spec.tensors if t.rows > 1 and t.file_type not in K.TYPES})


def _repacked(t: TensorSpec, x16: bool) -> bool:
    """Whether the loader repacks this kernel-type matrix 16 output rows at a time (`gguf_linear.for_this_cpu`)."""
    from specdec.runtime import kernels as K

    return x16 and K.TYPES[t.file_type] in K.REPACKABLE and t.rows % 16 == 0


def _blocks(t: TensorSpec, x16: bool) -> int:
    """Bytes of a kernel-type matrix as the runtime holds it: the file's blocks, or repacked (x16; Q4_K 148 bytes
    per 256 weights instead of 144, the other types the same)."""
    from specdec.runtime import kernels as K

    if not _repacked(t, x16):
        return t.file_bytes
    elems, size = K.BLOCK[K.X16 + K.TYPES[t.file_type]]  # per output row
    return t.rows * (t.row_len // elems) * size


def _fused(spec: ModelSpec) -> list[tuple[list[TensorSpec], list[TensorSpec]]]:
    """(weights, biases) of every group the loader fuses into one linear (`transformer.FUSED`), per layer."""
    from specdec.models import families
    from specdec.models.transformer import FUSED

    try:  # GGUF names -> Hugging Face names; a checkpoint's names are those already
        table = families.by_gguf_arch(spec.dims.arch).gguf_tensor_names(spec.dims.arch, spec.dims.num_layers)
    except SpecdecError:
        table = {}
    by_name = {}
    for t in spec.tensors:
        stem, _, kind = t.name.rpartition(".")
        by_name[f"{table[stem]}.{kind}" if stem in table else t.name] = t
    groups = []
    for i in range(spec.dims.num_layers):
        for parts in FUSED.values():
            weights = [by_name.get(f"model.layers.{i}.{p}.weight") for p in parts]
            biases = [by_name.get(f"model.layers.{i}.{p}.bias") for p in parts]
            if all(weights):
                groups.append((weights, [b for b in biases if b is not None]))
    return groups


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
        raise SpecdecError(
            f"KV cache type {kv_type} needs rows divisible by its block size; "
            f"{spec.label} has {d.num_kv_heads * d.head_dim_k} per position"
        ) from None


def model_memory(
    spec: ModelSpec, fmt: Format, context: int, slots: int, draft_max: int = 16, head_rows: int = 0
) -> ModelMemory:
    """`head_rows` > 0: a decode step reads only that many rows of the LM head (a draft's `--draft-vocab`)."""
    d = spec.dims
    both = _sizes(spec, fmt)
    sizes = {k: v[0] for k, v in both.items()}
    layers, embed, head, other = _by_part(spec, lambda t: sizes[t.name])
    routed = experts_read(d.experts, d.experts_used, 1)
    reads, _, head_read, _ = _by_part(spec, lambda t: round(both[t.name][1] * (routed if is_expert(t.name) else 1)))
    expert_bytes = sum(both[t.name][1] for t in spec.tensors if is_expert(t.name))
    emb = next((t for t in spec.tensors if t.role == "embed"), None)
    head_gpu_extra = 0
    if d.tied and emb is not None:
        if fmt.quant in ("int8", "int4"):  # the quantized LM head is its own copy of the tied matrix
            b, r = _runtime_linear(emb.n_elements, emb.rows, emb.row_len, fmt)
            head += b
            head_read += r
        else:
            head_read += embed  # the shared matrix (llama.cpp: or its GPU copy; gguf: its blocks) is the LM head
            if not fmt.runtime:
                head_gpu_extra = embed
    head_rows = head_rows if 0 < head_rows < d.vocab else 0
    if head_rows:
        head_read = head_read * head_rows // d.vocab
    rows = kv_rows(context, fmt.style)
    kv_layer = kv_layer_bytes(spec, fmt.kv, rows, slots)
    compute, note = _compute(spec, fmt, context, slots, draft_max)
    return ModelMemory(
        spec,
        fmt,
        context,
        slots,
        sizes,
        layers,
        reads,
        embed,
        head,
        head_read,
        head_gpu_extra,
        other,
        rows,
        kv_layer,
        compute,
        note,
        head_rows,
        _dense_on_gpu(spec, RUNTIME_DTYPES[fmt.weights]) if fmt.quant == "gguf" else None,
        expert_bytes,
    )


def _by_part(spec: ModelSpec, size: Callable[[TensorSpec], int]) -> tuple[list[int], int, int, int]:
    """`size` of the tensors summed by where they are placed: (per decoder layer, token embeddings, final norm + LM
    head, the rest)."""
    layers, embed, head, other = [0] * spec.dims.num_layers, 0, 0, 0
    for t in spec.tensors:
        b = size(t)
        if t.role == "layer" and t.layer is not None and t.layer < spec.dims.num_layers:
            layers[t.layer] += b
        elif t.role == "embed":
            embed += b
        elif t.role in ("output", "norm"):
            head += b
        else:
            other += b
    return layers, embed, head, other


def _dense_on_gpu(spec: ModelSpec, dtype_bytes: int) -> DenseOnGpu:
    """Every tensor at `dtype_bytes` per parameter, by where `-ngl` places it (a tied head: a copy of the
    embeddings)."""
    layers, embed, head, _ = _by_part(spec, lambda t: t.n_elements * dtype_bytes)
    return DenseOnGpu(layers, embed, head + (embed if spec.dims.tied else 0))


def _compute(spec: ModelSpec, fmt: Format, context: int, slots: int, draft_max: int) -> tuple[int, str]:
    """Activation buffers of one prefill chunk / ubatch (estimate)."""
    d = spec.dims
    chunk = min(UBATCH, context)
    width = 2 * d.hidden + (d.num_heads + 2 * d.num_kv_heads) * d.head_dim_k + 3 * d.intermediate
    if fmt.runtime:
        rb = RUNTIME_DTYPES[fmt.weights]
        b = chunk * width * rb + chunk * kv_rows(context, "specdec") + 2 * (draft_max + 1) * d.vocab * 4
        note = f"one {chunk}-token prefill chunk of activations + its mask + fp32 logits of a verify step"
        if fmt.quant == "gguf":  # prefill dequantizes a fused gate/up into one bf16 buffer (gguf_linear._scratch)
            b += d.hidden * 2 * d.intermediate * 2
            note += " + the prefill's dequantized gate/up (bf16)"
        return b, note
    b = chunk * (width + d.vocab) * 4 + d.vocab * 4 * slots
    return b, (
        f"one {chunk}-token ubatch of f32 activations and logits (flash attention on); llama.cpp logs the real figure"
    )


@dataclass
class RuntimeRSS:
    """specdec's own process on the CPU: predicted resident memory, steady and at the load peak."""

    steady: int
    load_peak: int
    peak: int
    parts: dict[str, int]
    phases: dict[str, int]
    load_note: str  # what loading holds beyond the steady parts


def tokenizer_bytes(spec: ModelSpec) -> int:
    return SPECDEC_TOKENIZER_PER_TOKEN * spec.dims.vocab


def reader_bytes(spec: ModelSpec) -> int:
    """The Python objects of `gguf.GGUFReader` over this file's header (alive while the runtime loads it)."""
    return GGUF_READER_PER_PART * spec.reader_parts


def runtime_rss(target: ModelMemory, draft: ModelMemory | None, heads: dict[str, int] | None = None) -> RuntimeRSS:
    """What `specdec generate` holds: torch + Python, then per model weights, KV, buffers and tokenizer, and the
    drafters' own parts (`heads`: a trained head's weights and KV cache). The target loads first (with its
    tokenizer and KV), then the draft; each load holds more for a while (`_loading`)."""
    parts = {"torch + Python": SPECDEC_BASE, **_model_parts("target", target), **(heads or {})}
    steady_t = sum(parts.values())
    phases = {"loading the target": SPECDEC_BASE + _loading(target)}
    if draft is not None:
        parts.update(_model_parts("draft", draft))
        phases["loading the draft"] = steady_t - target.compute + _loading(draft)
    steady = sum(parts.values())
    phases["generating"] = steady
    load_peak = max(v for k, v in phases.items() if k != "generating")
    note = "; ".join(dict.fromkeys(_LOAD_NOTES[m.fmt.quant == "gguf"] for m in (target, draft) if m is not None))
    return RuntimeRSS(steady, load_peak, max(phases.values()), parts, phases, note)


_LOAD_NOTES = {
    True: "the GGUF reader's header objects and a repacked tensor's file pages beside its copy",
    False: "the mmap'd checkpoint beside the converted weights",
}


def _model_parts(role: str, m: ModelMemory) -> dict[str, int]:
    return {
        f"{role} weights": _resident_weights(m),
        f"{role} KV": m.kv,
        f"{role} buffers": m.compute,
        f"{role} tokenizer": tokenizer_bytes(m.spec),
    }


def _resident_weights(m: ModelMemory) -> int:
    """Weights in RSS. A gguf token-embedding table left in the file's layout is a view of the mapped file, of
    which only the looked-up rows' pages are read in (unless it is the tied LM head too, read whole every step)."""
    if m.fmt.quant != "gguf" or m.spec.dims.tied:
        return m.weights
    emb = next((t for t in m.spec.tensors if t.role == "embed"), None)
    if emb is None or emb.name not in block_tensors(m.spec, m.fmt) or _repacked(emb, m.fmt.x16):
        return m.weights
    return m.weights - m.embed


def _loading(m: ModelMemory) -> int:
    """RSS `load_model` adds while it loads m, at its highest.

    gguf: the reader's objects stay alive to the end of `load_gguf_quantized` (the tokenizer is built last), beside
    the weights; while a tensor is repacked its file pages are resident too until `_release` drops them.
    Dense: `load_checkpoint` reads the checkpoint through mmap (a GGUF or pack converted once to float32
    safetensors) and every page stays resident beside the converted weights until the file is closed."""
    if m.fmt.quant == "gguf":
        kept = block_tensors(m.spec, m.fmt)
        pages = max((t.file_bytes for t in m.spec.tensors if t.name in kept and _repacked(t, m.fmt.x16)), default=0)
        return reader_bytes(m.spec) + _resident_weights(m) + max(pages, tokenizer_bytes(m.spec))
    ckpt = m.spec.file_bytes if m.spec.kind in ("checkpoint", "config") else m.spec.params * 4
    return ckpt + m.spec.params * RUNTIME_DTYPES[m.fmt.weights]
