"""GPU telemetry from NVML (nvidia-ml-py): the default source wherever NVML initialises.

Every NVML call is guarded on its own: a counter that this GPU or driver does not support is
reported as ``None`` (and logged once), never allowed to lose the rest of the sample. A GPU
that NVML reports as lost is sampled as ``reachable=False``.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict

from agents.protocol.agent import GpuInfo
from agents.telemetry.base import GpuReading, XidEvent

log = logging.getLogger(__name__)


class _GpuLost(Exception):
    pass


_NvlinkCounter = Literal["nvlink_replay_errors", "nvlink_recovery_errors", "nvlink_crc_flit_errors",
                         "nvlink_crc_data_errors"]


class _NvlinkErrors(TypedDict):
    """``GpuReading``'s NVLink counters, each summed over the GPU's active links (None: none readable)."""

    nvlink_replay_errors: int | None
    nvlink_recovery_errors: int | None
    nvlink_crc_flit_errors: int | None
    nvlink_crc_data_errors: int | None


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml: Any = None):
        """``nvml`` is the ``pynvml`` module (injectable so the guards can be tested without a GPU)."""
        self.available = False
        self.reason: str | None = None
        self._handles: list[Any] = []
        self._info: list[GpuInfo] = []
        self._event_set: Any = None
        self._links: dict[int, list[int]] = {}
        self._unsupported: set[tuple[int, str]] = set()
        try:
            self._nvml = nvml if nvml is not None else importlib.import_module("pynvml")
        except ImportError as exc:
            self.reason = f"nvidia-ml-py is not installed ({exc})"
            return
        n = self._nvml
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            self.reason = f"NVML did not initialise: {exc}"
            return
        try:
            self._handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
        except n.NVMLError as exc:
            self.reason = f"NVML initialised but could not list GPUs: {exc}"
            self._shutdown()
            return
        if not self._handles:
            self.reason = "NVML initialised but found no GPU"
            self._shutdown()
            return
        self.available = True
        self._info = [self._describe(i, h) for i, h in enumerate(self._handles)]
        self._register_xid_events()

    # --- TelemetrySource -----------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        return list(self._info)

    def sample(self) -> list[GpuReading]:
        return [self._read_gpu(i, h) for i, h in enumerate(self._handles)]

    def xid_events(self, timeout: float) -> list[XidEvent]:
        if self._event_set is None:
            return []
        n = self._nvml
        events: list[XidEvent] = []
        wait_ms = max(0, int(timeout * 1000))
        while True:
            try:
                data = n.nvmlEventSetWait(self._event_set, wait_ms)
            except n.NVMLError as exc:
                if exc.value != n.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed: %s", exc)
                break
            if data.eventType & n.nvmlEventTypeXidCriticalError:
                gpu = self._index_of(data.device)
                if gpu is not None:
                    events.append(XidEvent(gpu=gpu, code=int(data.eventData), time=time.time()))
            wait_ms = 0  # drain whatever else is already queued, without waiting again
        return events

    def close(self) -> None:
        if self._event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            except self._nvml.NVMLError as exc:
                log.debug("NVML event set free failed: %s", exc)
            self._event_set = None
        if self.available:
            self._shutdown()
            self.available = False
            self.reason = "closed"

    # --- reading -------------------------------------------------------------------------------

    def _read(self, gpu: int, counter: str, fn: Callable[..., Any], *args: Any) -> Any:
        n = self._nvml
        try:
            return fn(*args)
        except n.NVMLError as exc:
            if exc.value == n.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from exc
            if (gpu, counter) not in self._unsupported:
                self._unsupported.add((gpu, counter))
                log.info("GPU %d: %s is not available (%s); reported as unsupported", gpu, counter, exc)
            return None

    def _read_gpu(self, gpu: int, h: Any) -> GpuReading:
        n = self._nvml
        try:
            def read(counter: str, fn: Callable[..., Any], *args: Any) -> Any:
                return self._read(gpu, counter, fn, h, *args)

            memory = read("memory", n.nvmlDeviceGetMemoryInfo)
            utilization = read("utilization", n.nvmlDeviceGetUtilizationRates)
            power_mw = read("power", n.nvmlDeviceGetPowerUsage)
            rows = read("remapped rows", n.nvmlDeviceGetRemappedRows)
            pages = [read(f"retired pages ({cause})", n.nvmlDeviceGetRetiredPages, cause) for cause in
                     (n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                      n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
            pending = read("retired pages pending", n.nvmlDeviceGetRetiredPagesPendingStatus)
            # Renamed in newer drivers ("clocks event reasons"); same bitmask.
            reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                n.nvmlDeviceGetCurrentClocksThrottleReasons

            def ecc(error_type: int, counter_type: int) -> int | None:
                return read("ECC counters", n.nvmlDeviceGetTotalEccErrors, error_type, counter_type)

            return GpuReading(
                gpu=gpu,
                temperature_c=_float(read("temperature", n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)),
                memory_used=None if memory is None else int(memory.used),
                memory_free=None if memory is None else int(memory.free),
                utilization_pct=None if utilization is None else float(utilization.gpu),
                power_w=None if power_mw is None else power_mw / 1000.0,
                sm_clock_mhz=read("SM clock", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM),
                throttle_reasons=read("throttle reasons", reasons),
                ecc_corrected_volatile=ecc(n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
                ecc_uncorrected_volatile=ecc(n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
                ecc_corrected_aggregate=ecc(n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_AGGREGATE_ECC),
                ecc_uncorrected_aggregate=ecc(n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC),
                retired_pages=None if all(p is None for p in pages) else sum(len(p or ()) for p in pages),
                retired_pages_pending=None if pending is None else pending == n.NVML_FEATURE_ENABLED,
                remapped_rows_correctable=None if rows is None else int(rows[0]),
                remapped_rows_uncorrectable=None if rows is None else int(rows[1]),
                remap_pending=None if rows is None else bool(rows[2]),
                remap_failed=None if rows is None else bool(rows[3]),
                pcie_replays=read("PCIe replay counter", n.nvmlDeviceGetPcieReplayCounter),
                **self._nvlink_errors(gpu, h),
            )
        except _GpuLost:
            log.error("GPU %d: NVML reports the GPU as lost", gpu)
            return GpuReading(gpu=gpu, reachable=False)

    def _nvlink_errors(self, gpu: int, h: Any) -> _NvlinkErrors:
        n = self._nvml
        counters: dict[_NvlinkCounter, int] = {
            "nvlink_replay_errors": n.NVML_NVLINK_ERROR_DL_REPLAY,
            "nvlink_recovery_errors": n.NVML_NVLINK_ERROR_DL_RECOVERY,
            "nvlink_crc_flit_errors": n.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            "nvlink_crc_data_errors": n.NVML_NVLINK_ERROR_DL_CRC_DATA,
        }
        if gpu not in self._links:
            # Probing all 36 possible links is slow and noisy: find the active ones once.
            self._links[gpu] = []
            for link in range(n.NVML_NVLINK_MAX_LINKS):
                try:
                    if n.nvmlDeviceGetNvLinkState(h, link) == n.NVML_FEATURE_ENABLED:
                        self._links[gpu].append(link)
                except n.NVMLError:
                    continue
        totals = _NvlinkErrors(nvlink_replay_errors=None, nvlink_recovery_errors=None,
                               nvlink_crc_flit_errors=None, nvlink_crc_data_errors=None)
        links = self._links[gpu]
        if not links:
            return totals
        for name, counter in counters.items():
            values = [self._read(gpu, f"NVLink {name}", n.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                      for link in links]
            totals[name] = None if all(v is None for v in values) else sum(int(v or 0) for v in values)
        return totals

    def _describe(self, index: int, h: Any) -> GpuInfo:
        n = self._nvml
        uuid = self._read(index, "UUID", n.nvmlDeviceGetUUID, h) or f"GPU-unknown-{index}"
        name = self._read(index, "name", n.nvmlDeviceGetName, h) or "unknown"
        memory = self._read(index, "memory", n.nvmlDeviceGetMemoryInfo, h)
        return GpuInfo(index=index, uuid=_text(uuid)[:96], name=_text(name)[:128],
                       memory_total=0 if memory is None else int(memory.total))

    def _register_xid_events(self) -> None:
        n = self._nvml
        try:
            self._event_set = n.nvmlEventSetCreate()
        except n.NVMLError as exc:
            log.warning("NVML events unavailable, Xid errors will not be seen: %s", exc)
            return
        for index, h in enumerate(self._handles):
            try:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, self._event_set)
            except n.NVMLError as exc:
                log.warning("GPU %d: cannot subscribe to Xid events: %s", index, exc)

    def _index_of(self, device: Any) -> int | None:
        n = self._nvml
        try:
            return int(n.nvmlDeviceGetIndex(device))
        except n.NVMLError as exc:
            if len(self._handles) == 1:
                return 0
            log.error("Xid event from a GPU whose index NVML cannot tell (%s); dropped", exc)
            return None

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("NVML shutdown failed: %s", exc)


def open_nvml(options: Mapping[str, Any]) -> NvmlSource:
    return NvmlSource()


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
