"""The small interface every telemetry source implements, and the raw values it produces.

A source only reads the hardware (or a scenario). Windowed rates, Xid history and the wire
format are added on top by ``TelemetryCollector``, the same way for every source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agents.protocol.agent import GpuInfo


@dataclass(frozen=True)
class GpuReading:
    """One GPU's counters at one moment; ``None`` where the GPU or driver does not support one."""

    gpu: int
    reachable: bool = True
    temperature_c: float | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    utilization_pct: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    throttle_reasons: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    nvlink_replay_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    nvlink_crc_flit_errors: int | None = None
    nvlink_crc_data_errors: int | None = None
    pcie_replays: int | None = None


@dataclass(frozen=True)
class XidEvent:
    gpu: int
    code: int
    time: float


@runtime_checkable
class TelemetrySource(Protocol):
    """Where GPU telemetry comes from. ``available`` is False with a human ``reason`` when there
    is none (no driver, no GPU); the agent then reports "no GPU telemetry" instead of values."""

    name: str
    available: bool
    reason: str | None

    def gpus(self) -> list[GpuInfo]:
        """The GPUs this node has, in index order."""
        ...

    def sample(self) -> list[GpuReading]:
        """Read every GPU now. Never raises for one unsupported counter."""
        ...

    def xid_events(self, timeout: float) -> list[XidEvent]:
        """Xid errors that happened since the last call, waiting up to ``timeout`` seconds for one."""
        ...

    def close(self) -> None:
        ...
