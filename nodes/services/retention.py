"""Telemetry retention: raw samples for hours, minute rollups for months, removed in bulk.

On PostgreSQL whole partitions are dropped (``nodes.services.partitions``): no row-by-row delete,
no dead tuples for vacuum to chase through a table that grows by ~2.8 GB a day at 1,024 nodes.
On SQLite (the embedded demo, a handful of nodes) one ``DELETE … WHERE time < cutoff`` per table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from nodes.models import NodeGpuMinute, NodeGpuSample
from nodes.services import partitions


@dataclass(frozen=True)
class Retention:
    """How long telemetry is kept (``NIGHTWATCH["TELEMETRY_RAW_RETENTION_HOURS"]``, ``…_ROLLUP_RETENTION_DAYS``)."""

    raw: timedelta
    rollups: timedelta

    def raw_cutoff(self, now: datetime) -> datetime:
        return now - self.raw

    def rollup_cutoff(self, now: datetime) -> datetime:
        return now - self.rollups


def retention() -> Retention:
    return Retention(raw=timedelta(hours=settings.NIGHTWATCH["TELEMETRY_RAW_RETENTION_HOURS"]),
                     rollups=timedelta(days=settings.NIGHTWATCH["TELEMETRY_ROLLUP_RETENTION_DAYS"]))


@dataclass(frozen=True)
class Pruned:
    """What one pass removed: partitions dropped (PostgreSQL) or rows deleted (elsewhere)."""

    partitions: int = 0
    rows: int = 0

    def __bool__(self) -> bool:
        return bool(self.partitions or self.rows)


def prune_telemetry(*, now: datetime | None = None) -> Pruned:
    """Remove raw samples and rollups older than their retention."""
    now = now or timezone.now()
    kept = retention()
    raw_cutoff, rollup_cutoff = kept.raw_cutoff(now), kept.rollup_cutoff(now)
    if partitions.partitioned():
        return Pruned(partitions=partitions.drop_before(partitions.RAW, raw_cutoff)
                      + partitions.drop_before(partitions.MINUTES, rollup_cutoff))
    raw, _ = NodeGpuSample.objects.filter(time__lt=raw_cutoff).delete()
    minutes, _ = NodeGpuMinute.objects.filter(minute__lt=rollup_cutoff).delete()
    return Pruned(rows=raw + minutes)


def prepare_partitions(*, now: datetime | None = None) -> int:
    """Create the partitions from each retention cutoff to some hours (raw) or days (rollups) ahead."""
    now = now or timezone.now()
    kept = retention()
    return (partitions.ensure(partitions.RAW, since=kept.raw_cutoff(now), now=now)
            + partitions.ensure(partitions.MINUTES, since=kept.rollup_cutoff(now), now=now))
