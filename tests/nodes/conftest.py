"""Helpers for the nodes tests: wire bodies built inline, as the agent would send them."""

from __future__ import annotations

import time

import pytest

GIB = 2**30


def sample(node, gpu=0, at=None, **fields) -> dict:
    """One healthy GPU sample of ``node`` (wire JSON), with ``fields`` overriding."""
    body = {"node": str(node.pk), "gpu": gpu, "time": time.time() if at is None else at, "temperature_c": 55.0,
            "memory_used": 2 * GIB, "memory_free": 78 * GIB, "utilization_pct": 97.0, "power_w": 410.0,
            "sm_clock_mhz": 1980, "throttle_reasons": 0, "ecc_uncorrected_recent": 0, "ecc_corrected_recent": 0,
            "nvlink_errors_recent": 0, "xid_total": 0, "xid_recent": 0, "recent_xid_codes": [],
            "remap_pending": False, "remap_failed": False, "window_s": 600.0}
    body.update(fields)
    return body


def batch_of(node, gpus=8, per_gpu=32, start=None, **fields) -> dict:
    """``gpus`` × ``per_gpu`` samples one second apart."""
    start = time.time() - per_gpu if start is None else start
    return {"samples": [sample(node, gpu, start + i, **fields) for i in range(per_gpu) for gpu in range(gpus)]}


def heartbeat(node, seq=1, **fields) -> dict:
    body = {"node_id": str(node.pk), "seq": seq, "time": time.time()}
    body.update(fields)
    return body


def event(key, kind, job=None, generation=None, detail=None, at=None) -> dict:
    body = {"key": key, "kind": kind, "time": time.time() if at is None else at, "detail": detail or {}}
    if job is not None:
        body["job"] = str(job)
        body["generation"] = generation
    return body


def register_body(token, hostname="gpu-new-01", gpus=2, **fields) -> dict:
    body = {"bootstrap_token": token, "hostname": hostname, "address": "10.0.0.9", "agent_version": "0.1.0",
            "labels": {"rack": "r1"},
            "gpus": [{"index": i, "uuid": f"GPU-{hostname}-{i}", "name": "NVIDIA H100", "memory_total": 80 * GIB}
                     for i in range(gpus)]}
    body.update(fields)
    return body


@pytest.fixture
def agent(cast, api):
    """The agent client of node1 (token "agent")."""
    return api(cast.tokens["agent"])


@pytest.fixture
def post(agent, cast):
    """``post(suffix, body)``: POST /api/v1/nodes/<node1>/<suffix> as node1's agent."""

    def send(suffix, body, client=None):
        return (client or agent).post(f"/api/v1/nodes/{cast.node1.pk}/{suffix}", body, format="json")

    return send


@pytest.fixture(autouse=True)
def only_test_receivers():
    """The nodes tests check what the nodes app sends, not what the jobs app does with it (its
    receivers enqueue orchestrator tasks): each signal starts with no receivers and is restored."""
    from nodes import signals

    saved = {}
    for name in ("generation_exited", "generation_launched", "launch_refused", "health_checked", "drain_acked",
                 "node_health_changed", "command_acked"):
        signal = getattr(signals, name)
        with signal.lock:
            saved[signal] = signal.receivers
            signal.receivers = []
            signal.sender_receivers_cache.clear()
    yield
    for signal, receivers in saved.items():
        with signal.lock:
            signal.receivers = receivers
            signal.sender_receivers_cache.clear()


@pytest.fixture(autouse=True)
def redis_counts():
    """``core.shared_counts`` starting empty (the test run's own Redis database) and left empty: the
    heartbeat sweeper reads them, and other tests' 503s must not make it hold here."""
    from core import shared_counts

    redis = shared_counts.client()  # this one, even if the test points REDIS_URL elsewhere

    def clear():
        for key in redis.scan_iter(f"{shared_counts.PREFIX}*") if redis is not None else ():
            redis.delete(key)

    clear()
    yield shared_counts
    clear()
