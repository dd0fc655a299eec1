"""Verbs that change jobs. Views parse and authorise, then call one of these."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import IntegerField, Max, Q, Value
from django.db.models.functions import Cast, Coalesce, Greatest
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
from checkpoints.policies import CheckpointPolicy
from core.events import EventKind, record_event
from core.models import Event
from jobs import state
from jobs.choices import GenerationState, JobState
from jobs.models import Generation, Incident, Job, StepMetric, TrainingEvent
from jobs.policies import RecoveryPolicy


@transaction.atomic
def launch_job(spec: dict, *, actor: str) -> Job:
    """Record a validated job spec as a pending job. Placement and the first generation follow."""
    job = Job.objects.create(created_by=actor, **spec)
    record_event(EventKind.JOB_LAUNCH, actor=actor, job=job, new_state=job.state, generation=0,
                 evidence={"spec": spec})

    def enqueue():
        from jobs.tasks import start_job_task

        start_job_task.delay(job.pk, actor)

    transaction.on_commit(enqueue)
    return job


def cancel_job(job: Job, *, actor: str, reason: str) -> Job:
    """Cancel a job that has not ended, and stop whatever of its generation still runs."""
    from jobs.orchestrator import stop_generation

    with transaction.atomic():
        cancelled = state.transition(job, JobState.CANCELLED, actor=actor, reason=reason).job
        stop_generation(cancelled, reason=f"cancelled: {reason}")
    return cancelled


# --- what the training hooks report ---------------------------------------------------------

#: A generation whose ranks report no step for this long (when the policy sets no timeout and
#: there is no step history yet) is considered hung.
DEFAULT_PROGRESS_TIMEOUT_S = 120
#: With step history, the timeout is this many median step times, but never below the floor.
PROGRESS_TIMEOUT_STEPS = 20
PROGRESS_TIMEOUT_FLOOR_S = 15
#: Hook events that mean the generation's ranks are past restoring their checkpoint (or found none
#: and start from scratch), i.e. the training loop is about to run: ``resumed`` once a checkpoint
#: is loaded, and ``model``, which every process reports right after that point whether it
#: resumed or not (``agents.hooks.api.Hooks.__init__``). Both come from rank 0.
LOOP_STARTING_EVENTS = frozenset({"resumed", "model"})
#: The states in which the hang sweep watches the progress deadline.
PROGRESS_WATCHED = (JobState.INITIALIZING, JobState.RUNNING)


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int


def progress_timeout_s(job: Job, step_seconds: list[float]) -> float:
    """How long the job may go without a new step before it counts as hung."""
    configured = RecoveryPolicy.of(job).progress_timeout_s
    if configured:
        return float(configured)
    if not step_seconds:
        return float(DEFAULT_PROGRESS_TIMEOUT_S)
    return max(PROGRESS_TIMEOUT_FLOOR_S, PROGRESS_TIMEOUT_STEPS * statistics.median(step_seconds))


def record_reports(job: Job, batch: hooks_protocol.ReportBatch, *, actor: str) -> IngestResult:
    """Store a batch of step reports and hook events; advance the job's progress marks.

    1. Refuse a stale generation (the fencing token), and every generation of a job that ended.
    2. Insert what is new; (job, generation, rank, step) and (job, generation, key) already stored
       are duplicates of a replay and are counted, not stored again.
    3. Move the progress deadline, and mark the generation's first step (a generation that
       reports its first step is running).
    """
    state.check_live(job, batch.generation)
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
        if any(e.kind in LOOP_STARTING_EVENTS for e in fresh_events):
            end_startup(job, batch.generation, now)
        if fresh:
            _advance_progress(job, batch.generation, fresh, now, actor=actor)
    return IngestResult(accepted=len(fresh), duplicates=len(batch.reports) - len(fresh))


def end_startup(job: Job, generation: int, now) -> bool:
    """The generation's ranks have restored (or started from scratch): bring the progress deadline
    forward to ``now`` + the progress timeout; returns whether it moved.

    The start-up allowance set at launch (``jobs.launching.startup_timeout_s``) covers process
    start, rendezvous and the restore; once those are over, a missing first step is a hang like
    any other, and waiting out the rest of the start-up allowance only delays its detection.
    Compare-and-set: only the current generation's deadline moves (an event of a generation
    fenced off meanwhile changes nothing), only in a state the hang sweep watches, and only
    earlier (or from unset), never later.
    """
    deadline = now + timedelta(seconds=progress_timeout_s(job, _earlier_step_seconds(job, generation)))
    moved = (Job.objects.filter(pk=job.pk, generation=generation, state__in=PROGRESS_WATCHED)
             .filter(Q(progress_deadline__isnull=True) | Q(progress_deadline__gt=deadline))
             .update(progress_deadline=deadline))
    return bool(moved)


def _earlier_step_seconds(job: Job, generation: int) -> list[float]:
    """Rank 0's recent step times in the newest earlier generation that trained (the starting
    one has none yet), for a progress timeout derived from them; none when the policy sets it."""
    if RecoveryPolicy.of(job).progress_timeout_s:
        return []
    previous = (Generation.objects.filter(job=job, number__lt=generation, first_step_at__isnull=False)
                .order_by("-number").values_list("number", flat=True).first())
    if previous is None:
        return []
    recent = (StepMetric.objects.filter(job=job, generation=previous, rank=0)
              .order_by("-step").values_list("phases", flat=True)[:50])
    return [sum(p.values()) for p in recent if p]


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
        from jobs.orchestrator import record_first_step

        record_first_step(job, generation)
    _raise_flags(job, generation, fresh)


def _raise_flags(job: Job, generation: int, fresh: list) -> None:
    """Hand NaN, spike runs and cross-rank disagreements to the orchestrator (after commit)."""
    nan = any(r.nan or not math.isfinite(r.loss) for r in fresh)
    inconsistent = any(r.inconsistent for r in fresh)
    spikes = 0
    if any(r.spike for r in fresh):
        # The run of consecutive spiking steps (any rank) that ends at the newest step.
        flags = (StepMetric.objects.filter(job=job, generation=generation).values("step")
                 .annotate(spiked=Max(Cast("spike", IntegerField()))).order_by("-step")
                 .values_list("spiked", flat=True)[:1000])
        for spiked in flags:
            if not spiked:
                break
            spikes += 1
    if nan or inconsistent or spikes >= RecoveryPolicy.of(job).loss_spike_limit:
        detail = None
        if inconsistent:
            event = TrainingEvent.objects.filter(job=job, generation=generation, kind="inconsistency").last()
            detail = {"step": event.step, **event.detail} if event else {"note": "flagged by a step report"}

        def enqueue():
            from jobs.tasks import handle_flags

            handle_flags.delay(job.pk, generation, nan=nan, spikes=spikes, inconsistent=detail)

        transaction.on_commit(enqueue)


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
    """What a running generation should do next (polled by the hooks). Stale: an older generation,
    or any generation of a job that has ended (the hooks stop on it)."""
    interval = job.recommended_interval_steps if CheckpointPolicy.of(job).interval == "auto" else None
    return hooks_protocol.Control(
        generation=job.generation,
        stale=generation != job.generation or job.state in JobState.TERMINAL,
        checkpoint_now=job.checkpoint_requested_at is not None,
        pause=job.pause_requested_at is not None,
        checkpoint_interval_steps=interval,
    )


# --- operator and on-call verbs ----------------------------------------------------------------

def start_job(job: Job, *, actor: str):
    """Launch a pending job's first generation (or pause it until nodes are free)."""
    from jobs.launching import start_generation

    return start_generation(job, actor=actor, reason="first launch", restart=False)


