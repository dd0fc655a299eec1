"""Efficiency arithmetic: peak FLOPS by GPU, MFU, and cost split by the goodput breakdown.

Pure functions, no Django and no I/O, like ``jobs.goodput_math``: ``jobs.efficiency`` gathers the
inputs from the database.

MFU (model FLOPs utilisation, PaLM's definition) = achieved model FLOPs per second / the peak the
job's accelerators could do. Achieved = tokens per second × FLOPs per token, where FLOPs per token
defaults to 6 × parameters (forward 2N + backward 4N; attention's extra term is left out, as in
PaLM's "6N" approximation). Recomputation is not counted: it is not model work.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

#: bf16 dense (no sparsity) peak TFLOPS per GPU, by NVML name. First match wins, so the more
#: specific patterns come first. V100 has no bf16: its fp16 tensor-core peak is used.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"GH200", 989.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100", 989.0),  # SXM5 (NVML: "NVIDIA H100 80GB HBM3")
    (r"H800", 989.0),
    (r"B200", 2250.0),
    (r"A100", 312.0),  # 40 GB and 80 GB, SXM4 and PCIe alike
    (r"A800", 312.0),
    (r"L40S", 362.0),
    (r"L40", 181.0),
    (r"L4\b", 121.0),
    (r"A10G", 70.0),
    (r"A10\b", 125.0),
    (r"A6000", 155.0),
    (r"V100.*PCIE", 112.0),
    (r"V100", 125.0),
    (r"T4\b", 65.0),
)

#: FLOPs a token costs per parameter: 2 forward + 4 backward.
FLOPS_PER_PARAMETER = 6


@functools.lru_cache(maxsize=256)
def peak_tflops_of(gpu_name: str) -> float | None:
    """The table's peak for an NVML device name, or None when the GPU is not in the table. Cached:
    a 512-node job's page asks for the same name 512 times."""
    for pattern, tflops in GPU_PEAK_TFLOPS:
        if re.search(pattern, gpu_name, flags=re.IGNORECASE):
            return tflops
    return None


def flops_per_token(parameters: int | None, override: float | None = None) -> float | None:
    """``override`` when set, else 6 × parameters; None when neither is known."""
    if override:
        return float(override)
    if parameters:
        return float(FLOPS_PER_PARAMETER * parameters)
    return None


@dataclass(frozen=True)
class Throughput:
    """Recent training speed of one generation: tokens per step (all ranks) and seconds per step."""

    tokens_per_step: float
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0


def mfu(throughput: Throughput, flops_per_token: float, peak_flops: float) -> float | None:
    """Achieved model FLOPs per second over the peak; None when the peak or the speed is unknown."""
    if peak_flops <= 0 or throughput.step_s <= 0:
        return None
    return throughput.tokens_per_s * flops_per_token / peak_flops


@dataclass(frozen=True)
class Cost:
    """Money spent on a job's accelerators, and where the waste went (by goodput badput kind)."""

    rate_per_hour: float  # all of the job's accelerators together
    total: float
    productive: float
    wasted: dict[str, float] = field(default_factory=dict)

    @property
    def wasted_total(self) -> float:
        return sum(self.wasted.values())


def cost(*, rate_per_hour: float, wall_s: float, productive_s: float, badput_s: dict[str, float]) -> Cost:
    """Spread the accelerators' cost over the goodput split: wall time costs ``rate_per_hour``;
    each badput kind wastes its seconds' share, productive time is what was worth paying for.

    Since goodput splits wall time into productive + Σ badput, total = productive + Σ wasted
    (exactly, unless badput alone exceeds wall time, when productive is clamped at zero as in
    ``jobs.goodput_math``).
    """
    per_s = rate_per_hour / 3600.0
    return Cost(rate_per_hour=rate_per_hour, total=wall_s * per_s, productive=productive_s * per_s,
                wasted={kind: seconds * per_s for kind, seconds in badput_s.items()})


def hourly_rate(allocations: Iterable[tuple[int, float]]) -> float:
    """Σ accelerators × price per accelerator-hour over the job's nodes."""
    return sum(count * price for count, price in allocations)


def below_expected(actual: float | None, expected: float | None, margin: float) -> bool:
    """True when ``actual`` is more than ``margin`` (relative) below ``expected``."""
    if actual is None or not expected:
        return False
    return actual < expected * (1.0 - margin)
