"""A telemetry source that plays a scenario file: stands in for GPUs on machines without one.

A scenario (YAML or JSON) sets a baseline for every GPU and then changes values at given
times after the source starts. Values stay changed until a later event changes them again;
``xid`` raises one Xid event. Field names are those of ``GpuReading``, with short aliases::

    gpus: 2
    baseline: {temperature: 45, utilization: 90, memory_used: 2GiB}
    events:
      - {at: 30s, gpu: 1, temperature: 92}
      - {at: 60s, gpu: 0, xid: 79}
      - {at: 90s, ecc_uncorrected_volatile: 1}     # no gpu: every GPU

``unavailable: "<reason>"`` makes the source behave like a node without GPU telemetry.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from agents.protocol.agent import MAX_GPUS, GpuInfo
from agents.telemetry.base import GpuReading, XidEvent

ALIASES = {"temperature": "temperature_c", "utilization": "utilization_pct", "power": "power_w",
           "sm_clock": "sm_clock_mhz"}
_FIELD_TYPES = {f.name: typing.get_type_hints(GpuReading)[f.name] for f in fields(GpuReading)
                if f.name != "gpu"}
_DEFAULT_BASELINE: dict[str, Any] = {
    "temperature_c": 40.0, "memory_used": 512 * 2**20, "utilization_pct": 0.0, "power_w": 60.0,
    "sm_clock_mhz": 1410, "throttle_reasons": 0, "ecc_corrected_volatile": 0,
    "ecc_uncorrected_volatile": 0, "ecc_corrected_aggregate": 0, "ecc_uncorrected_aggregate": 0,
    "retired_pages": 0, "retired_pages_pending": False, "remapped_rows_correctable": 0,
    "remapped_rows_uncorrectable": 0, "remap_pending": False, "remap_failed": False,
    "nvlink_replay_errors": 0, "nvlink_recovery_errors": 0, "nvlink_crc_flit_errors": 0,
    "nvlink_crc_data_errors": 0, "pcie_replays": 0,
}
_SIZE = re.compile(r"\s*([0-9.]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_DURATION = re.compile(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}


class ScenarioError(ValueError):
    """A scenario file that does not say what it means; the message names the place."""


@dataclass(frozen=True)
class ScenarioEvent:
    at: float
    gpu: int | None  # None: every GPU
    values: Mapping[str, Any]
    xid: int | None = None


@dataclass(frozen=True)
class Scenario:
    gpus: int
    baseline: Mapping[str, Any]
    events: tuple[ScenarioEvent, ...]
    memory_total: int = 80 * 2**30
    gpu_name: str = "Scripted GPU"
    uuid_prefix: str = ""
    unavailable: str | None = None

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        try:
            data = yaml.safe_load(Path(path).read_text())  # YAML is a superset of JSON
        except (OSError, yaml.YAMLError) as exc:
            raise ScenarioError(f"{path}: cannot read scenario: {exc}") from exc
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "scenario") -> Scenario:
        top = _mapping(data, where, {"gpus", "baseline", "events", "memory_total", "name",
                                     "uuid_prefix", "unavailable"})
        gpus = top.get("gpus", 1)
        if not isinstance(gpus, int) or isinstance(gpus, bool) or not 1 <= gpus <= MAX_GPUS:
            raise ScenarioError(f"{where}: gpus: expected an integer 1..{MAX_GPUS}, got {gpus!r}")
        baseline = dict(_DEFAULT_BASELINE)
        baseline.update(_values(top.get("baseline") or {}, f"{where}: baseline"))
        raw_events = top.get("events") or []
        if not isinstance(raw_events, list):
            raise ScenarioError(f"{where}: events: expected a list")
        events = [_event(item, f"{where}: events.{i}", gpus) for i, item in enumerate(raw_events)]
        unavailable = top.get("unavailable")
        return cls(
            gpus=gpus, baseline=baseline, events=tuple(sorted(events, key=lambda e: e.at)),
            memory_total=_size(top.get("memory_total", 80 * 2**30), f"{where}: memory_total"),
            gpu_name=str(top.get("name", "Scripted GPU")),
            uuid_prefix=str(top.get("uuid_prefix", "")),
            unavailable=None if unavailable is None else str(unavailable),
        )


class ScriptedSource:
    """Plays a ``Scenario`` against a clock that starts when the source is created."""

    name = "scripted"

    def __init__(self, scenario: Scenario, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.scenario = scenario
        self.available = scenario.unavailable is None
        self.reason = None if self.available else f"scripted: {scenario.unavailable}"
        self._clock = clock
        self._started = clock()
        self._wall_started = wall_clock()
        self._xids = [e for e in scenario.events if e.xid is not None]
        self._xids_delivered = 0
        self._closed = threading.Event()
        # Distinct per machine so that two demo agents on two hosts never share GPU UUIDs.
        self._uuid_prefix = scenario.uuid_prefix or f"GPU-scripted-{socket.gethostname()}"

    def elapsed(self) -> float:
        return self._clock() - self._started

    def gpus(self) -> list[GpuInfo]:
        if not self.available:
            return []
        return [GpuInfo(index=i, uuid=f"{self._uuid_prefix}-{i}", name=self.scenario.gpu_name,
                        memory_total=self.scenario.memory_total) for i in range(self.scenario.gpus)]

    def sample(self) -> list[GpuReading]:
        if not self.available:
            return []
        elapsed = self.elapsed()
        states = [dict(self.scenario.baseline) for _ in range(self.scenario.gpus)]
        for event in self.scenario.events:
            if event.at > elapsed:
                break
            for gpu in _targets(event, self.scenario.gpus):
                states[gpu].update(event.values)
        readings = []
        for gpu, state in enumerate(states):
            if "memory_free" not in state and state.get("memory_used") is not None:
                state["memory_free"] = max(0, self.scenario.memory_total - state["memory_used"])
            readings.append(GpuReading(gpu=gpu, **state))
        return readings

    def xid_events(self, timeout: float) -> list[XidEvent]:
        if not self.available:
            return []
        deadline = self._clock() + max(0.0, timeout)
        while True:
            elapsed = self.elapsed()
            due = [e for e in self._xids[self._xids_delivered:] if e.at <= elapsed]
            if due or self._clock() >= deadline or self._closed.is_set():
                break
            upcoming = self._xids[self._xids_delivered:]
            wake_in = deadline - self._clock()
            if upcoming:
                wake_in = min(wake_in, upcoming[0].at - elapsed)
            self._closed.wait(max(0.0, wake_in))
        self._xids_delivered += len(due)
        return [XidEvent(gpu=gpu, code=typing.cast(int, e.xid), time=self._wall_started + e.at)
                for e in due for gpu in _targets(e, self.scenario.gpus)]

    def close(self) -> None:
        self._closed.set()


def open_scripted(options: Mapping[str, Any]) -> ScriptedSource:
    scenario = options.get("scenario")
    if not scenario:
        raise ScenarioError("the scripted telemetry source needs a scenario file (option 'scenario')")
    return ScriptedSource(Scenario.load(scenario))


def _targets(event: ScenarioEvent, gpus: int) -> range | tuple[int]:
    return range(gpus) if event.gpu is None else (event.gpu,)


def _mapping(data: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r}; expected one of {sorted(allowed)}")
    return data


def _event(item: Any, where: str, gpus: int) -> ScenarioEvent:
    if not isinstance(item, dict) or "at" not in item:
        raise ScenarioError(f"{where}: expected a mapping with 'at'")
    gpu = item.get("gpu")
    if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < gpus):
        raise ScenarioError(f"{where}: gpu: expected an index 0..{gpus - 1}, got {gpu!r}")
    xid = item.get("xid")
    if xid is not None and (not isinstance(xid, int) or isinstance(xid, bool) or xid < 0):
        raise ScenarioError(f"{where}: xid: expected a non-negative integer, got {xid!r}")
    values = _values({k: v for k, v in item.items() if k not in ("at", "gpu", "xid")}, where)
    if not values and xid is None:
        raise ScenarioError(f"{where}: an event must change a value or raise an xid")
    return ScenarioEvent(at=_duration(item["at"], f"{where}: at"), gpu=gpu, values=values, xid=xid)


def _values(raw: Any, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _mapping(raw, where, set(_FIELD_TYPES) | set(ALIASES)).items():
        name = ALIASES.get(key, key)
        out[name] = _coerce(name, value, f"{where}.{key}")
    return out


def _coerce(name: str, value: Any, where: str) -> Any:
    tp = _FIELD_TYPES[name]
    if value is None:
        return None
    if tp is bool or bool in typing.get_args(tp):
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: expected true or false, got {value!r}")
        return value
    if name.startswith("memory_"):
        return _size(value, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"{where}: expected a number, got {value!r}")
    if value < 0 and name != "temperature_c":  # only a temperature can go below zero
        raise ScenarioError(f"{where}: must not be negative, got {value!r}")
    return float(value) if float in typing.get_args(tp) else int(value)


def _size(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ScenarioError(f"{where}: expected a size such as 80GiB or a byte count, got {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _duration(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ScenarioError(f"{where}: expected a duration such as 30s, 2m or 500ms, got {value!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