def request_checkpoint(job: Job, *, actor: str, reason: str) -> Job:
    """Ask the running generation for a checkpoint now (before risky maintenance, say).

    ``control_for`` answers ``checkpoint_now`` until a checkpoint committed after the request clears
    the field (``checkpoints.services.registry``). The state is checked in the update itself, so a
    job that stops running meanwhile is refused rather than left with a request nobody will answer.
    """
    with transaction.atomic():
        asked = Job.objects.filter(pk=job.pk, state=JobState.RUNNING).update(checkpoint_requested_at=timezone.now())
        job.refresh_from_db()
        if not asked:
            raise state.TransitionConflict(f"job {job.pk} is {job.state}; only a running job can checkpoint now")
        record_event(EventKind.JOB_CHECKPOINT_REQUEST, actor=actor, job=job, generation=job.generation,
                     reason=f"checkpoint requested: {reason}", evidence={"last_step": job.last_step})
    return job


def pause_job(job: Job, *, actor: str, reason: str) -> Job:
    """Ask the running generation to checkpoint and exit; the job is paused once all ranks are gone.

    The hooks see ``pause`` on their next control poll, commit a checkpoint and exit with
    EXIT_PAUSED; if they have not by the quiesce deadline, the agents stop them.
    """
    from django.conf import settings

    with transaction.atomic():
        state.transition(job, JobState.QUIESCING, actor=actor, reason=f"pause requested: {reason}",
                         expect_state=JobState.ACTIVE - {JobState.QUIESCING})
        now = timezone.now()
        Job.objects.filter(pk=job.pk).update(
            pause_requested_at=now, quiesce_deadline=now + timedelta(seconds=settings.NIGHTWATCH["QUIESCE_TIMEOUT_S"])
        )
    job.refresh_from_db()
    return job


