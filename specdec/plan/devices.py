"""Named devices with default memory and bandwidths (vendor peak figures; override with flags)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import SpecdecError

GB, GiB = 10**9, 2**30


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # gpu | unified | cpu
    mem: int  # bytes (GPU memory; for unified: the whole pool)
    bw: float  # bytes/s (GPU memory, or RAM for cpu)
    pcie: float | None = None  # host link bytes/s (None: no separate link)
    note: str = ""
    x16: bool | None = None  # cpu: whether the GGUF kernels run the x16 layout (AVX2 / AVX-512; None: not implied)


PCIE4, PCIE5 = 25 * GB, 50 * GB  # effective x16 rates
UNIFIED_GPU_SHARE = 0.75  # macOS lets the GPU wire about 3/4 of unified memory by default

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("rtx3060", "gpu", 12 * GiB, 360 * GB, PCIE4),
        Device("rtx3090", "gpu", 24 * GiB, 936 * GB, PCIE4),
        Device("rtx4060ti-16gb", "gpu", 16 * GiB, 288 * GB, PCIE4),
        Device("rtx4070", "gpu", 12 * GiB, 504 * GB, PCIE4),
        Device("rtx4080", "gpu", 16 * GiB, 717 * GB, PCIE4),
        Device("rtx4090", "gpu", 24 * GiB, 1008 * GB, PCIE4),
        Device("rtx5090", "gpu", 32 * GiB, 1792 * GB, PCIE5),
        Device("l4", "gpu", 24 * GiB, 300 * GB, PCIE4),
        Device("a10", "gpu", 24 * GiB, 600 * GB, PCIE4),
        Device("l40s", "gpu", 48 * GiB, 864 * GB, PCIE4),
        Device("a100-40gb", "gpu", 40 * GiB, 1555 * GB, PCIE4),
        Device("a100-80gb", "gpu", 80 * GiB, 2039 * GB, PCIE4),
        Device("h100", "gpu", 80 * GiB, 3350 * GB, PCIE5, "SXM"),
        Device("h100-pcie", "gpu", 80 * GiB, 2000 * GB, PCIE5),
        Device("h200", "gpu", 141 * GB, 4800 * GB, PCIE5),
        Device("mi300x", "gpu", 192 * GB, 5300 * GB, PCIE5),
        Device("m1-max", "unified", 64 * GiB, 400 * GB, None, "unified memory"),
        Device("m2-max", "unified", 96 * GiB, 400 * GB, None, "unified memory"),
        Device("m2-ultra", "unified", 192 * GiB, 800 * GB, None, "unified memory"),
        Device("m3-max", "unified", 128 * GiB, 400 * GB, None, "unified memory"),
        Device("m4-max", "unified", 128 * GiB, 546 * GB, None, "unified memory"),
    )
}

CPUS: dict[str, Device] = {
    d.name: d
    for d in (
        Device("cpu-ddr4", "cpu", 0, 51.2 * GB, note="2 channels DDR4-3200"),
        Device("cpu-ddr5", "cpu", 0, 89.6 * GB, note="2 channels DDR5-5600"),
        Device("cpu-ddr5-8ch", "cpu", 0, 307 * GB, note="8 channels DDR5-4800 (server)"),
        Device("cpu-ddr5-12ch", "cpu", 0, 461 * GB, note="12 channels DDR5-4800 (EPYC 9004)", x16=True),
    )
}
DEFAULT_CPU = "cpu-ddr5"
# what the kernels' x16 layout needs (its AVX2 kernel; gq_best_path in specdec/runtime/kernels/ggml_q.c)
X16_KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c"})


def gpu_device(name: str) -> Device:
    key = name.lower()
    if key not in DEVICES:
        raise SpecdecError(f"unknown GPU {name!r} (known: {', '.join(DEVICES)}; or give --gpu-mem and --gpu-bw)")
    return DEVICES[key]


def cpu_device(name: str) -> Device:
    key = name.lower()
    if key not in CPUS:
        raise SpecdecError(f"unknown CPU profile {name!r} (known: {', '.join(CPUS)}; or give --ram-bw)")
    return CPUS[key]


def detect_ram() -> int | None:
    """Total RAM in bytes from /proc/meminfo (None elsewhere)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def this_cpu_x16() -> bool:
    """Whether this machine's CPU runs the GGUF kernels' x16 layout (AVX2 or AVX-512)."""
    from specdec.runtime.cpu import cpu_flags

    return X16_KERNEL_FLAGS <= cpu_flags()


def detect_gpu() -> tuple[str, int] | None:
    """(name, total memory) of CUDA device 0 when torch sees one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return props.name, int(props.total_memory)
    except Exception:  # no torch / broken driver: plan as CPU-only
        return None


def match_gpu_name(name: str) -> Device | None:
    """'NVIDIA GeForce RTX 4090' -> the rtx4090 profile (for its bandwidth), when we know it."""
    flat = name.lower().replace(" ", "").replace("geforce", "").replace("nvidia", "")
    best = None
    for d in DEVICES.values():
        key = d.name.replace("-", "")
        if key.split("gb")[0] in flat and (best is None or len(d.name) > len(best.name)):
            best = d
    return best
