"""What agents push: GPU telemetry (bulk, fast) and events (deduplicated evidence, then signals).

Telemetry is the hot path — 100,000 GPUs at one sample per 10 s is 10,000 rows a second — so a
batch costs a constant handful of queries whatever its size:

1. lock the node's GPU rows (serialises two batches of one node; different nodes never wait),
2. store the charted readings in one statement: a row per (node, time) with a value per GPU
   (``NodeGpuSample``); GPUs already in the row — a replay — are counted as duplicates, others
   merged into it. Samples older than the raw retention are not stored (retention would drop
   them within the hour); a late batch re-rolls the minute rollups it covers,
3. update each GPU's latest sample and health in one statement — only with samples newer than
   the stored one, so a replay of old spooled samples cannot turn the clock back,
4. judge the node (``nodes.health``) and, when the verdict changed, ``set_health``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import zip_longest
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from agents.protocol import agent as wire
from agents.protocol import dump
from nodes import health as rules
from nodes import signals
from nodes.choices import Health
from nodes.models import GPU, AgentEventRecord, Node, NodeGpuSample, NodePairBandwidth
from nodes.services import retention, rollup
from nodes.services.fleet import (
    BIGINT_MAX,
    FRESH_SAMPLE_S,
    INT_MAX,
    check_range,
    finish_drain,
    set_health,
    thresholds,
)
from nodes.workload import workload

log = logging.getLogger(__name__)
#: Wire integers: the protocol bounds them from below only, the latest reading (JSON) must hold them.
INT_FIELDS = tuple(f.name for f in dataclasses.fields(wire.GpuSample) if f.type in ("int", "int | None"))
SMALLINT_MAX = 2**15 - 1
NVLINK_FIELDS = ("nvlink_replay_errors", "nvlink_recovery_errors", "nvlink_crc_flit_errors", "nvlink_crc_data_errors")


@dataclass(frozen=True)
class RawColumn:
    """How one ``NodeGpuSample`` column is made from wire fields: their sum (``None`` if all are),
    rounded, shifted right by ``shift`` bits (bytes to MiB), clamped to the column type's range.

    A ``counter`` column (lifetime error counts) stores how much the count rose since the GPU's
    sample before, and is NULL when no GPU of the row counted a new error: a healthy fleet pays
    nothing for it, where the lifetime totals, nonzero on many GPUs for ever, would cost every row.
    """

    fields: tuple[str, ...]
    high: int
    shift: int = 0
    counter: bool = False

    def total(self, get: Callable[[str], Any]) -> int | None:
        """The sum of the fields as ``get`` reads them (a wire sample's attributes, a stored reading's keys)."""
        readings = [get(name) for name in self.fields]
        if all(v is None for v in readings):
            return None
        return round(sum(v or 0 for v in readings))

    def stored(self, value: int | None) -> int | None:
        return None if value is None else max(-self.high - 1, min(self.high, value >> self.shift))


RAW_COLUMNS = {
    "temperature_c": RawColumn(("temperature_c",), SMALLINT_MAX),
    "utilization_pct": RawColumn(("utilization_pct",), SMALLINT_MAX),
    "memory_used_mib": RawColumn(("memory_used",), INT_MAX, shift=20),
    "power_w": RawColumn(("power_w",), SMALLINT_MAX),
    "sm_clock_mhz": RawColumn(("sm_clock_mhz",), SMALLINT_MAX),
    "xid_errors": RawColumn(("xid_total",), INT_MAX, counter=True),
    "ecc_uncorrected_errors": RawColumn(("ecc_uncorrected_aggregate",), INT_MAX, counter=True),
    "nvlink_errors": RawColumn(NVLINK_FIELDS, INT_MAX, counter=True),
}
COUNTER_COLUMNS = {name: column for name, column in RAW_COLUMNS.items() if column.counter}
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
    for name in INT_FIELDS:
        values = [v for s in samples if (v := getattr(s, name)) is not None]
        if values and max(values) > BIGINT_MAX:
            i = next(i for i, s in enumerate(samples) if (getattr(s, name) or 0) > BIGINT_MAX)
            check_range(getattr(samples[i], name), f"samples.{i}.{name}")
    latest: dict[int, wire.GpuSample] = {}
    for sample in samples:
        seen = latest.get(sample.gpu)
        if seen is None or sample.time > seen.time:
            latest[sample.gpu] = sample
    now = timezone.now()
    with transaction.atomic():
        gpus = {g.index: g for g in GPU.objects.select_for_update().filter(node=node)}
        before = {index: (g.last_sample_at.timestamp(), g.last_sample) for index, g in gpus.items()
                  if g.last_sample_at is not None}
        rows, expired = raw_rows(samples, since=retention.retention().raw_cutoff(now), before=before)
        inserted = _insert_samples(node, rows) + expired
        verdict = _update_latest(node, gpus, latest)
        if rows and rows[0].time < now - rollup.LATE:  # beat may not roll these minutes up again
            rollup.roll_up(rows[0].time, rows[-1].time + rollup.MINUTE, node_id=node.pk)
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


@dataclass
class RawRow:
    """One ``NodeGpuSample`` row in the making: the readings of the GPUs in ``gpus`` (a bitmask)."""

    time: datetime
    gpus: int = 0
    values: dict[str, list] = dataclasses.field(default_factory=dict)

    def add(self, sample: wire.GpuSample, rises: dict[str, int | None]) -> None:
        self.gpus |= 1 << sample.gpu
        get = partial(getattr, sample)
        for name, column in RAW_COLUMNS.items():
            values = self.values.setdefault(name, [])
            values.extend([None] * (sample.gpu + 1 - len(values)))
            values[sample.gpu] = column.stored(rises[name] if column.counter else column.total(get))

    def merge(self, stored: RawRow) -> None:
        """Add ``stored`` (the row already in the table): its GPUs keep their stored readings."""
        for name in RAW_COLUMNS:
            pairs = zip_longest(stored.values.get(name) or [], self.values.get(name) or [])
            self.values[name] = [old if stored.gpus >> i & 1 else new for i, (old, new) in enumerate(pairs)]
        self.gpus |= stored.gpus

    def column(self, name: str) -> list | None:
        values = self.values.get(name) or []
        if RAW_COLUMNS[name].counter and not any(values):
            return None
        return values


def raw_rows(samples: list[wire.GpuSample], *, since: datetime,
             before: Mapping[int, tuple[float, Mapping]]) -> tuple[list[RawRow], int]:
    """The batch as raw rows, oldest first, and how many samples were older than ``since`` (not stored).

    ``before``: per GPU, the time and reading of its latest stored sample (``GPU.last_sample``),
    from which the error counters' first rises are counted. A (gpu, time) the batch repeats is
    stored once; its copies count as duplicates.
    """
    rises = _rises(samples, before)
    rows: dict[float, RawRow] = {}
    expired = 0
    for sample, rise in zip(samples, rises, strict=True):
        at = _utc(sample.time)
        if at < since:
            expired += 1
        elif sample.time not in rows or not rows[sample.time].gpus >> sample.gpu & 1:
            rows.setdefault(sample.time, RawRow(at)).add(sample, rise)
    return sorted(rows.values(), key=lambda row: row.time), expired


def _rises(samples: list[wire.GpuSample], before: Mapping[int, tuple[float, Mapping]]) -> list[dict]:
    """Per sample, how much each error counter rose since the same GPU's sample before it.

    A count that went down was reset (the agent or the node restarted): it rose by its new value.
    Where the sample before is unknown — a GPU's first, or a replay older than the latest stored
    reading — the rise counts as 0: errors from before are history, not news.
    """
    rises: list[dict] = [{}] * len(samples)
    previous: dict[str, int | None] | None = None
    gpu = None
    for i in sorted(range(len(samples)), key=lambda i: (samples[i].gpu, samples[i].time)):
        sample = samples[i]
        if sample.gpu != gpu:
            gpu, stored = sample.gpu, before.get(sample.gpu)
            previous = ({name: column.total(stored[1].get) for name, column in COUNTER_COLUMNS.items()}
                        if stored is not None and stored[0] < sample.time else None)
        totals = {name: column.total(partial(getattr, sample)) for name, column in COUNTER_COLUMNS.items()}
        rises[i] = {name: _rise(None if previous is None else previous[name], total) for name, total in totals.items()}
        previous = totals
    return rises


def _rise(before: int | None, now: int | None) -> int | None:
    if now is None:
        return None
    if before is None:
        return 0
    return now - before if now >= before else now


def _insert_samples(node: Node, rows: list[RawRow]) -> int:
    """Store ``rows``, merging GPUs into rows already stored; returns how many GPU samples were new."""
    if not rows:
        return 0
    upsert = _upsert_unnest if connection.vendor == "postgresql" else _upsert_orm
    return new_samples(rows, upsert(node, rows))


def new_samples(rows: list[RawRow], before: dict[datetime, int]) -> int:
    """GPU samples of ``rows`` that were not stored yet, given the stored rows' GPU masks ``before``."""
    return sum((row.gpus & ~before.get(row.time, 0)).bit_count() for row in rows)


