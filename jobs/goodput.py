"""A job's goodput from what was recorded: ``goodput_of`` gathers the facts, ``jobs.goodput_math``
(pure, type-checked) does the accounting."""

from __future__ import annotations

import statistics
from datetime import datetime

from django.db.models import Sum
from django.utils import timezone

from checkpoints.models import Checkpoint
from core.events import EventKind
from core.models import Event
from jobs.choices import JobState
from jobs.goodput_math import Goodput, IncidentTimes, compute
from jobs.models import Generation, Incident, Job
from jobs.steps import recent_step_seconds

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
    first = Generation.objects.filter(job=job).order_by("number").first()
    if first is None:
        return Goodput(wall_s=0.0, productive_s=0.0, badput_s={})
    end = job.state_changed_at if job.is_terminal else (now or timezone.now())
    paused = _paused_spans(job, end)
    incidents = [
        IncidentTimes(fault_at=i.fault_at, detected_at=i.detected_at, first_step_at=i.first_step_at,
                      lost_steps=i.lost_steps,
                      paused_s=sum(_overlap(span, (i.detected_at, i.first_step_at or end)) for span in paused))
        for i in Incident.objects.filter(job=job).exclude(decision="alert")
    ]
    step_times = recent_step_seconds(job, limit=STEP_SAMPLES)
    median_step_s = statistics.median(step_times) if step_times else 0.0
    blocking = Checkpoint.objects.filter(job=job).aggregate(s=Sum("blocking_s"))["s"] or 0.0
    return compute(started_at=first.started_at, now=end, first_step_at=first.first_step_at, incidents=incidents,
                   median_step_s=median_step_s, checkpoint_blocking_s=blocking,
                   last_step_at=job.last_step_at if job.state == JobState.RUNNING else None,
                   stall_grace_s=max(STALL_FLOOR_S, STALL_STEPS * median_step_s))


def _paused_spans(job: Job, end: datetime) -> list[tuple[datetime, datetime]]:
    """(entered, left) of every stay in ``paused``, from the state events."""
    spans, entered = [], None
    for event in Event.objects.filter(job=job, kind=EventKind.JOB_STATE).order_by("created_at", "pk"):
        if event.new_state == JobState.PAUSED and entered is None:
            entered = event.created_at
        elif event.old_state == JobState.PAUSED and entered is not None:
            spans.append((entered, event.created_at))
            entered = None
    if entered is not None:
        spans.append((entered, end))
    return spans


def _overlap(a: tuple, b: tuple) -> float:
    return max(0.0, (min(a[1], b[1]) - max(a[0], b[0])).total_seconds())
