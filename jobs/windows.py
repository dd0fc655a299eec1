"""How long node windows (``NodeWindow``, rank timings per node and window) are kept.

On PostgreSQL the table is range-partitioned by ``reported_at``, an hour a partition, with the
raw telemetry's machinery (``nodes.services.partitions``): partitions are created from the
retention cutoff to six hours ahead and dropped whole once past it, so retention is a catalogue
change, not a delete. Elsewhere (SQLite) old rows are deleted in bulk. A window whose exchange is
already older than the retention is not stored (``jobs.ingest``): it would land in the default
partition, which nothing drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from jobs.models import NodeWindow
from nodes.services import partitions

SCHEME = partitions.Scheme(NodeWindow._meta.db_table, "reported_at", timedelta(hours=1), ahead=6)
#: Hours node windows are kept unless ``NIGHTWATCH["NODE_WINDOW_RETENTION_HOURS"]`` says otherwise.
DEFAULT_RETENTION_HOURS = 48


@dataclass(frozen=True)
class Maintained:
    created: int = 0  # partitions
    dropped: int = 0  # partitions
    deleted: int = 0  # rows (SQLite)


def cutoff(now: datetime | None = None) -> datetime:
    """Windows reported before this are past their retention."""
    hours = settings.NIGHTWATCH.get("NODE_WINDOW_RETENTION_HOURS", DEFAULT_RETENTION_HOURS)
    return (now or timezone.now()) - timedelta(hours=hours)


def maintain(now: datetime | None = None) -> Maintained:
    """Create the partitions from the cutoff to some hours ahead and drop (or, without partitions,
    delete) what is past the retention."""
    now = now or timezone.now()
    oldest = cutoff(now)
    if partitions.partitioned():
        return Maintained(created=partitions.ensure(SCHEME, since=oldest, now=now),
                          dropped=partitions.drop_before(SCHEME, oldest))
    deleted, _ = NodeWindow.objects.filter(reported_at__lt=oldest).delete()
    return Maintained(deleted=deleted)
