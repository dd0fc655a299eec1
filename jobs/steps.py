"""Reading the step reports back: the one query for a job's recent step times.

A step's time is the sum of the phases its rank reported (``agents.protocol.hooks.PHASES``), or of
the ``phases`` named. Rank 0 speaks for the job: the ranks of a synchronous job step together.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from django.db import connection

from jobs.models import Job, StepMetric

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


def recent_step_seconds_of(jobs: Iterable[int], *, limit: int = RECENT_STEPS) -> dict[int, list[float]]:
    """``recent_step_seconds`` of rank 0 in each job's newest generations, by job, in no particular
    order (for medians): one query where the database can (PostgreSQL: a ``UNION ALL`` of each
    job's index scan), one a job where it cannot (SQLite)."""
    found: dict[int, list[float]] = {job: [] for job in jobs}
    per_job = [StepMetric.objects.filter(job=job, rank=0).order_by("-generation", "-step")
               .values_list("job", "phases")[:limit] for job in found]
    if not per_job:
        return found
    if connection.features.supports_slicing_ordering_in_compound:
        rows: Iterable[tuple[int, dict]] = per_job[0].union(*per_job[1:], all=True)
    else:
        rows = itertools.chain.from_iterable(per_job)
    for job, phases in rows:
        if phases:
            found[job].append(sum(phases.values()))
    return found