def _require_quiesced(job: Job, force: bool) -> None:
    from jobs.orchestrator import all_stopped, stop_generation

    generation = Generation.objects.filter(job=job, number=job.generation).first()
    if all_stopped(generation) or force:
        return
    stop_generation(job, reason="resume requested: stopping what is left of the old generation")
    missing = sorted(set(generation.nodes.values_list("hostname", flat=True)) - set(generation.stopped_nodes))
    raise state.TransitionConflict(
        f"job {job.pk}: {', '.join(missing)} have not confirmed that generation {generation.number} stopped; "
        "resuming now could run two generations at once (split brain). Stop commands were sent again; retry "
        "once the nodes confirm, or pass force=true if those nodes are known to be dead."
    )


def approve_resume(job: Job, *, actor: str, reason: str, force: bool = False):
    """On-call approves resuming a paused job from its latest verified checkpoint.

    The circuit breaker's window restarts from now. Refused while any node of the old
    generation has not confirmed its ranks stopped, unless ``force``.
    """
    from jobs.launching import Resume, start_generation

    if job.state != JobState.PAUSED:
        raise state.TransitionConflict(f"job {job.pk} is {job.state}; only a paused job can be resumed")
    _require_quiesced(job, force)
    resume = Resume(reason=f"resume approved: {reason}", evidence={"force": force},
                    updates={"breaker_reset_at": timezone.now(), "relaunch_after": None})
    return start_generation(job, actor=actor, reason=f"resume approved by {actor}", restart=True, resume=resume)


def rollback_to(job: Job, checkpoint, *, actor: str, reason: str, skip_data: tuple[int, int] | None = None,
                force: bool = False):
    """Resume a paused job from an earlier verified checkpoint, starting a new lineage branch.

    ``skip_data=(start, end)`` skips that global sample range on the new branch (as PaLM's team
    skipped the batches around a loss spike); it is recorded with the branch.
    """
    from checkpoints.services import verified_copy
    from jobs.launching import Resume, start_generation

    if checkpoint.job_id != job.pk:
        raise state.TransitionConflict(f"checkpoint {checkpoint.pk} belongs to another job")
    if job.state != JobState.PAUSED:
        raise state.TransitionConflict(f"job {job.pk} is {job.state}; pause it before rolling back")
    served = verified_copy(checkpoint, actor=actor)  # the primary, or its verified replica
    if served is None:
        checkpoint.refresh_from_db()
        raise state.TransitionConflict(f"checkpoint {checkpoint.pk} failed verification: {checkpoint.state_reason}")
    if skip_data is not None and not (0 <= skip_data[0] < skip_data[1]):
        raise state.TransitionConflict("skip_data must be a range [start, end) with 0 <= start < end")
    _require_quiesced(job, force)
    ranges = list(job.skip_data) + ([list(skip_data)] if skip_data else [])
    resume = Resume(reason=f"rollback to step {checkpoint.step}: {reason}",
                    evidence={"checkpoint": checkpoint.pk, "skip_data": list(skip_data) if skip_data else None},
                    updates={"branch_root": checkpoint, "branch_since_generation": job.generation + 1,
                             "skip_data": ranges, "breaker_reset_at": timezone.now(), "relaunch_after": None})
    return start_generation(job, actor=actor, reason=f"rollback to step {checkpoint.step}", restart=True,
                            resume_from=served, resume=resume)


# --- goodput --------------------------------------------------------------------------------

def goodput_of(job: Job, *, now=None):
    """The job's ETTR and badput by kind, from recorded facts (``jobs.goodput.compute``).

    Wall time runs from the first generation's start to now (or to the end of a finished job);
    paused time inside an incident is taken from the job's ``paused`` state events.
    """
    from django.db.models import Sum

    from checkpoints.models import Checkpoint
    from jobs.goodput import Goodput, IncidentTimes, compute

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
    phases = StepMetric.objects.filter(job=job, rank=0).order_by("-received_at").values_list("phases", flat=True)
    step_times = [sum(p.values()) for p in phases[:200] if p]
    blocking = Checkpoint.objects.filter(job=job).aggregate(s=Sum("blocking_s"))["s"] or 0.0
    return compute(started_at=first.started_at, now=end, first_step_at=first.first_step_at, incidents=incidents,
                   median_step_s=statistics.median(step_times) if step_times else 0.0,
                   checkpoint_blocking_s=blocking)


def _paused_spans(job: Job, end) -> list[tuple]:
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
