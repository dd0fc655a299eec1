"""Simulated nodes for ``make demo --fleet N``: a cluster to look at, not to run on.

The embedded demo has one real node (its agent, a scripted GPU). With ``--fleet N`` it adds N
nodes of 8 GPUs in racks of 16, so that the heat map, the filters and the node pages show a
cluster: every seventh node degraded (a GPU running hot), one a lemon (drained, kept out), and
every ten seconds a scripted reading per GPU written as the telemetry ingest writes it (raw
samples, the latest reading), so that their charts move.

They have no agent: each says so in its health reason and carries the label
``simulated=demo``; they never miss a heartbeat (no deadline), and they are spares, which
placement takes last, so the demo job stays on the real node.
"""

from __future__ import annotations

import math
from datetime import datetime

from django.utils import timezone

from nodes.choices import Health, Schedulability
from nodes.models import GPU, Node, NodeGpuSample

GPUS = 8
RACK = 16
REASON = "simulated by make demo --fleet: no agent; its readings are scripted"


def seed(count: int) -> list[Node]:
    """The ``count`` simulated nodes (made once; a later demo reuses them)."""
    now = timezone.now()
    nodes = []
    for i in range(count):
        lemon = i == count // 2
        degraded = i % 7 == 3 and not lemon
        node, created = Node.objects.get_or_create(hostname=f"sim-r{i // RACK:02d}-n{i % RACK:02d}", defaults={
            "address": "127.0.0.1", "is_spare": True, "labels": {"rack": f"r{i // RACK:02d}", "simulated": "demo"},
            "health": Health.DEGRADED if degraded else Health.HEALTHY,
            "health_reason": (f"{REASON}; GPU 3 runs hot" if degraded else REASON), "health_changed_at": now,
            "lemon_count": 3 if lemon else 0, "last_heartbeat_at": now, "registered_at": now,
            "schedulability": Schedulability.DRAINED if lemon else Schedulability.ACTIVE,
            "drain_reason": "lemon: blamed for 3 incidents this week, kept out until cleared" if lemon else ""})
        if created:
            GPU.objects.bulk_create([GPU(node=node, index=g, name="NVIDIA H100 80GB HBM3", memory_total_mb=81_559,
                                         health=Health.DEGRADED if degraded and g == 3 else Health.HEALTHY)
                                     for g in range(GPUS)])
        nodes.append(node)
    return nodes


def tick(nodes: list[Node], now: datetime | None = None) -> None:
    """One scripted reading of every simulated GPU: a raw sample per node, the latest per GPU."""
    now = now or timezone.now()
    phase = now.timestamp() / 120
    samples, latest = [], []
    gpus = {(g.node_id, g.index): g for g in GPU.objects.filter(node__in=nodes)}
    for node in nodes:
        readings = [_reading(node.pk, g, phase, hot=node.health == Health.DEGRADED and g == 3) for g in range(GPUS)]
        samples.append(NodeGpuSample(
            node=node, time=now, gpus=2**GPUS - 1, temperature_c=[round(r["temperature_c"]) for r in readings],
            utilization_pct=[round(r["utilization_pct"]) for r in readings],
            memory_used_mib=[r["memory_used"] >> 20 for r in readings], power_w=[round(r["power_w"]) for r in readings],
            sm_clock_mhz=[1980] * GPUS))
        for g, reading in enumerate(readings):
            gpu = gpus.get((node.pk, g))
            if gpu is not None:
                gpu.last_sample, gpu.last_sample_at = reading, now
                latest.append(gpu)
    NodeGpuSample.objects.bulk_create(samples, ignore_conflicts=True)
    GPU.objects.bulk_update(latest, ["last_sample", "last_sample_at"], batch_size=500)
    Node.objects.filter(pk__in=[n.pk for n in nodes]).update(last_heartbeat_at=now)


def _reading(node_id: int, gpu: int, phase: float, *, hot: bool) -> dict:
    wave = math.sin(phase + node_id * 0.7 + gpu * 0.3)
    used = int((40 + 20 * (wave + 1)) * 2**30)
    return {"temperature_c": (86.0 if hot else 58.0) + 8 * wave, "utilization_pct": 90.0 + 8 * wave,
            "memory_used": used, "memory_free": 80 * 2**30 - used, "power_w": 520.0 + 120 * wave,
            "xid_recent": 0, "recent_xid_codes": [], "ecc_uncorrected_recent": 0}
