"""GPU telemetry: one small interface (``TelemetrySource``), its variants registered in
``SOURCES``, and the collector that adds windowed rates and produces wire samples."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agents.telemetry.base import GpuReading, TelemetrySource, XidEvent
from agents.telemetry.collector import TelemetryCollector
from agents.telemetry.nvml import NvmlSource, open_nvml
from agents.telemetry.scripted import Scenario, ScenarioError, ScriptedSource, open_scripted

#: name -> factory taking the source's options (from the agent config).
SOURCES: dict[str, Callable[[Mapping[str, Any]], TelemetrySource]] = {
    "nvml": open_nvml,
    "scripted": open_scripted,
}
DEFAULT_SOURCE = "nvml"


def open_source(name: str, options: Mapping[str, Any] | None = None) -> TelemetrySource:
    try:
        factory = SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown telemetry source {name!r}; expected one of {sorted(SOURCES)}") from None
    return factory(options or {})


__all__ = ["DEFAULT_SOURCE", "SOURCES", "GpuReading", "NvmlSource", "Scenario", "ScenarioError",
           "ScriptedSource", "TelemetryCollector", "TelemetrySource", "XidEvent", "open_source"]
