"""1-minute rollups of the raw GPU telemetry (``NodeGpuMinute``), and the utilisation reader that uses both.

Raw samples are kept for hours, rollups for months. A minute is always recomputed from its raw
rows and upserted on the (node, minute) key, never added to, so writing it again — beat
running twice, a late batch — gives the same rows.

1. Beat (every minute) rolls up the ``LOOKBACK`` that closed: a batch that arrives up to ``LATE``
   late is counted by a later run.
2. A batch later than that (an agent replaying its spool after an outage) re-rolls the minutes
   it covers, for its own node only (``ingest`` calls ``roll_up``).

PostgreSQL rolls up in one ``INSERT … SELECT`` over the unnested per-GPU arrays; SQLite (the
embedded demo) aggregates the same rows in Python. A test holds the two to the same result.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import datetime, timedelta

from django.db import connection
from django.utils import timezone

from nodes.models import NodeGpuMinute, NodeGpuSample

MINUTE = timedelta(minutes=1)
#: How far back each beat run recomputes closed minutes (agents send every 10 s: a few minutes is ample).
LOOKBACK = timedelta(minutes=5)
#: A batch with samples older than this re-rolls its minutes itself: beat, a minute apart, may not
#: cover them again after the batch commits (two runs of margin).
LATE = LOOKBACK - 2 * MINUTE
#: Rolled-up gauges: raw column -> rollup column prefix (each gets _min, _mean, _max).
GAUGES = {"temperature_c": "temperature", "utilization_pct": "utilization", "memory_used_mib": "memory_used_mib",
          "power_w": "power"}
#: Error counts (each raw sample holds the GPU's new errors since the sample before): summed.
COUNTERS = ("xid_errors", "ecc_uncorrected_errors", "nvlink_errors")
ROLLUP_FIELDS = ("samples", *(f"{prefix}_{stat}" for prefix in GAUGES.values() for stat in ("min", "mean", "max")),
                 *COUNTERS)


def floor_minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def roll_up_recent(*, now: datetime | None = None) -> int:
    """Beat: recompute the closed minutes of the last ``LOOKBACK``; returns how many node-minutes were written."""
    end = floor_minute(now or timezone.now())
    return roll_up(end - LOOKBACK, end)


def roll_up(start: datetime, end: datetime, *, node_id: int | None = None) -> int:
    """Recompute every minute in [``start``, ``end``) (of one node, or all); returns the node-minutes written.
    On PostgreSQL a minute that comes out as it was stored is not written again: beat recomputes each
    minute ``LOOKBACK`` times, and rewriting an unchanged row leaves a dead row version behind each
    time (the fleet benchmark measured the rollup table growing 3.3 KB per node-minute at 1,024 nodes,
    four times its live size, until vacuum)."""
    start, end = floor_minute(start), floor_minute(end - timedelta(microseconds=1)) + MINUTE
    if connection.vendor == "postgresql":
        return _roll_up_sql(start, end, node_id)
    return _roll_up_portable(start, end, node_id)


def _rollup_sql(by_node: bool) -> str:
    """1. unnest each raw row into (GPU, readings), leaving out positions of GPUs the row lacks;
    2. aggregate per node, minute and GPU; 3. fold the GPUs of a node-minute back into arrays by
    GPU index (``generate_series`` keeps a silent GPU's place as NULL); 4. upsert."""
    quote = connection.ops.quote_name
    arrays = [*GAUGES, *COUNTERS]
    names = [f"v{i}" for i in range(len(arrays))]
    per_gpu = ["count(*) AS samples"]
    folded = ["array_agg(g.samples ORDER BY pos)"]
    for name, prefix in zip(names, GAUGES.values(), strict=False):
        per_gpu += [f"min(r.{name}) AS {prefix}_min", f"avg(r.{name}) AS {prefix}_mean",
                    f"max(r.{name}) AS {prefix}_max"]
        folded += [f"array_agg(g.{prefix}_{stat} ORDER BY pos)" for stat in ("min", "mean", "max")]
    for name, counter in zip(names[len(GAUGES):], COUNTERS, strict=True):
        per_gpu.append(f"sum(r.{name}) AS {counter}")
        folded.append(f"CASE WHEN coalesce(max(g.{counter}), 0) = 0 THEN NULL "
                      f"ELSE array_agg(g.{counter} ORDER BY pos) END")
    columns = ["node_id", "minute", "gpus", *ROLLUP_FIELDS]
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns[2:])
    node_filter = " AND s.node_id = %s" if by_node else ""
    table = quote(NodeGpuMinute._meta.db_table)
    # Identifiers come from this module's constants and the models' metadata, values are parameters.
    return (
        f"WITH r AS (SELECT s.node_id, date_trunc('minute', s.time) AS minute, x.* "  # noqa: S608
        f"FROM {quote(NodeGpuSample._meta.db_table)} s CROSS JOIN LATERAL "
        f"unnest({', '.join('s.' + quote(a) for a in arrays)}) WITH ORDINALITY AS x({', '.join(names)}, i) "
        f"WHERE s.time >= %s AND s.time < %s AND s.gpus & (1::bigint << (x.i - 1)::int) <> 0{node_filter}), "
        f"g AS (SELECT node_id, minute, i, {', '.join(per_gpu)} FROM r GROUP BY node_id, minute, i), "
        f"n AS (SELECT node_id, minute, max(i) AS gpus FROM g GROUP BY node_id, minute) "
        f"INSERT INTO {table} ({', '.join(columns)}) "
        f"SELECT n.node_id, n.minute, bit_or(CASE WHEN g.i IS NULL THEN 0 ELSE 1::bigint << (g.i - 1)::int END), "
        f"{', '.join(folded)} FROM n CROSS JOIN LATERAL generate_series(1, n.gpus) AS pos "
        f"LEFT JOIN g ON g.node_id = n.node_id AND g.minute = n.minute AND g.i = pos "
        f"GROUP BY n.node_id, n.minute "
        f"ON CONFLICT (node_id, minute) DO UPDATE SET {updates} "
        f"WHERE ({', '.join(f'{table}.{c}' for c in columns[2:])}) IS DISTINCT FROM "
        f"({', '.join(f'EXCLUDED.{c}' for c in columns[2:])})"
    )


