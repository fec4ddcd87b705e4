import ctypes, sys, time
import numpy as np, torch
if sys.argv[1] == "1":
    libc = ctypes.CDLL("libc.so.6"); libc.mallopt(-3, 64 << 20); libc.mallopt(-1, 128 << 20)
from specdec.runtime import kernels as K
from specdec.runtime.gguf_linear import GGUFLinear, for_this_cpu
def best(fn, n=5):
    fn(); ts=[]
    for _ in range(n):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
    return min(ts)
rng = np.random.default_rng(0)
for out, inp in ((1024, 2048), (4096, 1536), (8960, 1536), (1536, 8960)):
    nb = out*inp//256
    b = rng.integers(0, 256, size=(nb, 144), dtype=np.uint8)
    b[:, 0:4] = np.full((nb, 2), 1e-3, dtype=np.float16).view(np.uint8)
    lin = for_this_cpu(GGUFLinear.from_blocks(b, K.Q4_K, (out, inp)))
    row = []
    for rows in (128, 256, 512):
        x = torch.randn(rows, inp)
        row.append(f"{rows}: kernel {best(lambda: lin._kernel(x))*1e3:.2f} dequant {best(lambda: lin._dequant_matmul(x))*1e3:.2f}")
    print(out, inp, " | ".join(row))