def _upsert_orm(node: Node, rows: list[RawRow]) -> dict[datetime, int]:
    """Any database: read the rows already stored (exact under the GPU lock), merge, write."""
    existing = {r.time: r for r in NodeGpuSample.objects.filter(node=node, time__in=[row.time for row in rows])}
    before = {time: old.gpus for time, old in existing.items()}
    fresh, merged = [], []
    for row in rows:
        old = existing.get(row.time)
        if old is None:
            fresh.append(NodeGpuSample(node=node, time=row.time, gpus=row.gpus,
                                       **{name: row.column(name) for name in RAW_COLUMNS}))
        elif row.gpus & ~old.gpus:
            row.merge(RawRow(old.time, old.gpus, {name: getattr(old, name) for name in RAW_COLUMNS}))
            old.gpus = row.gpus
            for name in RAW_COLUMNS:
                setattr(old, name, row.column(name))
            merged.append(old)
    NodeGpuSample.objects.bulk_create(fresh, batch_size=200)
    for row in merged:
        row.save(update_fields=["gpus", *RAW_COLUMNS])
    return before


def _merge_sql(column: str) -> str:
    """Per GPU, the stored reading if the stored row holds that GPU, else the new one (the shorter
    array pads with NULL); NULL stays NULL (a sparse column with nothing counted)."""
    # ``column`` is a name from RAW_COLUMNS, never from a request.
    return (f"{column} = CASE WHEN t.{column} IS NULL AND EXCLUDED.{column} IS NULL THEN NULL "  # noqa: S608
            f"ELSE ARRAY(SELECT CASE WHEN t.gpus & (1::bigint << (i - 1)::int) <> 0 THEN o ELSE n END "
            f"FROM unnest(t.{column}, EXCLUDED.{column}) WITH ORDINALITY AS m(o, n, i) ORDER BY i) END")


