"""Operator and on-call verbs that change jobs. Views parse and authorise, then call one of these.

What the training hooks report is ``jobs.ingest``; progress deadlines are ``jobs.progress``; faults
and recoveries are ``jobs.orchestrator``, which these verbs call (never the other way round).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from checkpoints.services import verified_copy
from core.events import EventKind, record_event
from jobs import state
from jobs.choices import IncidentState, JobState
from jobs.launching import Resume, start_generation
from jobs.models import Generation, Incident, Job
from jobs.orchestrator import all_stopped, resolve_incident, stop_generation


@transaction.atomic
def launch_job(spec: dict, *, actor: str) -> Job:
    """Record a validated job spec as a pending job. Placement and the first generation follow."""
    job = Job.objects.create(created_by=actor, **spec)
    record_event(EventKind.JOB_LAUNCH, actor=actor, job=job, new_state=job.state, generation=0,
                 evidence={"spec": spec})

    # Deferred: jobs.tasks sits above the verbs (its start_job_task runs start_job below) and
    # imports this module at its top, so importing it here at module level would be a cycle.
    from jobs.tasks import start_job_task

    transaction.on_commit(lambda: start_job_task.delay(job.pk, actor))
    return job


def cancel_job(job: Job, *, actor: str, reason: str) -> Job:
    """Cancel a job that has not ended, and stop whatever of its generation still runs.

    Its open incidents are over too: nothing will recover from them. Each is resolved and logged
    (``incident.resolved`` by the canceller), so no page stays open for a job nobody runs."""
    with transaction.atomic():
        cancelled = state.transition(job, JobState.CANCELLED, actor=actor, reason=reason).job
        stop_generation(cancelled, reason=f"cancelled: {reason}")
        now = timezone.now()
        for incident in Incident.objects.filter(job=cancelled, state=IncidentState.OPEN).select_related("generation"):
            resolve_incident(incident, now=now, actor=actor, reason=f"job cancelled: {reason}")
    return cancelled


def start_job(job: Job, *, actor: str):
    """Launch a pending job's first generation (or pause it until nodes are free)."""
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
    with transaction.atomic():
        state.transition(job, JobState.QUIESCING, actor=actor, reason=f"pause requested: {reason}",
                         expect_state=JobState.ACTIVE - {JobState.QUIESCING})
        now = timezone.now()
        Job.objects.filter(pk=job.pk).update(
            pause_requested_at=now, quiesce_deadline=now + timedelta(seconds=settings.NIGHTWATCH["QUIESCE_TIMEOUT_S"])
        )
    job.refresh_from_db()
    return job


def resize_job(job: Job, *, nnodes: int, nproc_per_node: int, actor: str, reason: str) -> Job:
    """Change the job's world size: ``nnodes`` × ``nproc_per_node`` from its next generation on.

    A running job pauses as ``pause_job`` does (the hooks commit a checkpoint and exit) and, once
    every rank is confirmed gone, resumes at once on the new shape from its newest checkpoint that
    re-verifies on disk (``advance_recovery``; no approval: nothing went wrong). A paused job stays
    paused and its next resume (approve, roll back) takes the new shape. The hooks' global sample
    cursor continues the sample stream exactly on any world size; the global batch (per-rank batch
    × ranks) changes with it. ``start_generation`` applies ``resize_to``; audited as ``job.resize``.
    """
    with transaction.atomic():
        current = Job.objects.select_for_update().get(pk=job.pk)
        if current.state not in (JobState.RUNNING, JobState.PAUSED):
            raise state.TransitionConflict(f"job {job.pk} is {current.state}; only a running or paused job can be "
                                           "resized")
        if current.resize_to and current.state != JobState.PAUSED:
            raise state.TransitionConflict(f"job {job.pk} is already being resized to "
                                           f"{current.resize_to['nnodes']}×{current.resize_to['nproc_per_node']}")
        target = {"nnodes": nnodes, "nproc_per_node": nproc_per_node}
        record_event(EventKind.JOB_RESIZE, actor=actor, job=current, generation=current.generation,
                     reason=f"resize to {nnodes} node(s) × {nproc_per_node} process(es): {reason}",
                     evidence={"old_nnodes": current.nnodes, "old_nproc_per_node": current.nproc_per_node,
                               **target, "last_step": current.last_step, "state": current.state})
        Job.objects.filter(pk=job.pk).update(resize_to=target)
        if current.state == JobState.RUNNING:
            state.transition(current, JobState.QUIESCING, actor=actor, expect_state=JobState.RUNNING,
                             reason=f"resize to {nnodes}×{nproc_per_node} requested: pausing at a checkpoint")
            now = timezone.now()
            Job.objects.filter(pk=job.pk).update(
                pause_requested_at=now,
                quiesce_deadline=now + timedelta(seconds=settings.NIGHTWATCH["QUIESCE_TIMEOUT_S"]))
    job.refresh_from_db()
    return job


def _require_quiesced(job: Job, force: bool) -> None:
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
