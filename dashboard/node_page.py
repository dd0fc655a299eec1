"""One node's page (``/nodes/<id>/``): what an on-call needs to judge a machine.

Its GPUs now (the latest reading the health rules judged), their telemetry over the last hour
(raw samples), day or week (the 1-minute rollups; the week averaged to 10 minutes so a chart
holds ~1,000 points), the agent's evidence (Xids, health checks, exits) and the audit log of the
node on one timeline, the bandwidth probes from and to it, the generations that ran on it and the
incidents that named it. Every part is a bounded query on an index that starts with the node.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from core.models import Event
from dashboard.fleet import STALE_AFTER
from jobs.models import Generation, Incident
from nodes.models import AgentEventRecord, NodeGpuMinute, NodeGpuSample, NodePairBandwidth

#: range name -> (how far back, seconds per chart point: 0 = every row)
RANGES = {"hour": (timedelta(hours=1), 0), "day": (timedelta(days=1), 0), "week": (timedelta(days=7), 600)}
#: The charted readings: (name, unit, raw column, rollup column).
METRICS = (("temperature", "°C", "temperature_c", "temperature_mean"),
           ("utilization", "%", "utilization_pct", "utilization_mean"),
           ("memory used", "MiB", "memory_used_mib", "memory_used_mib_mean"),
           ("power", "W", "power_w", "power_mean"))
ACTIVITY = 60
ERROR_KINDS = ("uncorrectable ECC error(s)", "Xid error(s)", "NVLink error(s)")
HISTORY = 20


def gpus(node) -> list[dict]:
    now = timezone.now()
    rows = []
    for gpu in node.gpus.all():
        sample = gpu.last_sample or {}
        rows.append({"gpu": gpu, "sample": sample,
                     "stale": gpu.last_sample_at is None or now - gpu.last_sample_at > STALE_AFTER})
    return rows


def series(node, range_name: str) -> dict:
    """The charted readings of every GPU over ``range_name``: ``{"t": [epoch…], "gpus": n,
    "metrics": [{"name", "unit", "values": [[per GPU]…]}]}``, a point per row (or per bucket)."""
    since_delta, bucket = RANGES[range_name]
    since = timezone.now() - since_delta
    if range_name == "hour":
        columns = [m[2] for m in METRICS]
        rows = NodeGpuSample.objects.filter(node=node, time__gte=since).order_by("time").values_list("time", *columns)
    else:
        columns = [m[3] for m in METRICS]
        rows = NodeGpuMinute.objects.filter(node=node, minute__gte=since).order_by("minute").values_list(
            "minute", *columns)
    rows = _bucketed(list(rows), bucket) if bucket else [(t.timestamp(), *values) for t, *values in rows]
    width = max((len(v) for row in rows for v in row[1:] if v), default=0)
    metrics = []
    for i, (name, unit, _, _) in enumerate(METRICS):
        per_gpu = [[(row[i + 1][g] if row[i + 1] and g < len(row[i + 1]) else None) for row in rows]
                   for g in range(width)]
        metrics.append({"name": name, "unit": unit, "values": per_gpu})
    return {"t": [row[0] for row in rows], "gpus": width, "metrics": metrics, "range": range_name}


def _bucketed(rows: list[tuple], seconds: int) -> list[tuple]:
    """Mean of each GPU's readings per ``seconds``-long bucket (None where a GPU has none)."""
    buckets: dict[float, list[tuple]] = defaultdict(list)
    for t, *values in rows:
        buckets[t.timestamp() // seconds * seconds].append(values)
    out = []
    for start, members in sorted(buckets.items()):
        means = []
        for column in zip(*members, strict=True):
            width = max((len(v) for v in column if v), default=0)
            per_gpu = []
            for g in range(width):
                readings = [v[g] for v in column if v and g < len(v) and v[g] is not None]
                per_gpu.append(sum(readings) / len(readings) if readings else None)
            means.append(per_gpu or None)
        out.append((start, *means))
    return out


def activity(node) -> list[dict]:
    """The agent's evidence, the GPU errors its telemetry counted (uncorrectable ECC, Xid, NVLink)
    and the node's audit log, newest first, on one timeline."""
    entries = _errors(node)
    entries += [{"at": e.created_at, "kind": e.kind, "change": (e.old_state, e.new_state), "actor": e.actor,
                 "text": e.reason, "generation": e.generation}
                for e in Event.objects.filter(node=node).order_by("-created_at", "-pk")[:ACTIVITY]]
    entries += [{"at": r.time, "kind": f"agent: {r.kind}", "change": None, "actor": f"node:{node.hostname}",
                 "text": _describe(r), "generation": r.generation}
                for r in AgentEventRecord.objects.filter(node=node).order_by("-time", "-pk")[:ACTIVITY]]
    return sorted(entries, key=lambda e: e["at"], reverse=True)[:ACTIVITY]


def _errors(node) -> list[dict]:
    """A timeline entry per raw sample that counted new GPU errors (the columns are NULL when no GPU
    of the sample counted one, so this reads only the samples that did)."""
    counted = (NodeGpuSample.objects.filter(node=node).filter(
        Q(ecc_uncorrected_errors__isnull=False) | Q(xid_errors__isnull=False) | Q(nvlink_errors__isnull=False))
        .order_by("-time").values_list("time", "ecc_uncorrected_errors", "xid_errors", "nvlink_errors")[:ACTIVITY])
    entries = []
    for at, *columns in counted:
        parts = [f"GPU {gpu}: {count} {what}" for what, values in zip(ERROR_KINDS, columns, strict=True)
                 for gpu, count in enumerate(values or []) if count]
        if parts:
            entries.append({"at": at, "kind": "telemetry: GPU errors", "change": None, "actor": f"node:{node.hostname}",
                            "text": "; ".join(parts), "generation": None})
    return entries


def _describe(record: AgentEventRecord) -> str:
    detail = record.detail or {}
    if record.kind == "xid":
        return f"GPU {detail.get('gpu')}: Xid {detail.get('code')}"
    if record.kind == "health_check":
        return ("passed" if detail.get("ok") else f"failed: {detail.get('reason', '')}")[:300]
    return ", ".join(f"{k}={v}" for k, v in list(detail.items())[:6])[:300]


def history(node) -> dict:
    return {
        "generations": list(Generation.objects.filter(nodes=node).select_related("job")
                            .order_by("-started_at")[:HISTORY]),
        "incidents": list(Incident.objects.filter(nodes=node).select_related("job")
                          .order_by("-detected_at")[:HISTORY]),
        "bandwidth": list(NodePairBandwidth.objects.filter(source=node).select_related("source", "peer")
                          .order_by("peer__hostname")[:HISTORY])
                     + list(NodePairBandwidth.objects.filter(peer=node).select_related("source", "peer")
                            .order_by("source__hostname")[:HISTORY]),
    }