def _upsert_sql() -> str:
    meta = NodeGpuSample._meta
    table = connection.ops.quote_name(meta.db_table)
    names = list(RAW_COLUMNS)
    casts = [f"u.{name}::{meta.get_field(name).db_type(connection)}" for name in names]
    # Identifiers come from the model's metadata, never from a request; values travel as parameters.
    # ``old`` reads the rows as they were before the insert (one snapshot for the whole statement):
    # their GPU masks say which samples were replays.
    return (
        f"WITH new AS (SELECT * FROM unnest(%s::timestamptz[], %s::bigint[], "  # noqa: S608
        f"{', '.join(['%s::text[]'] * len(names))}) AS u(time, gpus, {', '.join(names)})), "
        # The times again as a literal, not from ``new``: the planner then prunes to their partitions
        # (with ~55 of them, planning the lookup through all cost ~10 ms, executing it under 1 ms).
        f"old AS (SELECT time, gpus FROM {table} WHERE node_id = %s AND time = ANY(%s::timestamptz[])), "
        f"written AS (INSERT INTO {table} AS t (node_id, time, gpus, {', '.join(names)}) "
        f"SELECT %s, u.time, u.gpus, {', '.join(casts)} FROM new u "
        f"ON CONFLICT (node_id, time) DO UPDATE SET gpus = t.gpus | EXCLUDED.gpus, "
        f"{', '.join(_merge_sql(name) for name in names)} WHERE EXCLUDED.gpus & ~t.gpus <> 0) "
        f"SELECT time, gpus FROM old"
    )


