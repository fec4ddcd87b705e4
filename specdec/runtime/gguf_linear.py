"""A linear layer that computes from a GGUF tensor's quantized blocks.

`GGUFLinear` holds block bytes ([out, bytes_per_row] uint8) plus the GGML type id; no 16/32-bit copy of the
weight is kept. The bytes are the file's own (a view of its memory map) or, where the AVX2 or AVX-512 kernels
run, the same blocks repacked at load 16 outputs at a time (`repacked`, "x16": the same values, no unpacking or
transposing per call). Every row count (decode, verification, ragged server batches, prefill chunks) goes through
the C kernels in `specdec/runtime/kernels/ggml_q.c` (int8-quantized activations, integer dot products; AVX-512 with
or without VNNI, AVX2 or scalar, chosen at run time), whose result for a row does not depend on the rows beside it.
With fast prefill (`kernels.set_fast_prefill`, opt-in) forwards of more rows dequantize the weight in chunks of
output rows (bf16 where the CPU has native bf16, else the input's dtype) into a reused buffer for torch's matmul.
Without the compiled library every forward dequantizes through the `gguf` package (slow but correct).

Types: Q4_K, Q5_0, Q6_K, Q8_0 (what Q4_K_M packs hold), Q4_1 (the SmolLM2-135M pack) and MXFP4 (gpt-oss's experts).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch
from torch import nn

from specdec.runtime import kernels as K
from specdec.runtime.cpu import has_bf16

DEQUANT_CHUNK_BYTES = 32 << 20  # dequantized weight held at once in the fast prefill path


def for_this_cpu(lin: "GGUFLinear") -> "GGUFLinear":
    """The layout this CPU runs fastest: x16 (repacked at load, never cached) where the AVX2 or AVX-512 kernels
    run and the type has that layout, else the file's own blocks."""
    if lin.qtype in K.REPACKABLE and lin.out_features % 16 == 0 and K.runs_x16():
        return lin.repacked()
    return lin


