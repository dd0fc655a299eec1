"""Node health checks, before a launch and on demand, and the pairwise bandwidth probe.

``evaluate`` is pure: it judges GPU samples against ``HealthThresholds`` (defaults from the
reference: above 85 °C, any uncorrected ECC error, a critical Xid, any NVLink error or too little
free memory at idle is bad) and returns a ``HealthReport`` listing every check, passed or not,
so an operator sees the evidence and not only the verdict. It judges the *windowed* counters,
so an error long ago does not fail a node forever.

The bandwidth probe is a plain TCP transfer between agents: each agent runs a
``BandwidthProbeServer``; ``probe_bandwidth`` sends it up to N bytes for at most T seconds and
divides what the server acknowledges by the time taken. A pair below ``min_bandwidth_ratio`` of
the expected bandwidth is flagged.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agents.protocol.agent import BandwidthResult, GpuSample, HealthCheck, HealthReport, ProbePeer

log = logging.getLogger(__name__)

#: Xids that mean the hardware (not the program) is at fault: 48 double-bit ECC, 61/62 internal
#: micro-controller errors, 63/64 row remapping (pending/failed), 74 NVLink, 79 fallen off the
#: bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC.
CRITICAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


@dataclass(frozen=True)
class HealthThresholds:
    max_temperature_c: float = 85.0
    #: Uncorrected ECC errors allowed within the window (the reference: any is bad).
    max_uncorrected_ecc: int = 0
    critical_xids: frozenset[int] = CRITICAL_XIDS
    #: NVLink error counter growth allowed within the window.
    max_nvlink_errors: int = 0
    #: Free memory a GPU must have when no job of ours runs on it.
    min_free_memory_bytes: int = 10 * 2**30
    min_bandwidth_ratio: float = 0.8

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> HealthThresholds:
        """Overrides from the agent config; unknown names and wrong types are refused."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                raise ValueError(f"health: unknown threshold {name!r}; expected one of {sorted(known)}")
            if name == "critical_xids":
                if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                    raise ValueError("health: critical_xids must be a list of integers")
                value = frozenset(value)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"health: {name} must be a non-negative number, got {value!r}")
            values[name] = value
        return cls(**values)


DEFAULT_THRESHOLDS = HealthThresholds()


def evaluate(samples: list[GpuSample], thresholds: HealthThresholds = DEFAULT_THRESHOLDS, *,
             expected_gpus: int, idle: bool, require_gpu: bool = True,
             telemetry_reason: str | None = None) -> HealthReport:
    """Judge a node from one fresh sample per GPU. ``idle``: no job of ours runs on the node."""
    checks: list[HealthCheck] = []
    if telemetry_reason is not None:
        ok = not require_gpu
        detail = f"no GPU telemetry ({telemetry_reason})" + ("; the job runs without GPUs" if ok else "")
        checks.append(HealthCheck(name="gpu_reachable", ok=ok, detail=detail))
        return _report(checks)
    if len(samples) < expected_gpus:
        checks.append(HealthCheck(name="gpu_reachable", ok=False, value=len(samples), limit=expected_gpus,
                                  detail=f"only {len(samples)} of {expected_gpus} GPUs visible"))
    for s in samples:
        checks.extend(_gpu_checks(s, thresholds, idle))
    return _report(checks)


def _gpu_checks(s: GpuSample, t: HealthThresholds, idle: bool) -> list[HealthCheck]:
    gpu = s.gpu
    if not s.reachable:
        return [HealthCheck(name="gpu_reachable", gpu=gpu, ok=False, detail=f"GPU {gpu} is not reachable")]
    checks = [HealthCheck(name="gpu_reachable", gpu=gpu, ok=True, detail=f"GPU {gpu} reachable")]

    def limit_check(name: str, value: float | None, limit: float, what: str, unit: str = "") -> None:
        if value is None:
            checks.append(HealthCheck(name=name, gpu=gpu, ok=True, detail=f"GPU {gpu}: {what} not reported"))
        else:
            ok = value <= limit
            checks.append(HealthCheck(name=name, gpu=gpu, ok=ok, value=value, limit=limit,
                                      detail=f"GPU {gpu}: {what} {value:g}{unit}"
                                      + ("" if ok else f" above the limit {limit:g}{unit}")))

    limit_check("temperature", s.temperature_c, t.max_temperature_c, "temperature", " °C")
    limit_check("ecc", s.ecc_uncorrected_recent, t.max_uncorrected_ecc,
                f"uncorrected ECC errors in the last {s.window_s:g} s")
    limit_check("nvlink", s.nvlink_errors_recent, t.max_nvlink_errors,
                f"NVLink errors in the last {s.window_s:g} s")

    critical = [code for code in s.recent_xid_codes if code in t.critical_xids]
    checks.append(HealthCheck(
        name="xid", gpu=gpu, ok=not critical, value=float(s.xid_recent),
        detail=(f"GPU {gpu}: critical Xid {', '.join(map(str, critical))} in the last {s.window_s:g} s"
                if critical else f"GPU {gpu}: {s.xid_recent} non-critical Xid(s) in the last {s.window_s:g} s")))

    if s.remap_failed or s.remap_pending or s.retired_pages_pending:
        why = "row remapping failed" if s.remap_failed else "a reset is pending to retire memory"
        checks.append(HealthCheck(name="row_remap", gpu=gpu, ok=False, detail=f"GPU {gpu}: {why}"))

    if idle and s.memory_free is not None:
        # A small card cannot have 10 GiB free; ask it for 90% of its memory instead.
        total = s.memory_free + (s.memory_used or 0)
        need = min(t.min_free_memory_bytes, int(0.9 * total))
        ok = s.memory_free >= need
        checks.append(HealthCheck(
            name="memory_free", gpu=gpu, ok=ok, value=float(s.memory_free), limit=float(need),
            detail=f"GPU {gpu}: {s.memory_free / 2**30:.1f} GiB free at idle"
                   + ("" if ok else f", below {need / 2**30:.1f} GiB: another process holds it")))
    return checks


