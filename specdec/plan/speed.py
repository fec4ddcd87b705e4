"""Speed: bandwidth upper bounds per decode step and the expected speculative speedup.

Decoding one token reads every weight it uses once, so a step takes at least
    t = bytes_on_gpu / gpu_bw + bytes_on_cpu / ram_bw + crossings x (hidden bytes / pcie_bw + latency).
With a draft model proposing k tokens per step, accepted independently with probability a, a
target forward yields on average (Leviathan et al. 2023)
    E[tokens] = (1 - a^(k+1)) / (1 - a)
and costs k draft steps plus one target forward, so with c = t_draft / t_target
    speedup = E[tokens] / (k c + 1).
This assumes verifying k+1 tokens costs one forward (true while memory-bound) unless a `verify` cost of a forward
by its rows says otherwise: a mixture of experts reads more experts as the rows grow (`memory.experts_read`), so
    speedup = E[tokens] / (k c + verify(k + 1)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PCIE_LATENCY = 10e-6  # seconds per device crossing per step (launch + sync), approximate


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per target forward with k drafted tokens each accepted with probability alpha."""
    if k < 0 or not 0 <= alpha <= 1:
        raise ValueError("need k >= 0 and alpha in [0, 1]")
    if alpha == 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


Verify = Callable[[int], float]  # a target forward's cost by its rows, one row = 1.0


def _flat(rows: int) -> float:
    return 1.0


def speedup(alpha: float, k: int, c: float, verify: Verify = _flat) -> float:
    """Expected speedup over plain decoding (1.0 = no gain)."""
    return expected_tokens(alpha, k) / (k * c + verify(k + 1))


def best_k(alpha: float, c: float, k_max: int = 16, verify: Verify = _flat) -> tuple[int, float]:
    """(k, speedup) maximising the speedup for k in 1..k_max."""
    return max(((k, speedup(alpha, k, c, verify)) for k in range(1, k_max + 1)), key=lambda ks: ks[1])


def break_even_alpha(c: float, k: int, verify: Verify = _flat) -> float:
    """The acceptance rate below which drafting k tokens is slower than plain decoding."""
    if speedup(1.0, k, c, verify) < 1:  # slower even when every draft is accepted
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if speedup(mid, k, c, verify) < 1:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class StepTime:
    seconds: float
    gpu_s: float
    cpu_s: float
    link_s: float

    @property
    def tokens_per_s(self) -> float:
        return 1 / self.seconds if self.seconds > 0 else float("inf")


def step_time(
    gpu_bytes: int,
    cpu_bytes: int,
    crossings: int,
    hidden_bytes: int,
    gpu_bw: float | None,
    ram_bw: float,
    pcie_bw: float | None,
) -> StepTime:
    gpu_s = gpu_bytes / gpu_bw if gpu_bytes and gpu_bw else 0.0
    cpu_s = cpu_bytes / ram_bw
    link_s = crossings * (hidden_bytes / pcie_bw + PCIE_LATENCY) if crossings and pcie_bw else 0.0
    return StepTime(gpu_s + cpu_s + link_s, gpu_s, cpu_s, link_s)
