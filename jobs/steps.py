"""Reading the step reports back: the one query for a job's recent step times; and how long the
rank timings (``NodeWindow``) are kept.

A step's time is the sum of the phases its rank reported (``agents.protocol.hooks.PHASES``), or of
the ``phases`` named. Rank 0 speaks for the job: the ranks of a synchronous job step together.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from jobs.models import Job, NodeWindow, StepMetric

#: Hours node windows are kept unless ``NIGHTWATCH["NODE_WINDOW_RETENTION_HOURS"]`` says otherwise.
NODE_WINDOW_RETENTION_HOURS = 48

#: How many of the newest steps a median of "recent step times" reads, unless told otherwise.
RECENT_STEPS = 50


def recent_step_seconds(job: Job | int, *, generation: int | None = None, limit: int = RECENT_STEPS,
                        phases: Iterable[str] | None = None, rank: int | None = 0) -> list[float]:
    """The seconds of ``rank``'s newest ``limit`` steps (any rank when None), newest first: of
    ``generation``, or of the newest generations when None. Reports without phases are skipped
    (after the limit: an old report with no phases does not pull an older step in)."""
    rows = StepMetric.objects.filter(job=job)
    if generation is not None:
        rows = rows.filter(generation=generation)
    if rank is not None:
        rows = rows.filter(rank=rank)
    recent = rows.order_by("-generation", "-step").values_list("phases", flat=True)[:limit]
    if phases is None:
        return [sum(p.values()) for p in recent if p]
    names = tuple(phases)
    return [sum(float(p.get(name, 0.0)) for name in names) for p in recent if p]


def prune_node_windows() -> int:
    """Delete node windows received before the retention period; returns how many. One DELETE on
    the ``received_at`` index (nothing refers to a window, so Django does not load them first)."""
    hours = settings.NIGHTWATCH.get("NODE_WINDOW_RETENTION_HOURS", NODE_WINDOW_RETENTION_HOURS)
    deleted, _ = NodeWindow.objects.filter(received_at__lt=timezone.now() - timedelta(hours=hours)).delete()
    return deleted
