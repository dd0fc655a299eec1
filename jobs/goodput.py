"""A job's goodput from what was recorded: ``goodput_of`` gathers the facts, ``jobs.goodput_math``
(pure, type-checked) does the accounting."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime

from django.db.models import OuterRef, Q, Subquery, Sum
from django.utils import timezone

from checkpoints.models import Checkpoint
from core.events import EventKind
from core.models import Event
from jobs.choices import JobState
from jobs.goodput_math import Goodput, IncidentTimes, compute
from jobs.models import Generation, Incident, Job
from jobs.steps import recent_step_seconds_of

#: How many of the newest steps the median step time (the price of a lost step) reads.
STEP_SAMPLES = 200
#: A running job without a step for longer than this many median step times (and at least
#: ``STALL_FLOOR_S``, which covers the hooks' 1 s report batching and the way to us) is stalled:
#: the stretch counts as badput while it lasts (``goodput_math.compute``, point 5).
STALL_STEPS = 3
STALL_FLOOR_S = 3.0


def goodput_of(job: Job, *, now: datetime | None = None) -> Goodput:
    """The job's ETTR and badput by kind, from recorded facts (``jobs.goodput_math.compute``).

    Wall time runs from the first generation's start to now (or to the end of a finished job);
    paused time inside an incident is taken from the job's ``paused`` state events.
    """
    return goodputs_of([job], now=now)[job.pk]


def goodputs_of(jobs: Sequence[Job], *, now: datetime | None = None) -> dict[int, Goodput]:
    """``goodput_of`` for each of ``jobs``, by primary key, in a fixed number of queries however many
    jobs there are: the overview shows 50, and five queries a job made it the slowest page of a
    1,024-node fleet (bench.fleet, 2026-12-06: 1.26 s under load for 23 jobs)."""
    now = now or timezone.now()
    ids = [job.pk for job in jobs]
    firsts = {g.job_id: g for g in Generation.objects.filter(
        job__in=ids, number=Subquery(Generation.objects.filter(job=OuterRef("job")).order_by("number")
                                     .values("number")[:1]))}
    started = [job for job in jobs if job.pk in firsts]
    ends = {job.pk: job.state_changed_at if job.is_terminal else now for job in started}
    paused = _paused_spans([job.pk for job in started], ends)
    incidents: dict[int, list[IncidentTimes]] = defaultdict(list)
    for i in Incident.objects.filter(job__in=ends).exclude(decision="alert").order_by("pk"):
        end = ends[i.job_id]
        incidents[i.job_id].append(IncidentTimes(
            fault_at=i.fault_at, detected_at=i.detected_at, first_step_at=i.first_step_at, lost_steps=i.lost_steps,
            paused_s=sum(_overlap(span, (i.detected_at, i.first_step_at or end)) for span in paused[i.job_id])))
    step_times = recent_step_seconds_of(list(ends), limit=STEP_SAMPLES)
    blocking = dict(Checkpoint.objects.filter(job__in=ends).order_by().values("job")
                    .annotate(s=Sum("blocking_s")).values_list("job", "s"))
    figures = {job.pk: Goodput(wall_s=0.0, productive_s=0.0, badput_s={}) for job in jobs}
    for job in started:
        median_step_s = statistics.median(step_times[job.pk]) if step_times[job.pk] else 0.0
        first = firsts[job.pk]
        figures[job.pk] = compute(
            started_at=first.started_at, now=ends[job.pk], first_step_at=first.first_step_at,
            incidents=incidents[job.pk], median_step_s=median_step_s, checkpoint_blocking_s=blocking.get(job.pk) or 0.0,
            last_step_at=job.last_step_at if job.state == JobState.RUNNING else None,
            stall_grace_s=max(STALL_FLOOR_S, STALL_STEPS * median_step_s))
    return figures


def _paused_spans(job_ids: list[int], ends: dict[int, datetime]) -> dict[int, list[tuple[datetime, datetime]]]:
    """Each job's (entered, left) of every stay in ``paused``, from the state events (a stay not
    left yet runs to the job's end)."""
    spans: dict[int, list[tuple[datetime, datetime]]] = defaultdict(list)
    entered: dict[int, datetime] = {}
    moves = (Event.objects.filter(job__in=job_ids, kind=EventKind.JOB_STATE)
             .filter(Q(new_state=JobState.PAUSED) | Q(old_state=JobState.PAUSED))
             .order_by("job", "created_at", "pk").values_list("job", "created_at", "old_state", "new_state"))
    for job_id, at, old, new in moves:
        if new == JobState.PAUSED and job_id not in entered:
            entered[job_id] = at
        elif old == JobState.PAUSED and job_id in entered:
            spans[job_id].append((entered.pop(job_id), at))
    for job_id, at in entered.items():
        spans[job_id].append((at, ends[job_id]))
    return spans


def _overlap(a: tuple, b: tuple) -> float:
    return max(0.0, (min(a[1], b[1]) - max(a[0], b[0])).total_seconds())