def _roll_up_sql(start: datetime, end: datetime, node_id: int | None) -> int:
    with connection.cursor() as cursor:
        cursor.execute(_rollup_sql(node_id is not None), [start, end] + ([node_id] if node_id is not None else []))
        return cursor.rowcount


def _roll_up_portable(start: datetime, end: datetime, node_id: int | None) -> int:
    rows = NodeGpuSample.objects.filter(time__gte=start, time__lt=end)
    if node_id is not None:
        rows = rows.filter(node_id=node_id)
    # (node, minute) -> GPU -> column -> readings
    readings: dict[tuple, dict[int, dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for row in rows.order_by():
        for gpu in range(row.gpus.bit_length()):
            if row.gpus >> gpu & 1:
                seen = readings[(row.node_id, floor_minute(row.time))][gpu]
                seen["samples"].append(1)
                for column in (*GAUGES, *COUNTERS):
                    values = getattr(row, column) or []
                    if gpu < len(values) and values[gpu] is not None:
                        seen[column].append(values[gpu])
    minutes = [NodeGpuMinute(node_id=node, minute=minute, **_fold(gpus)) for (node, minute), gpus in readings.items()]
    NodeGpuMinute.objects.bulk_create(minutes, update_conflicts=True, unique_fields=["node", "minute"],
                                      update_fields=["gpus", *ROLLUP_FIELDS], batch_size=200)
    return len(minutes)


def _fold(gpus: dict[int, dict[str, list]]) -> dict:
    """Per-GPU statistics, as the arrays of one ``NodeGpuMinute`` (NULL at a GPU without samples)."""
    width = max(gpus) + 1
    stats: dict[str, list] = {name: [None] * width for name in ROLLUP_FIELDS}
    for gpu, seen in gpus.items():
        stats["samples"][gpu] = len(seen["samples"])
        for column, prefix in GAUGES.items():
            values = seen[column]
            stats[f"{prefix}_min"][gpu] = min(values, default=None)
            stats[f"{prefix}_mean"][gpu] = statistics.fmean(values) if values else None
            stats[f"{prefix}_max"][gpu] = max(values, default=None)
        for column in COUNTERS:
            stats[column][gpu] = sum(seen[column]) if seen[column] else None
    for column in COUNTERS:
        if not any(stats[column]):
            stats[column] = None
    return stats | {"gpus": sum(1 << gpu for gpu in gpus)}


# --- readers --------------------------------------------------------------------------------------

def mean_utilization(node_ids: list[int], since: datetime, *, raw_since: datetime) -> float | None:
    """Mean GPU utilisation (percent) of ``node_ids`` since ``since``; None without samples.

    From the raw samples when they reach back that far (``raw_since``: the raw retention cutoff),
    else from the rollups, each minute's mean weighted by its samples.
    """
    if since >= raw_since:
        return _mean_of(NodeGpuSample, "time", "utilization_pct", None, node_ids, since)
    return _mean_of(NodeGpuMinute, "minute", "utilization_mean", "samples", node_ids, floor_minute(since))


def _mean_of(model, time_column: str, column: str, weights: str | None, node_ids: list[int],
             since: datetime) -> float | None:
    """The mean of a per-GPU column over the rows of ``node_ids`` since ``since`` (weighted by ``weights``)."""
    rows = model.objects.filter(node_id__in=node_ids, **{f"{time_column}__gte": since})
    if connection.vendor != "postgresql":
        total = weight = 0.0
        for values, counts in rows.values_list(column, weights or column):
            for value, count in zip(values or [], counts or [], strict=False):
                if value is not None:
                    count = count if weights else 1
                    total, weight = total + value * count, weight + count
        return total / weight if weight else None
    quote = connection.ops.quote_name
    weight = "x.w" if weights else "1"
    with connection.cursor() as cursor:
        # Identifiers come from the models' metadata and this module, never from a request.
        cursor.execute(
            f"SELECT sum(x.v * {weight}) / sum({weight}) FROM {quote(model._meta.db_table)} r, "  # noqa: S608
            f"unnest(r.{quote(column)}, r.{quote(weights or column)}) AS x(v, w) "
            f"WHERE r.node_id = ANY(%s) AND r.{quote(time_column)} >= %s AND x.v IS NOT NULL",
            [list(node_ids), since])
        mean = cursor.fetchone()[0]
    return float(mean) if mean is not None else None
