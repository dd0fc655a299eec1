"""Telemetry sources: the scripted scenario player, the NVML guards, the registry, the collector."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from agents.telemetry import (
    SOURCES,
    NvmlSource,
    Scenario,
    ScenarioError,
    ScriptedSource,
    TelemetryCollector,
    TelemetrySource,
    open_source,
)


class Clock:
    """A clock the test moves by hand: scenario times are checked without sleeping."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


SCENARIO = """
gpus: 2
memory_total: 80GiB
baseline: {temperature: 45, utilization: 90, memory_used: 8GiB}
events:
  - {at: 30s, gpu: 1, temperature: 92}
  - {at: 1m, gpu: 0, xid: 79}
  - {at: 90s, ecc_uncorrected_volatile: 2}
  - {at: 2m, gpu: 1, reachable: false}
"""


def scripted(text: str = SCENARIO, wall: Clock | None = None) -> tuple[ScriptedSource, Clock]:
    clock = Clock()
    source = ScriptedSource(Scenario.from_dict(yaml.safe_load(text)), clock=clock, wall_clock=wall or Clock(5000.0))
    return source, clock


def test_scenario_values_change_at_their_time_and_stay_changed() -> None:
    source, clock = scripted()
    first = source.sample()
    assert [r.temperature_c for r in first] == [45.0, 45.0]
    assert first[0].memory_used == 8 * 2**30 and first[0].memory_free == 72 * 2**30
    assert first[0].utilization_pct == 90.0 and first[0].ecc_uncorrected_volatile == 0

    clock.now += 30
    assert [r.temperature_c for r in source.sample()] == [45.0, 92.0]
    clock.now += 60  # 90 s: the ECC event has no gpu, so it hits both
    assert [r.ecc_uncorrected_volatile for r in source.sample()] == [2, 2]
    assert [r.temperature_c for r in source.sample()] == [45.0, 92.0]
    clock.now += 30
    assert [r.reachable for r in source.sample()] == [True, False]


def test_xid_events_are_delivered_once_at_their_time() -> None:
    source, clock = scripted()
    assert source.xid_events(0) == []
    clock.now += 59.9
    assert source.xid_events(0) == []
    clock.now += 0.2
    [event] = source.xid_events(0)
    assert (event.gpu, event.code, event.time) == (0, 79, 5060.0)
    assert source.xid_events(0) == []


def test_xid_wait_returns_as_soon_as_an_event_is_due() -> None:
    source = ScriptedSource(Scenario.from_dict({"gpus": 1, "events": [{"at": "300ms", "xid": 48}]}))
    events = source.xid_events(timeout=5.0)  # real clock: must return after ~0.3 s, not 5 s
    assert [(e.gpu, e.code) for e in events] == [(0, 48)]
    assert source.elapsed() < 2.0


def test_json_scenarios_load_too(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"gpus": 1, "events": [{"at": 0, "gpu": 0, "temperature": 70}]}))
    [reading] = ScriptedSource(Scenario.load(path)).sample()
    assert reading.temperature_c == 70.0


def test_gpus_are_described_with_distinct_uuids() -> None:
    source, _ = scripted()
    gpus = source.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert len({g.uuid for g in gpus}) == 2 and gpus[0].memory_total == 80 * 2**30


