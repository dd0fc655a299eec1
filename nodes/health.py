"""Node health from GPU telemetry: pure rules, configurable thresholds, reasons in words.

No I/O and no Django: ``evaluate_node`` takes the latest sample of each GPU (the wire
``GpuSample`` as a JSON object, as stored in ``GPU.last_sample``) and returns a verdict with the
reasons, so the same function serves ingest, the heartbeat and the tests.

1. Each GPU is judged on its own; the node is as bad as its worst GPU.
2. **unhealthy** (the node must not run work; the drain policy acts on it): the GPU is
   unreachable or has gone silent while the others report, is hotter than ``max_temperature_c``,
   had uncorrected ECC errors, a critical Xid or NVLink errors *within the agent's window*
   (``*_recent``), or row remapping failed.
3. **degraded** (usable, but watch it): warmer than ``warn_temperature_c``, a reset is pending
   to retire or remap memory, non-critical Xids or many corrected ECC errors in the window, a
   hardware slowdown in the throttle reasons, or too little free memory while idle (another
   process holds the GPU).

The windowed counters are what makes a node recover: one error long ago does not condemn it.
Defaults are the agent's pre-launch thresholds (``agents.health``), so both ends agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agents.health import CRITICAL_XIDS, HealthThresholds

HEALTHY = "healthy"
DEGRADED = "degraded"
UNHEALTHY = "unhealthy"
UNKNOWN = "unknown"
_RANK = {UNKNOWN: 0, HEALTHY: 1, DEGRADED: 2, UNHEALTHY: 3}

_AGENT = HealthThresholds()
#: NVML clocks-event reasons that mean the hardware is slowing itself down: HW slowdown (0x8),
#: HW thermal slowdown (0x40), HW power brake (0x80).
HW_SLOWDOWN_MASK = 0x8 | 0x40 | 0x80


@dataclass(frozen=True)
class Thresholds:
    max_temperature_c: float = _AGENT.max_temperature_c
    warn_temperature_c: float = 80.0
    max_uncorrected_ecc: int = _AGENT.max_uncorrected_ecc
    warn_corrected_ecc: int = 1000
    critical_xids: frozenset[int] = CRITICAL_XIDS
    max_nvlink_errors: int = _AGENT.max_nvlink_errors
    min_free_memory_bytes: int = _AGENT.min_free_memory_bytes
    throttle_mask: int = HW_SLOWDOWN_MASK

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Thresholds:
        """Overrides (``settings.NIGHTWATCH["HEALTH"]``); unknown names and wrong types are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                raise ValueError(f"HEALTH: unknown threshold {name!r}; expected one of {sorted(known)}")
            if name == "critical_xids":
                if isinstance(value, (str, bytes)) or not all(isinstance(v, int) for v in value):
                    raise ValueError("HEALTH: critical_xids must be a list of integers")
                value = frozenset(value)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"HEALTH: {name} must be a non-negative number, got {value!r}")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class Verdict:
    health: str
    reasons: tuple[str, ...]
    #: GPU index -> its own health.
    gpus: dict[int, str]

    @property
    def evidence(self) -> dict:
        return {"reasons": list(self.reasons), "gpus": {str(k): v for k, v in sorted(self.gpus.items())}}


def evaluate_gpu(sample: Mapping[str, Any], t: Thresholds, *, idle: bool) -> tuple[str, list[str]]:
    """(health, reasons) of one GPU from its latest sample. Reasons name the GPU and the limit."""
    gpu = sample.get("gpu")
    if not sample.get("reachable", True):
        return UNHEALTHY, [f"GPU {gpu} is not reachable"]
    bad: list[str] = []
    warn: list[str] = []
    window = f"in the last {sample.get('window_s', 600):g} s"

    temperature = sample.get("temperature_c")
    if temperature is not None:
        if temperature > t.max_temperature_c:
            bad.append(f"GPU {gpu} at {temperature:g} °C, above {t.max_temperature_c:g} °C")
        elif temperature > t.warn_temperature_c:
            warn.append(f"GPU {gpu} at {temperature:g} °C, above the warning level {t.warn_temperature_c:g} °C")

    uncorrected = sample.get("ecc_uncorrected_recent")
    if uncorrected is not None and uncorrected > t.max_uncorrected_ecc:
        bad.append(f"GPU {gpu}: {uncorrected} uncorrected ECC error(s) {window}")
    corrected = sample.get("ecc_corrected_recent")
    if corrected is not None and corrected > t.warn_corrected_ecc:
        warn.append(f"GPU {gpu}: {corrected} corrected ECC errors {window}")

    codes = list(sample.get("recent_xid_codes") or ())
    critical = [code for code in codes if code in t.critical_xids]
    if critical:
        bad.append(f"GPU {gpu}: critical Xid {', '.join(map(str, critical))} {window}")
    elif sample.get("xid_recent"):
        shown = f" ({', '.join(map(str, codes))})" if codes else ""
        warn.append(f"GPU {gpu}: {sample['xid_recent']} non-critical Xid(s){shown} {window}")

    nvlink = sample.get("nvlink_errors_recent")
    if nvlink is not None and nvlink > t.max_nvlink_errors:
        bad.append(f"GPU {gpu}: {nvlink} NVLink error(s) {window}")

    if sample.get("remap_failed"):
        bad.append(f"GPU {gpu}: row remapping failed")
    elif sample.get("remap_pending") or sample.get("retired_pages_pending"):
        warn.append(f"GPU {gpu}: a reset is pending to retire or remap memory")

    throttle = sample.get("throttle_reasons")
    if throttle and throttle & t.throttle_mask:
        warn.append(f"GPU {gpu}: hardware slowdown (throttle reasons {throttle:#x})")

    free = sample.get("memory_free")
    if idle and free is not None:
        # A small card cannot have 10 GiB free; ask it for 90% of its memory instead (as the agent does).
        need = min(t.min_free_memory_bytes, int(0.9 * (free + (sample.get("memory_used") or 0))))
        if free < need:
            warn.append(f"GPU {gpu}: {free / 2**30:.1f} GiB free while idle, below {need / 2**30:.1f} GiB "
                        "(another process holds it)")

    if bad:
        return UNHEALTHY, bad + warn
    return (DEGRADED, warn) if warn else (HEALTHY, [])


def evaluate_node(samples: Iterable[Mapping[str, Any]], t: Thresholds | None = None, *, idle: bool,
                  silent: Mapping[int, float | None] | None = None) -> Verdict:
    """The node's verdict from the latest sample of each of its GPUs (``unknown`` without any).

    ``silent``: GPUs that stopped reporting while the others go on (index -> seconds since their
    last sample, None if they never sent one) — a GPU fallen off the bus may vanish from NVML's
    list rather than report itself unreachable.
    """
    t = t or Thresholds()
    health, reasons, gpus = UNKNOWN, [], {}
    for index, quiet in sorted((silent or {}).items()):
        gpus[index] = health = UNHEALTHY
        reasons.append(f"GPU {index} has sent no sample since the agent registered" if quiet is None
                       else f"GPU {index} has sent no sample for {quiet:.0f} s")
    for sample in samples:
        gpu_health, gpu_reasons = evaluate_gpu(sample, t, idle=idle)
        gpus[sample.get("gpu")] = gpu_health
        reasons.extend(gpu_reasons)
        if _RANK[gpu_health] > _RANK[health]:
            health = gpu_health
    return Verdict(health=health, reasons=tuple(reasons), gpus=gpus)

