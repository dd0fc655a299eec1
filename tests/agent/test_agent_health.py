"""Health rules (pure) and the pairwise bandwidth probe between two real probe servers."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agents.health import (
    DEFAULT_THRESHOLDS,
    BandwidthProbeServer,
    HealthThresholds,
    evaluate,
    probe_bandwidth,
    probe_peers,
    with_bandwidth,
)
from agents.protocol.agent import GpuSample, ProbePeer

GiB = 2**30


def gpu(index: int = 0, **values: Any) -> GpuSample:
    healthy: dict[str, Any] = dict(temperature_c=50.0, memory_used=GiB, memory_free=79 * GiB,
                                   ecc_uncorrected_recent=0, ecc_uncorrected_volatile=0, nvlink_errors_recent=0,
                                   remap_pending=False, remap_failed=False, retired_pages_pending=False)
    healthy.update(values)
    return GpuSample(node="n1", gpu=index, time=1.0, **healthy)


def failed(report: Any) -> list[tuple[str, int | None]]:
    return [(c.name, c.gpu) for c in report.checks if not c.ok]


def test_a_healthy_node_passes_every_check() -> None:
    report = evaluate([gpu(0), gpu(1)], expected_gpus=2, idle=True)
    assert report.ok and report.reason == ""
    assert {c.name for c in report.checks} == {"gpu_reachable", "temperature", "ecc", "nvlink", "xid", "memory_free"}


@pytest.mark.parametrize(("values", "check", "words"), [
    ({"temperature_c": 92.0}, "temperature", "temperature 92 °C above the limit 85 °C"),
    ({"ecc_uncorrected_recent": 1}, "ecc", "uncorrected ECC errors"),
    ({"nvlink_errors_recent": 3}, "nvlink", "NVLink errors"),
    ({"xid_recent": 1, "recent_xid_codes": [79]}, "xid", "critical Xid 79"),
    ({"remap_failed": True}, "row_remap", "row remapping failed"),
    ({"retired_pages_pending": True}, "row_remap", "a reset is pending"),
    ({"memory_used": 70 * GiB, "memory_free": 10 * GiB - 1}, "memory_free", "another process holds it"),
    ({"reachable": False}, "gpu_reachable", "GPU 1 is not reachable"),
])
def test_each_rule_fails_the_node_with_its_evidence(values: dict[str, Any], check: str, words: str) -> None:
    report = evaluate([gpu(0), gpu(1, **values)], expected_gpus=2, idle=True)
    assert not report.ok
    assert failed(report) == [(check, 1)]
    assert words in report.reason


def test_the_reference_boundaries() -> None:
    assert evaluate([gpu(temperature_c=85.0)], expected_gpus=1, idle=True).ok  # "above 85" is bad, 85 is not
    assert evaluate([gpu(memory_used=70 * GiB, memory_free=10 * GiB)], expected_gpus=1, idle=True).ok


def test_old_errors_do_not_fail_a_node_forever() -> None:
    # Lifetime counters show past trouble; the windowed ones are clean, so the node is fine.
    sample = gpu(ecc_uncorrected_volatile=4, ecc_uncorrected_aggregate=9, ecc_uncorrected_recent=0,
                 xid_total=3, xid_recent=0, recent_xid_codes=[])
    assert evaluate([sample], expected_gpus=1, idle=True).ok


def test_application_xids_are_not_hardware_faults() -> None:
    report = evaluate([gpu(xid_recent=2, recent_xid_codes=[13, 31])], expected_gpus=1, idle=True)
    assert report.ok
    assert "2 non-critical Xid(s)" in next(c.detail for c in report.checks if c.name == "xid")


def test_free_memory_is_only_judged_at_idle() -> None:
    busy = gpu(memory_used=78 * GiB, memory_free=2 * GiB)
    assert not evaluate([busy], expected_gpus=1, idle=True).ok
    assert evaluate([busy], expected_gpus=1, idle=False).ok


def test_a_small_card_needs_most_of_its_memory_free_not_ten_gib() -> None:
    small = gpu(memory_used=GiB // 2, memory_free=7 * GiB + GiB // 2)  # an 8 GiB card
    assert evaluate([small], expected_gpus=1, idle=True).ok


def test_missing_gpus_fail_the_node() -> None:
    report = evaluate([gpu(0)], expected_gpus=2, idle=True)
    assert failed(report) == [("gpu_reachable", None)] and "only 1 of 2 GPUs visible" in report.reason


def test_a_node_without_telemetry_only_runs_cpu_jobs() -> None:
    gpu_job = evaluate([], expected_gpus=0, idle=True, telemetry_reason="NVML did not initialise")
    assert not gpu_job.ok and "no GPU telemetry (NVML did not initialise)" in gpu_job.reason
    cpu_job = evaluate([], expected_gpus=0, idle=True, require_gpu=False, telemetry_reason="no driver")
    assert cpu_job.ok


def test_thresholds_are_configurable() -> None:
    relaxed = HealthThresholds.from_mapping({"max_temperature_c": 95, "critical_xids": [13]})
    assert evaluate([gpu(temperature_c=92.0)], relaxed, expected_gpus=1, idle=True).ok
    assert not evaluate([gpu(xid_recent=1, recent_xid_codes=[13])], relaxed, expected_gpus=1, idle=True).ok
    with pytest.raises(ValueError, match="unknown threshold 'max_temp'"):
        HealthThresholds.from_mapping({"max_temp": 90})
    with pytest.raises(ValueError, match="non-negative number"):
        HealthThresholds.from_mapping({"min_bandwidth_ratio": "most"})


# --- bandwidth probe, real sockets on loopback ---------------------------------------------------

@pytest.fixture
def probe_servers() -> Iterator[list[BandwidthProbeServer]]:
    servers = [BandwidthProbeServer("127.0.0.1", 0).start() for _ in range(2)]
    yield servers
    for server in servers:
        server.close()


def test_probe_measures_both_directions_between_two_servers(probe_servers: list[BandwidthProbeServer]) -> None:
    a, b = probe_servers
    for target in (a, b):
        mbps = probe_bandwidth("127.0.0.1", target.port, nbytes=32 * 2**20, max_seconds=5)
        assert mbps > 10  # loopback moves hundreds of MB/s even on a busy 2-core machine


def test_probe_stops_at_its_time_limit(probe_servers: list[BandwidthProbeServer]) -> None:
    started = time.monotonic()
    mbps = probe_bandwidth("127.0.0.1", probe_servers[0].port, nbytes=2**40, max_seconds=0.5)
    assert time.monotonic() - started < 3 and mbps > 0


def test_slow_and_unreachable_peers_are_flagged(probe_servers: list[BandwidthProbeServer],
                                                free_port: Callable[[], int]) -> None:
    port = probe_servers[1].port
    fine = ProbePeer(node="fast", address="127.0.0.1", port=port, expected_mbps=1.0)
    # Nothing real reaches 10^9 MB/s: this pair is below 80% of what it is expected to do.
    slow = ProbePeer(node="slow", address="127.0.0.1", port=port, expected_mbps=1e9)
    gone = ProbePeer(node="gone", address="127.0.0.1", port=free_port(), expected_mbps=1.0)
    results = probe_peers([fine, slow, gone], nbytes=8 * 2**20, max_seconds=2)
    assert [r.ok for r in results] == [True, False, False]
    assert results[1].mbps is not None and results[1].error is None
    assert results[2].mbps is None and "probe failed" in (results[2].error or "")

    report = with_bandwidth(evaluate([gpu()], DEFAULT_THRESHOLDS, expected_gpus=1, idle=True), results)
    assert not report.ok and "bandwidth to slow" in report.reason and "bandwidth to gone" in report.reason


def test_probe_server_ignores_strangers(probe_servers: list[BandwidthProbeServer]) -> None:
    with socket.create_connection(("127.0.0.1", probe_servers[0].port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed without an answer
    assert probe_bandwidth("127.0.0.1", probe_servers[0].port, nbytes=2**20, max_seconds=2) > 0
