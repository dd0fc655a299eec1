"""Verbs that change jobs. Views parse and authorise, then call one of these."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
from jobs import state
from jobs.choices import GenerationState, JobState
from jobs.models import Event, Generation, Job, StepMetric, TrainingEvent


@transaction.atomic
def launch_job(spec: dict, *, actor: str) -> Job:
    """Record a validated job spec as a pending job. Placement and the first generation follow."""
    job = Job.objects.create(created_by=actor, **spec)
    Event.objects.create(kind="job.launch", actor=actor, job=job, new_state=job.state, generation=0,
                         evidence={"spec": spec})
    return job


def cancel_job(job: Job, *, actor: str, reason: str) -> Job:
    """Cancel a job that has not ended. Stopping its processes is the orchestrator's part."""
    return state.transition(job, JobState.CANCELLED, actor=actor, reason=reason).job


# --- what the training hooks report ---------------------------------------------------------

#: A generation whose ranks report no step for this long (when the policy sets no timeout and
#: there is no step history yet) is considered hung.
DEFAULT_PROGRESS_TIMEOUT_S = 120
#: With step history, the timeout is this many median step times, but never below the floor.
PROGRESS_TIMEOUT_STEPS = 20
PROGRESS_TIMEOUT_FLOOR_S = 15


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int
    events_accepted: int


def progress_timeout_s(job: Job, step_seconds: list[float]) -> float:
    """How long the job may go without a new step before it counts as hung."""
    configured = (job.recovery_policy or {}).get("progress_timeout_s")
    if configured:
        return float(configured)
    if not step_seconds:
        return float(DEFAULT_PROGRESS_TIMEOUT_S)
    return max(PROGRESS_TIMEOUT_FLOOR_S, PROGRESS_TIMEOUT_STEPS * statistics.median(step_seconds))


def record_reports(job: Job, batch: hooks_protocol.ReportBatch, *, actor: str) -> IngestResult:
    """Store a batch of step reports and hook events; advance the job's progress marks.

    1. Refuse a stale generation (the fencing token).
    2. Insert what is new; (job, generation, rank, step) and (job, generation, key) already stored
       are duplicates of a replay and are counted, not stored again.
    3. Move the progress deadline, and mark the generation's first step (a generation that
       reports its first step is running).
    """
    state.check_generation(job, batch.generation)
    now = timezone.now()
    with transaction.atomic():
        reports = {(r.rank, r.step): r for r in batch.reports}
        known = set(
            StepMetric.objects.filter(job=job, generation=batch.generation, step__in={s for _, s in reports})
            .values_list("rank", "step")
        )
        fresh = [r for key, r in reports.items() if key not in known]
        StepMetric.objects.bulk_create(
            [_step_metric(job, r, now) for r in fresh], ignore_conflicts=True, batch_size=500
        )
        events = {e.key: e for e in batch.events}
        known_keys = set(
            TrainingEvent.objects.filter(job=job, generation=batch.generation, key__in=list(events))
            .values_list("key", flat=True)
        )
        fresh_events = [e for key, e in events.items() if key not in known_keys]
        TrainingEvent.objects.bulk_create(
            [TrainingEvent(job=job, generation=e.generation, rank=e.rank, step=e.step, kind=e.kind, key=e.key,
                           message=e.message, detail=e.detail, reported_at=_utc(e.time), received_at=now)
             for e in fresh_events],
            ignore_conflicts=True,
        )
        if fresh:
            _advance_progress(job, batch.generation, fresh, now, actor=actor)
    return IngestResult(accepted=len(fresh), duplicates=len(batch.reports) - len(fresh),
                        events_accepted=len(fresh_events))


def _advance_progress(job: Job, generation: int, fresh: list, now, *, actor: str) -> None:
    last = max(fresh, key=lambda r: r.step)
    recent = list(
        StepMetric.objects.filter(job=job, generation=generation, rank=0)
        .order_by("-step").values_list("phases", flat=True)[:50]
    )
    step_seconds = [sum(p.values()) for p in recent if p]
    deadline = now + timedelta(seconds=progress_timeout_s(job, step_seconds))
    Job.objects.filter(pk=job.pk, generation=generation).update(
        last_step=Greatest(Coalesce("last_step", Value(last.step)), Value(last.step)),
        last_step_at=now,
        progress_deadline=deadline,
    )
    first = min(fresh, key=lambda r: r.step)
    Generation.objects.filter(job=job, number=generation, first_step_at__isnull=True).update(
        first_step=first.step, first_step_at=now, state=GenerationState.RUNNING
    )
    if job.state == JobState.INITIALIZING:
        try:
            state.transition(job, JobState.RUNNING, actor=actor, generation=generation,
                             expect_state=JobState.INITIALIZING, reason=f"first step {first.step} reported")
        except state.TransitionConflict:
            pass  # another batch of the same generation got there first


def _step_metric(job: Job, r: hooks_protocol.StepReport, now) -> StepMetric:
    finite = math.isfinite(r.loss)
    return StepMetric(
        job=job, generation=r.generation, rank=r.rank, step=r.step,
        loss=r.loss if finite else None,
        grad_norm=r.grad_norm if r.grad_norm is not None and math.isfinite(r.grad_norm) else None,
        world_size=r.world_size, data_cursor=r.data_cursor, samples=r.samples, tokens=r.tokens,
        phases=r.phases, skipped=r.skipped, spike=r.spike, nan=r.nan or not finite,
        inconsistent=r.inconsistent, reported_at=_utc(r.time), received_at=now,
    )


def _utc(epoch: float):
    return datetime.fromtimestamp(epoch, tz=UTC)


def control_for(job: Job, generation: int) -> hooks_protocol.Control:
    """What a running generation should do next (polled by the hooks)."""
    policy = job.checkpoint_policy or {}
    interval = job.recommended_interval_steps if policy.get("interval") == "auto" else None
    return hooks_protocol.Control(
        generation=job.generation,
        stale=generation != job.generation,
        checkpoint_now=job.checkpoint_requested_at is not None,
        pause=job.pause_requested_at is not None,
        checkpoint_interval_steps=interval,
    )
