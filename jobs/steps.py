"""Reading the step reports back: the one query for a job's recent step times.

A step's time is the sum of the phases its rank reported (``agents.protocol.hooks.PHASES``), or of
the ``phases`` named. Rank 0 speaks for the job: the ranks of a synchronous job step together.
"""

from __future__ import annotations

from collections.abc import Iterable

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