@pytest.mark.parametrize(("data", "message"), [
    ({"gpus": 0}, "gpus: expected an integer 1..64"),
    ({"gpus": 1, "colour": "red"}, "unknown key 'colour'"),
    ({"gpus": 1, "baseline": {"temprature": 40}}, "baseline: unknown key 'temprature'"),
    ({"gpus": 2, "events": [{"at": "10s", "gpu": 2, "temperature": 90}]}, "events.0: gpu: expected an index 0..1"),
    ({"gpus": 1, "events": [{"at": "soon", "temperature": 90}]}, "events.0: at: expected a duration"),
    ({"gpus": 1, "events": [{"at": 5}]}, "events.0: an event must change a value or raise an xid"),
    ({"gpus": 1, "events": [{"temperature": 90}]}, "events.0: expected a mapping with 'at'"),
    ({"gpus": 1, "events": [{"at": 1, "reachable": "no"}]}, "reachable: expected true or false"),
    ({"gpus": 1, "baseline": {"memory_used": "lots"}}, "memory_used: expected a size"),
    ({"gpus": 1, "baseline": {"power": -5}}, "power: must not be negative"),
])
def test_scenario_mistakes_are_reported_where_they_are(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(data, where="s.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("s.yaml")


def test_a_scenario_can_stand_for_a_node_without_gpu_telemetry() -> None:
    source = ScriptedSource(Scenario.from_dict({"unavailable": "driver not loaded"}))
    assert not source.available and "driver not loaded" in (source.reason or "")
    assert source.gpus() == [] and source.sample() == [] and source.xid_events(0) == []


# --- the collector adds windows and history ------------------------------------------------------

def test_collector_reports_windowed_rates_and_recent_xids() -> None:
    wall = Clock(5000.0)
    source, clock = scripted(wall=wall)
    collector = TelemetryCollector(source, window_s=60, clock=wall)
    assert [s.ecc_uncorrected_recent for s in collector.sample("n1")] == [0, 0]

    clock.now += 90  # the Xid (at 60 s) and the ECC errors (at 90 s) are both due
    wall.now += 90
    [xid] = collector.poll_xids()
    assert (xid.code, xid.time) == (79, 5060.0)
    samples = collector.sample("n1")
    assert samples[0].node == "n1" and samples[0].window_s == 60
    assert samples[0].ecc_uncorrected_recent == 2 and samples[0].ecc_uncorrected_volatile == 2
    assert (samples[0].xid_total, samples[0].xid_recent, samples[0].recent_xid_codes) == (1, 1, [79])
    assert (samples[1].xid_total, samples[1].xid_recent) == (0, 0)

    clock.now += 61
    wall.now += 61
    later = collector.sample("n1")[0]
    # Both errors left the window: the totals remember them, the health rules will not.
    assert (later.ecc_uncorrected_recent, later.xid_recent, later.recent_xid_codes) == (0, 0, [])
    assert (later.ecc_uncorrected_volatile, later.xid_total) == (2, 1)


def test_registry_names_every_source_and_refuses_others(tmp_path: Path) -> None:
    assert set(SOURCES) == {"nvml", "scripted"}
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    assert isinstance(open_source("scripted", {"scenario": path}), TelemetrySource)
    with pytest.raises(ValueError, match="unknown telemetry source 'dcgm'"):
        open_source("dcgm")
    with pytest.raises(ScenarioError, match="needs a scenario file"):
        open_source("scripted", {})


def test_nvml_without_a_gpu_says_so_instead_of_pretending() -> None:
    source = NvmlSource()  # this machine has no NVIDIA driver
    assert not source.available
    assert "NVML" in (source.reason or "")
    assert source.gpus() == [] and source.sample() == [] and source.xid_events(0) == []
    assert TelemetryCollector(source).sample("n1") == []


# --- NVML guards, against a stand-in for the library (there is no GPU here) ------------------------

class FakeNvml(types.SimpleNamespace):
    """pynvml's constants and error classes, with two GPUs whose calls the test can break."""

    def __init__(self, broken: dict[str, int] | None = None, lost: bool = False):
        super().__init__(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "nvmlEventType"))})
        self.NVMLError = pynvml.NVMLError
        self.broken = broken or {}
        self.lost = lost
        self.xid_queue: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    def _call(self, name: str, value: Any) -> Any:
        if name in self.broken:
            raise pynvml.NVMLError(self.broken[name])
        return value

    def nvmlInit(self) -> None: ...  # noqa: N802 - NVML's names
    def nvmlShutdown(self) -> None: ...  # noqa: N802
    def nvmlDeviceGetCount(self) -> int: return 2  # noqa: N802
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i  # noqa: N802
    def nvmlDeviceGetIndex(self, h: int) -> int: return h  # noqa: N802
    def nvmlDeviceGetUUID(self, h: int) -> str: return f"GPU-{h}"  # noqa: N802
    def nvmlDeviceGetName(self, h: int) -> bytes: return b"NVIDIA H100"  # noqa: N802

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        if self.lost and h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._call("temperature", 60 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        return types.SimpleNamespace(total=80 * 2**30, used=2**30, free=79 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        return types.SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int: return 350_000  # noqa: N802
    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int: return 1980  # noqa: N802
    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int: return 0x40  # noqa: N802

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:  # noqa: N802
        return self._call("ecc", 3 if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0)

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:  # noqa: N802
        return self._call("rows", (1, 0, 0, 0))

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:  # noqa: N802
        return self._call("pages", [])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:  # noqa: N802
        return self._call("pages", 0)

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int: return self._call("pcie", 7)  # noqa: N802

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:  # noqa: N802
        if link >= 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:  # noqa: N802
        return self._call("nvlink", 5 if counter == pynvml.NVML_NVLINK_ERROR_DL_REPLAY else 0)

    def nvmlEventSetCreate(self) -> str: return "events"  # noqa: N802
    def nvmlDeviceRegisterEvents(self, h: int, types_: int, event_set: str) -> None: ...  # noqa: N802
    def nvmlEventSetFree(self, event_set: str) -> None: ...  # noqa: N802

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:  # noqa: N802
        if not self.xid_queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.xid_queue.pop(0)


def test_nvml_reads_every_counter() -> None:
    source = NvmlSource(nvml=FakeNvml())
    assert source.available and [g.name for g in source.gpus()] == ["NVIDIA H100"] * 2
    reading = source.sample()[1]
    assert reading.temperature_c == 61.0 and reading.power_w == 350.0 and reading.sm_clock_mhz == 1980
    assert reading.throttle_reasons == 0x40 and reading.utilization_pct == 97.0
    assert reading.ecc_corrected_volatile == 3 and reading.ecc_uncorrected_aggregate == 0
    assert reading.remapped_rows_correctable == 1 and reading.remap_failed is False
    assert reading.nvlink_replay_errors == 10  # 5 on each of the two active links
    assert reading.pcie_replays == 7 and reading.retired_pages == 0


def test_one_unsupported_counter_does_not_lose_the_sample() -> None:
    source = NvmlSource(nvml=FakeNvml(broken={"ecc": pynvml.NVML_ERROR_NOT_SUPPORTED,
                                              "nvlink": pynvml.NVML_ERROR_NOT_SUPPORTED,
                                              "rows": pynvml.NVML_ERROR_NOT_SUPPORTED}))
    reading = source.sample()[0]
    assert reading.ecc_corrected_volatile is None and reading.nvlink_replay_errors is None
    assert reading.remapped_rows_correctable is None and reading.remap_pending is None
    assert reading.temperature_c == 60.0 and reading.pcie_replays == 7  # the rest is there


def test_a_lost_gpu_is_reported_unreachable_and_the_others_still_sampled() -> None:
    readings = NvmlSource(nvml=FakeNvml(lost=True)).sample()
    assert readings[0].reachable and readings[0].temperature_c == 60.0
    assert not readings[1].reachable and readings[1].temperature_c is None


def test_nvml_xid_events_are_drained_from_the_event_set() -> None:
    nvml = FakeNvml()
    source = NvmlSource(nvml=nvml)
    nvml.xid_queue = [types.SimpleNamespace(device=1, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79),
                      types.SimpleNamespace(device=0, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=48)]
    assert [(e.gpu, e.code) for e in source.xid_events(0.5)] == [(1, 79), (0, 48)]
    assert source.xid_events(0) == []
