"""Turns a source's raw readings into wire ``GpuSample``s with windowed rates and Xid history.

The same for every source, so the scripted source exercises exactly the code the NVML source
relies on in production.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from agents.protocol.agent import GpuSample
from agents.telemetry.base import GpuReading, TelemetrySource, XidEvent
from agents.telemetry.rates import CounterWindow, EventWindow

DEFAULT_WINDOW_S = 600.0

_NVLINK_FIELDS = ("nvlink_replay_errors", "nvlink_recovery_errors", "nvlink_crc_flit_errors",
                  "nvlink_crc_data_errors")


class _GpuHistory:
    def __init__(self, window_s: float):
        self.xids = EventWindow(window_s)
        self.ecc_corrected = CounterWindow(window_s)
        self.ecc_uncorrected = CounterWindow(window_s)
        self.nvlink = CounterWindow(window_s)


class TelemetryCollector:
    """Samples a source and keeps per-GPU history; the agent loop and a command's health check
    may both sample, hence the lock."""

    def __init__(self, source: TelemetrySource, *, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.time):
        self.source = source
        self.window_s = window_s
        self._clock = clock
        self._history: dict[int, _GpuHistory] = {}
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self.source.available

    @property
    def reason(self) -> str | None:
        return self.source.reason

    def poll_xids(self, timeout: float = 0.0) -> list[XidEvent]:
        """New Xid events; they are also counted into the next samples' windows."""
        if not self.source.available:
            return []
        events = self.source.xid_events(timeout)
        with self._lock:
            for event in events:
                self._gpu(event.gpu).xids.add(event.time, event.code)
        return events

    def sample(self, node: str) -> list[GpuSample]:
        if not self.source.available:
            return []
        with self._lock:
            now = self._clock()
            return [self._to_sample(node, now, reading) for reading in self.source.sample()]

    def _gpu(self, index: int) -> _GpuHistory:
        if index not in self._history:
            self._history[index] = _GpuHistory(self.window_s)
        return self._history[index]

    def _to_sample(self, node: str, now: float, reading: GpuReading) -> GpuSample:
        history = self._gpu(reading.gpu)
        # Volatile counters are the ones that move with new errors; aggregate ones only add
        # history from earlier boots, which is exactly what the window must not count.
        history.ecc_corrected.observe(now, reading.ecc_corrected_volatile)
        history.ecc_uncorrected.observe(now, reading.ecc_uncorrected_volatile)
        nvlink = [getattr(reading, name) for name in _NVLINK_FIELDS]
        if any(value is not None for value in nvlink):
            history.nvlink.observe(now, sum(value or 0 for value in nvlink))
        raw = dataclasses.asdict(reading)
        del raw["gpu"]
        return GpuSample(
            node=node,
            gpu=reading.gpu,
            time=now,
            ecc_corrected_recent=history.ecc_corrected.increase(now),
            ecc_uncorrected_recent=history.ecc_uncorrected.increase(now),
            nvlink_errors_recent=history.nvlink.increase(now),
            xid_total=history.xids.total,
            xid_recent=history.xids.recent(now),
            recent_xid_codes=history.xids.recent_codes(now)[-16:],
            window_s=self.window_s,
            **raw,
        )
