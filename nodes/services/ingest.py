"""What agents push: GPU telemetry (bulk, fast) and events (deduplicated evidence, then signals).

Telemetry is the hot path — 100,000 GPUs at one sample per 10 s is 10,000 rows a second — so a
batch costs a constant handful of queries whatever its size:

1. lock the node's GPU rows (serialises two batches of one node; different nodes never wait),
2. insert every sample in one statement, duplicates of a replay skipped by the (node, gpu, time) key,
3. update each GPU's latest sample and health in one statement — only with samples newer than
   the stored one, so a replay of old spooled samples cannot turn the clock back,
4. judge the node (``nodes.health``) and, when the verdict changed, ``set_health``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection, models, transaction
from django.utils import timezone

from agents.protocol import agent as wire
from agents.protocol import dump
from nodes import health as rules
from nodes import signals
from nodes.choices import Health
from nodes.models import GPU, AgentEventRecord, GpuSample, Node, NodePairBandwidth
from nodes.services.fleet import (
    BIGINT_MAX,
    FRESH_SAMPLE_S,
    check_range,
    finish_drain,
    set_health,
    thresholds,
)
from nodes.workload import workload

log = logging.getLogger(__name__)
#: Sample columns in wire order; ``node`` comes from the URL's (authenticated) node instead.
SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(wire.GpuSample) if f.name != "node")
#: Counter columns (bigint): the protocol bounds them from below only.
INT_FIELDS = tuple(name for name in SAMPLE_FIELDS
                   if isinstance(GpuSample._meta.get_field(name), models.BigIntegerField))
#: An Xid event older than this is history (the telemetry window judges it), not news.
FRESH_XID_S = 600


@dataclass(frozen=True)
class Ingested:
    accepted: int
    duplicates: int


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


# --- telemetry ------------------------------------------------------------------------------------

def ingest_telemetry(node: Node, batch: wire.TelemetryBatch) -> Ingested:
    """Store a batch of GPU samples of ``node`` (already validated, all naming ``node``)."""
    samples = batch.samples
    if not samples:
        return Ingested(0, 0)
    columns = {name: [getattr(s, name) for s in samples] for name in SAMPLE_FIELDS}
    for name in INT_FIELDS:
        values = [v for v in columns[name] if v is not None]
        if values and max(values) > BIGINT_MAX:
            i = next(i for i, v in enumerate(columns[name]) if v is not None and v > BIGINT_MAX)
            check_range(columns[name][i], f"samples.{i}.{name}")
    latest: dict[int, wire.GpuSample] = {}
    for sample in samples:
        seen = latest.get(sample.gpu)
        if seen is None or sample.time > seen.time:
            latest[sample.gpu] = sample
    with transaction.atomic():
        gpus = {g.index: g for g in GPU.objects.select_for_update().filter(node=node)}
        inserted = _insert_samples(node, samples, columns)
        verdict = _update_latest(node, gpus, latest)
    if verdict.health != rules.UNKNOWN and verdict.health != node.health and node.health != Health.UNREACHABLE:
        set_health(node, verdict.health, actor=f"node:{node.hostname}", evidence=verdict.evidence,
                   reason="; ".join(verdict.reasons) or "every GPU within limits")
    return Ingested(accepted=inserted, duplicates=len(samples) - inserted)


def _update_latest(node: Node, gpus: dict[int, GPU], latest: dict[int, wire.GpuSample]) -> rules.Verdict:
    created, changed = [], []
    for index, sample in latest.items():
        at = _utc(sample.time)
        gpu = gpus.get(index)
        if gpu is None:  # an agent that registered without listing its GPUs (or a new card)
            gpu = gpus[index] = GPU(node=node, index=index)
            created.append(gpu)
        elif gpu.last_sample_at is not None and gpu.last_sample_at >= at:
            continue
        else:
            changed.append(gpu)
        gpu.last_sample, gpu.last_sample_at = dump(sample), at
    silent = _silent_gpus(node, gpus.values())
    samples = [g.last_sample for g in gpus.values() if g.last_sample and g.index not in silent]
    verdict = rules.evaluate_node(samples, thresholds(), idle=not node.running, silent=silent)
    for gpu in gpus.values():
        judged = verdict.gpus.get(gpu.index)
        if judged is not None and judged != gpu.health:
            gpu.health = judged
            if gpu not in created and gpu not in changed:
                changed.append(gpu)
    if created:
        GPU.objects.bulk_create(created, ignore_conflicts=True)
    if changed:
        _save_latest(changed)
    return verdict


def _silent_gpus(node: Node, gpus) -> dict[int, float | None]:
    """GPUs without a sample in the ``FRESH_SAMPLE_S`` before the newest one of the node.

    Measured against the newest sample, not the clock, so that a replay of spooled samples after
    an outage does not make every GPU look silent; a GPU never heard from counts from registration.
    """
    newest = max((g.last_sample_at for g in gpus if g.last_sample_at is not None), default=None)
    if newest is None:
        return {}
    cutoff = newest - timedelta(seconds=FRESH_SAMPLE_S)
    silent: dict[int, float | None] = {}
    for gpu in gpus:
        if gpu.last_sample_at is None:
            if node.registered_at is not None and node.registered_at < cutoff:
                silent[gpu.index] = None
        elif gpu.last_sample_at < cutoff:
            silent[gpu.index] = (newest - gpu.last_sample_at).total_seconds()
    return silent


def _save_latest(gpus: list[GPU]) -> None:
    """One UPDATE for all GPUs. On PostgreSQL from arrays: ``bulk_update`` builds a CASE per
    column and row, which costs more Python than the whole insert of the samples."""
    if connection.vendor != "postgresql":
        GPU.objects.bulk_update(gpus, ["last_sample", "last_sample_at", "health"])
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE nodes_gpu AS g SET last_sample = u.sample, last_sample_at = u.at, health = u.health "
            "FROM unnest(%s::bigint[], %s::jsonb[], %s::timestamptz[], %s::varchar[]) AS u(id, sample, at, health) "
            "WHERE g.id = u.id",
            [[g.pk for g in gpus], [json.dumps(g.last_sample) for g in gpus], [g.last_sample_at for g in gpus],
             [g.health for g in gpus]],
        )


def _insert_samples(node: Node, samples: list[wire.GpuSample], columns: dict[str, list]) -> int:
    """Insert, skipping (node, gpu, time) already stored; returns how many rows were new."""
    if connection.vendor == "postgresql":
        return _insert_unnest(node, columns)
    return _insert_orm(node, samples)


def _insert_orm(node: Node, samples: list[wire.GpuSample]) -> int:
    """Any database: ``bulk_create``, counting what existed before (exact under the GPU lock)."""
    keys = {(s.gpu, _utc(s.time)) for s in samples}
    times = [t for _, t in keys]
    before = GpuSample.objects.filter(node=node, time__gte=min(times), time__lte=max(times)).count()
    rows = [GpuSample(node=node, **{name: getattr(s, name) for name in SAMPLE_FIELDS} | {"time": _utc(s.time)})
            for s in samples]
    GpuSample.objects.bulk_create(rows, ignore_conflicts=True, batch_size=200)
    after = GpuSample.objects.filter(node=node, time__gte=min(times), time__lte=max(times)).count()
    return after - before


def _unnest_sql() -> str:
    meta = GpuSample._meta
    columns, selects, arrays = ["node_id"], ["%s"], []
    for name in SAMPLE_FIELDS:
        field = meta.get_field(name)
        columns.append(connection.ops.quote_name(field.column))
        arrays.append(f"%s::{field.db_type(connection)}[]")
        selects.append(f"u.{name}")
    table = connection.ops.quote_name(meta.db_table)
    # Identifiers come from the model's metadata, never from a request; values travel as parameters.
    sql = (f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(selects)} "  # noqa: S608
           f"FROM unnest({', '.join(arrays)}) AS u({', '.join(SAMPLE_FIELDS)}) ON CONFLICT DO NOTHING")
    return sql


_UNNEST_SQL: str | None = None
_BOOL = {True: "t", False: "f", None: "NULL"}


def _array_literal(values: list) -> str:
    """A PostgreSQL array literal of one column: ``{1,NULL,2.5}``, built with one C-level join.

    Django's psycopg cursor binds parameters client-side, dumping arrays element by element in
    Python; one string per column is several times cheaper. Only numbers, booleans and JSON lists
    of integers get here (validated by the protocol), none of which needs escaping.
    """
    first = next((v for v in values if v is not None), None)
    if isinstance(first, bool):
        return "{" + ",".join([_BOOL[v] for v in values]) + "}"
    if isinstance(first, list):  # recent_xid_codes: each element is a quoted JSON text
        return "{" + ",".join(['"' + json.dumps(v) + '"' if v else '"[]"' for v in values]) + "}"
    return "{" + ",".join(["NULL" if v is None else str(v) for v in values]) + "}"


def _insert_unnest(node: Node, columns: dict[str, list]) -> int:
    """PostgreSQL: one ``INSERT … SELECT FROM unnest(column arrays)``, no model instance per row.

    One parameter per column instead of one per value keeps the statement small and cheap to
    build; ``ON CONFLICT DO NOTHING`` skips replayed rows and the row count says how many were new.
    """
    global _UNNEST_SQL
    if _UNNEST_SQL is None:
        _UNNEST_SQL = _unnest_sql()
    # Times as ISO text converted by Python, exactly as the GPU's ``last_sample_at`` and the ORM
    # path convert them (PostgreSQL's to_timestamp() rounds some microseconds the other way).
    arrays = [_array_literal([_utc(t).isoformat() for t in columns[name]] if name == "time" else columns[name])
              for name in SAMPLE_FIELDS]
    with connection.cursor() as cursor:
        cursor.execute(_UNNEST_SQL, [node.pk, *arrays])
        return cursor.rowcount


# --- events ---------------------------------------------------------------------------------------

class ForeignGeneration(Exception):
    """An event names a generation of a job that is not placed on the reporting node (a 403)."""


def record_agent_events(node: Node, events: list[tuple[wire.AgentEvent, object]]) -> Ingested:
    """Store the agent's events (each with its validated detail); act on and signal the new ones.

    An agent speaks only for its own node: if one event names a generation of an existing job
    that is not placed on ``node``, the whole batch is refused (``ForeignGeneration``) and nothing
    of it is stored or acted on. A key already stored for the node is a replay: counted, not stored
    or signalled again. The node row is locked for the batch so that two deliveries of the same
    batch cannot both count an event as new.
    """
    unique: dict[str, tuple[wire.AgentEvent, object]] = {}
    for i, (event, detail) in enumerate(events):
        check_range(event.generation, f"events.{i}.generation")
        unique.setdefault(event.key, (event, detail))
    _refuse_foreign(node, [event for event, _ in events])
    now = timezone.now()
    with transaction.atomic():
        Node.objects.select_for_update().filter(pk=node.pk).values_list("pk", flat=True).first()
        known = set(AgentEventRecord.objects.filter(node=node, key__in=list(unique)).values_list("key", flat=True))
        fresh = [(e, d) for key, (e, d) in unique.items() if key not in known]
        job_ids = {int(e.job) for e, _ in fresh if e.job and e.job.isdigit()}
        jobs = workload().existing_jobs(job_ids) if job_ids else set()
        records = [AgentEventRecord(node=node, key=e.key, kind=e.kind, time=_utc(e.time), generation=e.generation,
                                    job_id=int(e.job) if e.job and e.job.isdigit() and int(e.job) in jobs else None,
                                    job_ref=e.job or "", detail=dump(d), received_at=now)
                   for e, d in fresh]
        AgentEventRecord.objects.bulk_create(records)
        for record, (event, detail) in zip(records, fresh):
            _act_on(node, record, event, detail, now)
    return Ingested(accepted=len(fresh), duplicates=len(events) - len(fresh))


def _refuse_foreign(node: Node, events: list[wire.AgentEvent]) -> None:
    """Raise ``ForeignGeneration`` if an event names an existing job's generation not placed on
    ``node``. (An event naming no known job is kept as a record and acts on nothing.)"""
    named = {(int(e.job), e.generation) for e in events if e.job and e.job.isdigit()}
    if not named:
        return
    job_ids = {job for job, _ in named}
    existing = workload().existing_jobs(job_ids)
    placed = set(node.generations.filter(job_id__in=existing).values_list("job_id", "number"))
    foreign = sorted((job, gen) for job, gen in named if job in existing and (job, gen) not in placed)
    if foreign:
        job, gen = foreign[0]
        raise ForeignGeneration(f"generation {gen} of job {job} is not placed on node {node.hostname}: "
                                f"the batch is refused, nothing of it was recorded")


def _act_on(node: Node, record: AgentEventRecord, event: wire.AgentEvent, detail, now: datetime) -> None:
    common = {"node": node, "job_id": record.job_id, "generation": event.generation, "detail": record.detail,
              "time": record.time, "record_id": record.pk}
    actor = f"node:{node.hostname}"
    kind = event.kind
    if kind in ("exited", "stopped"):
        signals.send_on_commit(signals.generation_exited, kind=kind, **common)
    elif kind == "launched":
        signals.send_on_commit(signals.generation_launched, **common)
    elif kind == "launch_refused":
        _store_bandwidth(node, detail.bandwidth, record.time)
        signals.send_on_commit(signals.launch_refused, reason=detail.reason, **common)
    elif kind == "health_check":
        _store_bandwidth(node, detail.bandwidth, record.time)
        signals.send_on_commit(signals.health_checked, ok=detail.ok, **common)
    elif kind == "drain_ack":
        if not detail.running:
            finish_drain(node, actor=actor, reason="the agent acknowledged the drain and runs nothing")
        signals.send_on_commit(signals.drain_acked, running=[dump(r) for r in detail.running],
                               **{k: v for k, v in common.items() if k not in ("job_id", "generation")})
    elif kind == "agent_started":
        Node.objects.filter(pk=node.pk).update(agent_version=detail.agent_version, gpu_telemetry=detail.gpu_telemetry,
                                               gpu_telemetry_reason=detail.gpu_telemetry_reason or "")
    elif kind == "telemetry_dropped":
        log.warning("node %s: the agent's spool dropped %d telemetry samples (%d in all)", node.hostname,
                    detail.count, detail.total)
    elif kind == "xid":
        _critical_xid(node, detail, record.time, now, actor)


def _critical_xid(node: Node, detail: wire.XidDetail, at: datetime, now: datetime, actor: str) -> None:
    """A fresh critical Xid marks the node unhealthy at once, without waiting for the next sample."""
    if detail.code not in thresholds().critical_xids or now - at > timedelta(seconds=FRESH_XID_S):
        return
    if node.health in (Health.UNHEALTHY, Health.UNREACHABLE):
        return
    set_health(node, Health.UNHEALTHY, actor=actor, reason=f"GPU {detail.gpu}: critical Xid {detail.code}",
               evidence={"reasons": [f"GPU {detail.gpu}: critical Xid {detail.code}"], "xid": dump(detail)})


def _store_bandwidth(node: Node, results: list[wire.BandwidthResult], at: datetime) -> None:
    """Keep the latest probe result per (node, peer); results naming no known node are dropped."""
    peers = {str(pk): pk for pk in Node.objects.filter(
        pk__in=[int(r.peer) for r in results if r.peer.isdigit()]).values_list("pk", flat=True)}
    for result in results:
        if result.peer not in peers:
            log.warning("node %s probed unknown peer %r; result not stored", node.hostname, result.peer)
            continue
        NodePairBandwidth.objects.update_or_create(
            source=node, peer_id=peers[result.peer],
            defaults={"address": result.address, "expected_mbps": result.expected_mbps, "mbps": result.mbps,
                      "ok": result.ok, "error": result.error or "", "measured_at": at},
        )
