"""Time-range partitions of the telemetry tables on PostgreSQL: created ahead, dropped whole.

Raw samples (``NodeGpuSample``) are partitioned by the hour and kept 48 h by default, so
retention drops a whole hour at a time (a catalogue change, no dead rows, no vacuum) and keeps
at most one hour more than asked for; the rollups (``NodeGpuMinute``) by the day, kept 90 days.
An hour of raw samples of 1,024 nodes is ~120 MB, small enough that the newest partition and
its key index stay in memory while agents write into it; ~55 hourly partitions are well within
what the planner prunes cheaply.

Every table has a DEFAULT partition, so an insert never fails for want of a range: a sample
from a clock far ahead lands there, and when its range is created the rows in the default
partition that belong to it are moved into the new partition in the same transaction (an
attach would otherwise fail on them). Ranges are created from the retention cutoff up to
``ahead`` ranges past now, so beat may stop for that long before samples start to land in the
default partition. Samples older than the raw retention are not stored at all (``ingest``),
so nothing in the default partition ever needs a row-by-row delete.

SQLite (the embedded demo) has no partitions: these functions do nothing there, and retention
deletes old rows in bulk (``nodes.services.retention``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import OperationalError, connection, transaction

log = logging.getLogger(__name__)
#: A lock wait longer than this gives up until the next run, rather than queue every insert
#: behind an attach or drop that waits for a long query.
LOCK_TIMEOUT = "5s"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Scheme:
    """How one table is partitioned: by ``column``, ``width`` a partition, ``ahead`` ranges made early."""

    table: str
    column: str
    width: timedelta
    ahead: int

    def floor(self, at: datetime) -> datetime:
        return _EPOCH + (at - _EPOCH) // self.width * self.width

    def name(self, start: datetime) -> str:
        return f"{self.table}_p{start:%Y%m%d%H}"

    @property
    def default(self) -> str:
        return f"{self.table}_default"


RAW = Scheme("nodes_nodegpusample", "time", timedelta(hours=1), ahead=6)
MINUTES = Scheme("nodes_nodegpuminute", "minute", timedelta(days=1), ahead=2)


def partitioned() -> bool:
    return connection.vendor == "postgresql"


def partitions(scheme: Scheme) -> dict[str, tuple[datetime, datetime]]:
    """The range partitions of ``scheme``'s table by name, with their bounds (the default one left out)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass", [scheme.table])
        rows = cursor.fetchall()
    bounds = {}
    for name, bound in rows:
        if bound == "DEFAULT":
            continue
        start, end = (datetime.fromisoformat(part.split("'")[1]) for part in bound.split(" TO "))
        bounds[name] = (start, end)
    return bounds


def ensure(scheme: Scheme, *, since: datetime, now: datetime) -> int:
    """Create the missing partitions from the one holding ``since`` to ``ahead`` past ``now``; returns how many."""
    if not partitioned():
        return 0
    have = {start for start, _ in partitions(scheme).values()}
    start, last = scheme.floor(since), scheme.floor(now) + scheme.ahead * scheme.width
    created = 0
    while start <= last:
        if start not in have and _create(scheme, start):
            created += 1
        start += scheme.width
    return created


def _create(scheme: Scheme, start: datetime) -> bool:
    """One partition, attached after the default partition's rows of its range moved into it."""
    table, name, column = (connection.ops.quote_name(n) for n in (scheme.table, scheme.name(start), scheme.column))
    default = connection.ops.quote_name(scheme.default)
    # Literals, not parameters: DDL takes none. Both are datetimes formatted here, never input.
    low, high = f"'{start.isoformat()}'", f"'{(start + scheme.width).isoformat()}'"
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            cursor.execute(f"LOCK TABLE {default} IN ACCESS EXCLUSIVE MODE")
            # Constraints too: ATTACH requires the parent's CHECKs (a positive integer column has one).
            cursor.execute(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
            cursor.execute(f"WITH moved AS (DELETE FROM {default} WHERE {column} >= {low} AND {column} < {high} "  # noqa: S608
                           f"RETURNING *) INSERT INTO {name} SELECT * FROM moved")
            if cursor.rowcount:
                log.info("moved %d rows of %s from the default partition into %s", cursor.rowcount, scheme.table, name)
            cursor.execute(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({low}) TO ({high})")
    except OperationalError as error:  # the lock timeout: the next run tries again
        log.warning("partition %s not created this time: %s", scheme.name(start), error)
        return False
    return True


def drop_before(scheme: Scheme, cutoff: datetime) -> int:
    """Drop every partition whose whole range is older than ``cutoff``; returns how many."""
    if not partitioned():
        return 0
    dropped = 0
    for name, (_, end) in sorted(partitions(scheme).items(), key=lambda item: item[1]):
        if end > cutoff:
            break
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                cursor.execute(f"DROP TABLE {connection.ops.quote_name(name)}")
        except OperationalError as error:
            log.warning("partition %s not dropped this time: %s", name, error)
            break
        dropped += 1
    return dropped