def _report(checks: list[HealthCheck], bandwidth: Iterable[BandwidthResult] = ()) -> HealthReport:
    bandwidth = list(bandwidth)
    failed = [c.detail for c in checks if not c.ok]
    failed += [f"bandwidth to {b.peer}: {b.error or f'{b.mbps:.0f} MB/s of {b.expected_mbps:.0f} expected'}"
               for b in bandwidth if not b.ok]
    return HealthReport(ok=not failed, reason="; ".join(failed), checks=checks, bandwidth=bandwidth)


def with_bandwidth(report: HealthReport, results: Iterable[BandwidthResult]) -> HealthReport:
    """``report`` with the bandwidth results added (and the verdict and reason updated)."""
    return _report(list(report.checks), [*report.bandwidth, *results])


# --- bandwidth probe -------------------------------------------------------------------------

_MAGIC = b"NWP1"
_HEADER = struct.Struct("!4sQ")  # magic, bytes the client intends to send
_ACK = struct.Struct("!Q")  # bytes the server received
_CHUNK = 1 << 20


class _ProbeTCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # an agent restarted right away must get its port back
    daemon_threads = True


class BandwidthProbeServer:
    """Accepts probe transfers from peers, a few at a time, each bounded in size and idle time."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, max_bytes: int = 2**32,
                 idle_timeout_s: float = 10.0, max_clients: int = 4):
        slots = threading.BoundedSemaphore(max_clients)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if not slots.acquire(blocking=False):
                    return  # busy: closing at once tells the client to retry later
                try:
                    _receive_probe(self.request, max_bytes, idle_timeout_s)
                except OSError as exc:
                    log.debug("bandwidth probe from %s ended: %s", self.client_address, exc)
                finally:
                    slots.release()

        self._server = _ProbeTCPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="bandwidth-probe",
                                        kwargs={"poll_interval": 0.2}, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> BandwidthProbeServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def _receive_probe(conn: socket.socket, max_bytes: int, idle_timeout_s: float) -> None:
    conn.settimeout(idle_timeout_s)
    header = _recv_exactly(conn, _HEADER.size)
    magic, announced = _HEADER.unpack(header)
    if magic != _MAGIC:
        return
    remaining = min(announced, max_bytes)
    received = 0
    while remaining > 0:
        data = conn.recv(min(_CHUNK, remaining))
        if not data:  # the client stopped early (its time ran out): count what came
            break
        received += len(data)
        remaining -= len(data)
    conn.sendall(_ACK.pack(received))


def probe_bandwidth(address: str, port: int, *, nbytes: int, max_seconds: float,
                    connect_timeout: float = 3.0) -> float:
    """Send up to ``nbytes`` to a probe server for at most ``max_seconds``; MB/s (10^6 bytes)."""
    payload = memoryview(bytes(_CHUNK))
    with socket.create_connection((address, port), timeout=connect_timeout) as sock:
        sock.sendall(_HEADER.pack(_MAGIC, nbytes))
        started = time.monotonic()
        deadline = started + max_seconds
        sent = 0
        while sent < nbytes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                sent += sock.send(payload[: min(_CHUNK, nbytes - sent)])
            except TimeoutError:
                break
        sock.shutdown(socket.SHUT_WR)
        # The server answers once it has read everything we sent; that time is the transfer time.
        sock.settimeout(max_seconds + connect_timeout)
        (received,) = _ACK.unpack(_recv_exactly(sock, _ACK.size))
        elapsed = time.monotonic() - started
    return received / max(elapsed, 1e-9) / 1e6


def probe_peers(peers: Iterable[ProbePeer], *, nbytes: int, max_seconds: float,
                thresholds: HealthThresholds = DEFAULT_THRESHOLDS) -> list[BandwidthResult]:
    """Probe each peer in turn (concurrent probes would measure each other, not the links)."""
    results = []
    for peer in peers:
        try:
            mbps = probe_bandwidth(peer.address, peer.port, nbytes=nbytes, max_seconds=max_seconds)
        except (OSError, ConnectionError, struct.error) as exc:
            results.append(BandwidthResult(peer=peer.node, address=peer.address, ok=False,
                                           expected_mbps=peer.expected_mbps, error=f"probe failed: {exc}"))
            continue
        ok = mbps >= thresholds.min_bandwidth_ratio * peer.expected_mbps
        results.append(BandwidthResult(peer=peer.node, address=peer.address, ok=ok, mbps=mbps,
                                       expected_mbps=peer.expected_mbps))
    return results


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        data = sock.recv(size - len(buf))
        if not data:
            raise ConnectionError(f"connection closed after {len(buf)} of {size} bytes")
        buf += data
    return bytes(buf)