_UPSERT_SQL: str | None = None


def _array_literal(values: list) -> str:
    """A PostgreSQL array literal of one column: ``{1,NULL,2}``, built with one C-level join.

    Django's psycopg cursor binds parameters client-side, dumping arrays element by element in
    Python; one string per column is several times cheaper. Only integers (clamped above) and
    timestamps in ISO form get here, none of which needs escaping.
    """
    return "{" + ",".join(["NULL" if v is None else str(v) for v in values]) + "}"


def _nested_literal(rows: list[list | None]) -> str:
    """A text[] literal whose elements are the per-GPU array literals of each row (cast in SQL)."""
    return "{" + ",".join(["NULL" if r is None else '"' + _array_literal(r) + '"' for r in rows]) + "}"


def _upsert_unnest(node: Node, rows: list[RawRow]) -> dict[datetime, int]:
    """PostgreSQL: one statement that merges ``rows`` into the table and returns the GPU masks stored before."""
    global _UPSERT_SQL
    if _UPSERT_SQL is None:
        _UPSERT_SQL = _upsert_sql()
    # Times as ISO text converted by Python, exactly as the GPU's ``last_sample_at`` and the ORM
    # path convert them (PostgreSQL's to_timestamp() rounds some microseconds the other way).
    times = _array_literal([row.time.isoformat() for row in rows])
    params = [times, _array_literal([row.gpus for row in rows]),
              *[_nested_literal([row.column(name) for row in rows]) for name in RAW_COLUMNS], node.pk, times, node.pk]
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT_SQL, params)
        return dict(cursor.fetchall())


# --- events ---------------------------------------------------------------------------------------

class ForeignGeneration(Exception):
    """An event names a generation of a job that is not placed on the reporting node (a 403)."""


def record_agent_events(node: Node, events: list[tuple[wire.AgentEvent, object]]) -> Ingested:
    """Store the agent's events (each with its validated detail); act on and signal the new ones.

    An agent speaks only for its own node: if one event names a generation of an existing job
    that is not placed on ``node``, the whole batch is refused (``ForeignGeneration``) and nothing
    of it is stored or acted on. A key already stored for the node is a replay: counted, not stored
    or signalled again. The node row is locked for the batch so that two deliveries of the same
    batch cannot both count an event as new: ``FOR NO KEY UPDATE``, which another transaction's
    foreign-key check (``FOR KEY SHARE``) does not wait for. With ``FOR UPDATE`` a hang verdict that
    had locked the job and named this node in its incident, and this batch waiting at commit for its
    own check on that job, deadlocked (bench.fleet, 1,024 nodes, 2026-12-06: an HTTP 500 and a
    failed sweep).
    """
    unique: dict[str, tuple[wire.AgentEvent, object]] = {}
    for i, (event, detail) in enumerate(events):
        check_range(event.generation, f"events.{i}.generation")
        unique.setdefault(event.key, (event, detail))
    _refuse_foreign(node, [event for event, _ in events])
    now = timezone.now()
    with transaction.atomic():
        Node.objects.select_for_update(no_key=True).filter(pk=node.pk).values_list("pk", flat=True).first()
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
               evidence={"reasons": [f"GPU {detail.gpu}: critical Xid {detail.code}"], "xid": dump(detail),
                         "fault_at": at.timestamp()})


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