class GGUFLinear(nn.Module):
    def __init__(
        self, qweight: torch.Tensor, qtype: int, in_features: int, out_features: int, bias: torch.Tensor | None = None
    ):
        super().__init__()
        if qtype not in K.BLOCK:
            raise ValueError(f"GGML type {qtype} not supported (supported: {', '.join(K.TYPES)})")
        be, bb = K.BLOCK[qtype]
        if in_features % be:
            raise ValueError(f"in_features {in_features} is not a multiple of the block size {be}")
        want = (out_features, in_features // be * bb)
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise ValueError(f"qweight must be uint8 {want}, got {qweight.dtype} {tuple(qweight.shape)}")
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.last_path = ""  # 'avx512' / 'avx512bw' / 'avx2' / 'scalar' / 'dequant': what the last forward ran

    @classmethod
    def from_blocks(cls, blocks, qtype: int | str, shape: tuple[int, int], bias: torch.Tensor | None = None):
        """blocks: the tensor's bytes (numpy array or tensor, any shape); shape: (out, in) as torch sees it."""
        qtype = K.TYPES[qtype] if isinstance(qtype, str) else int(qtype)
        out, inp = shape
        t = torch.from_numpy(np.ascontiguousarray(blocks)) if isinstance(blocks, np.ndarray) else blocks
        return cls(t.reshape(out, -1), qtype, inp, out, bias)

    @property
    def type_name(self) -> str:
        name = next(k for k, v in K.TYPES.items() if v == self.qtype & ~K.X16)
        return f"{name} x16" if self.qtype & K.X16 else name

    def first_outputs(self, n: int) -> "GGUFLinear":
        """This layer's first `n` outputs (rounded up to a multiple of 16 in the x16 layout), sharing its blocks."""
        n = min(self.out_features, -(-n // 16) * 16 if self.qtype & K.X16 else n)
        return GGUFLinear(
            self.qweight[:n], self.qtype, self.in_features, n, None if self.bias is None else self.bias.data[:n]
        )

    def repacked(self) -> "GGUFLinear":
        """This layer with its blocks rearranged for the AVX-512 kernel: 16 outputs interleaved per 256
        inputs, the same quants and scales (ggml_q.c, 'x16 layout'); the values are the file's, only the
        order of the bytes changes (Q4_K: 2.8% more bytes, its 6-bit scales stored as bytes). A copy in anonymous
        memory (the file's pages are no longer read)."""
        be, bb = K.BLOCK[self.qtype + K.X16]
        dst = torch.empty(self.out_features, self.in_features // be * bb, dtype=torch.uint8)
        rc = K.library().gq_repack(
            self.qtype,
            self.qweight.data_ptr(),
            self.out_features,
            self.in_features,
            dst.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"cannot repack {self.type_name} {self.out_features}x{self.in_features} (error {rc})")
        return GGUFLinear(
            dst, self.qtype + K.X16, self.in_features, self.out_features, None if self.bias is None else self.bias.data
        )

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, type={self.type_name}, bias={self.bias is not None}"

    # -- dequantize --------------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice | None = None) -> torch.Tensor:
        """The weight (or output rows `rows`) as a dense [out, in] tensor."""
        o0, o1, _ = (rows or slice(None)).indices(self.out_features)
        if self.qweight.device.type != "cpu":  # the C code reads host memory only: copy the rows' blocks over
            a, b = (o0 // 16 * 16, -(-o1 // 16) * 16) if self.qtype & K.X16 else (o0, o1)  # x16: whole groups
            host = GGUFLinear(self.qweight[a:b].cpu(), self.qtype, self.in_features, b - a)
            return host.dequantize(dtype, slice(o0 - a, o1 - a)).to(self.qweight.device)
        dst = torch.empty(o1 - o0, self.in_features, dtype=dtype if dtype == torch.bfloat16 else torch.float32)
        if self._dequantize_c(o0, o1, dst):
            return dst.to(dtype)
        import gguf  # no kernel library (so the file's own layout): the gguf package's dequantizer

        w = gguf.quants.dequantize(self.qweight[o0:o1].numpy(), gguf.GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(o1 - o0, self.in_features).to(dtype)

    def _dequantize_c(self, o0: int, o1: int, dst: torch.Tensor) -> bool:
        """Rows [o0, o1) into dst (float32 or bfloat16, [o1 - o0, in]) through the C library; False without it."""
        lib = K.library()
        return (
            lib is not None
            and lib.gq_dequantize(
                self.qtype,
                self.qweight.data_ptr(),
                self.in_features,
                o0,
                o1,
                dst.data_ptr(),
                int(dst.dtype == torch.bfloat16),
                torch.get_num_threads(),
            )
            == 0
        )

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = self._kernel(x2) if K.kernels_take(x2.shape[0]) else None
        if y is None:
            y = self._dequant_matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x2: torch.Tensor, path: int | None = None) -> torch.Tensor | None:
        return kernel_matmul([self], x2, path)

    def _dequant_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        fast_bf16 = K.fast_prefill() and has_bf16()  # native bf16: ~4x fp32
        dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 or fast_bf16 else torch.float32
        xd = x2.to(dtype)
        step = min(self.out_features, max(64, DEQUANT_CHUNK_BYTES // (self.in_features * xd.element_size())) // 32 * 32)
        self.last_path = "dequant"
        if x2.device.type != "cpu":
            return (xd @ self.dequantize(dtype).T).to(x2.dtype)
        y = torch.empty(x2.shape[0], self.out_features, dtype=dtype)
        for o0 in range(0, self.out_features, step):
            o1 = min(o0 + step, self.out_features)
            w = self._dequantize_into(_scratch(dtype, (o1 - o0) * self.in_features), o0, o1)  # [in, o1 - o0]
            if o1 - o0 == self.out_features:
                torch.matmul(xd, w, out=y)
            else:
                y[:, o0:o1] = xd @ w
        return y.to(x2.dtype)

    def _dequantize_into(self, buf: torch.Tensor, o0: int, o1: int) -> torch.Tensor:
        """Rows [o0, o1) of the weight, transposed ([in, o1 - o0]), in `buf`: written transposed by the C library
        where it can (x16 Q4_K / Q6_K to bf16 on AVX512-BF16 with VBMI, `gq_dequantize_t`: vectorized, where the
        row-major writer unpacks element by element), else a view of the row-major
        rows."""
        n = o1 - o0
        wt = buf.view(self.in_features, n)
        if self._dequantize_t(wt, o0, o1):
            return wt
        w = buf.view(n, self.in_features)
        return (w if self._dequantize_c(o0, o1, w) else w.copy_(self.dequantize(w.dtype, slice(o0, o1)))).T

    def _dequantize_t(self, dst: torch.Tensor, o0: int, o1: int) -> bool:
        """Rows [o0, o1) into dst (bf16 [in, o1 - o0], rows `dst.stride(0)` apart), transposed, through the C library
        (`gq_dequantize_t`); False where it has no such path. An empty range (o0 == o1) only asks whether it has."""
        lib = K.library()
        return (
            lib is not None
            and dst.dtype == torch.bfloat16
            and lib.gq_dequantize_t(
                self.qtype,
                self.qweight.data_ptr(),
                self.in_features,
                o0,
                o1,
                dst.data_ptr(),
                dst.stride(0),
                torch.get_num_threads(),
            )
            == 0
        )


class GGUFConcatLinear(nn.Module):
    """Several GGUFLinears that take the same input (a fused q/k/v or gate/up, of one or several block types),
    outputs side by side: one kernel call for all parts (activations quantized once, threads split every part's
    outputs); fast prefill's large forwards dequantize them side by side for one matmul."""

    def __init__(self, parts: list[GGUFLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        biases = [p.bias for p in parts]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat([b.data if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)])
        )
        self.register_buffer("bias", bias, persistent=False)  # [out] all parts' biases, for the kernel path

    @property
    def last_path(self) -> str:
        return self.parts[0].last_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        y = kernel_matmul(list(self.parts), x2) if K.kernels_take(rows) else self._dequant_matmul(x2)
        if y is None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _dequant_matmul(self, x2: torch.Tensor) -> torch.Tensor | None:
        """Above the kernel rows: every part dequantized transposed, side by side, into one bf16 buffer ([in, out]) and
        one matmul, instead of a matmul per part and a concatenation of their float outputs (`torch.cat` took ~0.2 s
        of a 512-row forward of the 1.5B in torch's profiler on an Intel Xeon); None where the C library cannot write a
        part so (not AVX512-BF16 with VBMI, not x16 Q4_K / Q6_K): each part on its own then."""
        probe = torch.empty(0, 0, dtype=torch.bfloat16)
        if x2.device.type != "cpu" or not all(p._dequantize_t(probe, 0, 0) for p in self.parts):
            return None  # asked before the buffer is made: elsewhere it would only cost memory
        w = _scratch(torch.bfloat16, self.in_features * self.out_features).view(self.in_features, self.out_features)
        col = 0
        for p in self.parts:
            if not p._dequantize_t(w[:, col : col + p.out_features], 0, p.out_features):
                return None
            p.last_path, col = "dequant", col + p.out_features
        return (x2.to(torch.bfloat16) @ w).to(x2.dtype)


def kernel_matmul(
    parts: list[GGUFLinear], x2: torch.Tensor, path: int | None = None, keep: bool = True
) -> torch.Tensor | None:
    """x2 [rows, in] @ the parts' weights -> [rows, sum of outs] in x2's dtype (no bias), in one call of the C
    kernels; None where they cannot run (no library, not on the CPU). `keep`: keep the call's arrays for the next
    call with these parts (not for sets that seldom recur, such as the experts a token chose)."""
    lib = K.library()
    if lib is None or not x2.is_cpu or not all(p.qweight.is_cpu for p in parts):
        return None
    args = matmul_args(parts, keep)
    xf = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], args[-1], dtype=torch.float32)
    rc = lib.gq_matmul_parts(
        *args[:-1],
        parts[0].in_features,
        xf.data_ptr(),
        x2.shape[0],
        y.data_ptr(),
        torch.get_num_threads(),
        K.requested_path() if path is None else path,
    )
    if rc < 0:
        return None
    name = K.PATH_NAMES[rc]
    for p in parts:
        if p.last_path != name:  # a module attribute write is slow; it rarely changes
            p.last_path = name
    return y if x2.dtype == torch.float32 else y.to(x2.dtype)


_call_args: dict[tuple, tuple] = {}  # the parts' (weight address, type, outputs) -> gq_matmul_parts' arrays


def matmul_args(parts, keep: bool = True) -> tuple:
    """(n, types, weights, outputs, total outputs): the arrays gq_matmul_parts takes for these parts, built once per
    set of weights (ctypes arrays cost more than the call at one row) where `keep`; keyed by address, type and
    outputs, so a weight moved or replaced gets its own."""
    key = tuple((p.qweight.data_ptr(), p.qtype, p.out_features) for p in parts)
    args = _call_args.get(key)
    if args is None:
        n = len(key)
        args = (
            n,
            (ctypes.c_int * n)(*[k[1] for k in key]),
            (ctypes.c_void_p * n)(*[k[0] for k in key]),
            (ctypes.c_int64 * n)(*[k[2] for k in key]),
            sum(k[2] for k in key),
        )
        if keep:
            _call_args[key] = args
    return args


_local = threading.local()


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A reused per-thread buffer for dequantized chunks: fresh allocations of tens of MB cost more in page
    faults than the dequantization itself (measured: 30-40 ms for 55 MB vs 2.5 ms to fill it)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    b = bufs.get(dtype)
    if b is None or b.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            b = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return b[:numel]
