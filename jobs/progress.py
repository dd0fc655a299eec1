"""Progress deadlines: how long a generation may go without a new step, and what moves the deadline.

    launch ─▶ start-up allowance (jobs.launching.startup_timeout_s)
    "resumed"/"model" from rank 0 ─▶ end_startup: now + progress timeout (only ever earlier)
    every new step ─▶ advance_progress: now + progress timeout
    contact back after a fleet silence ─▶ restart_after_silence: now + at least the heartbeat grace
    its reports refused by admission control ─▶ expire_one_progress_deadline: last refusal + timeout
    deadline passed ─▶ expire_one_progress_deadline: a hang, for the orchestrator and the policy

The progress timeout (``progress_timeout_s``) is the one rule for all of them: the policy's
``progress_timeout_s`` when set, else ``PROGRESS_TIMEOUT_STEPS`` median step times (never below
``PROGRESS_TIMEOUT_FLOOR_S``), else ``DEFAULT_PROGRESS_TIMEOUT_S`` while there is no step history.
A new generation starts with no deadline (``jobs.state``) until its launch sets the allowance.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timedelta

from django.db.models import Q, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from core import refusals
from jobs import policy, state
from jobs.choices import GenerationState, JobState
from jobs.models import Generation, Job
from jobs.orchestrator import record_first_step, report_fault
from jobs.policies import RecoveryPolicy
from jobs.steps import recent_step_seconds
from nodes.services import overload, silence

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


def progress_timeout_s(job: Job, step_seconds: list[float]) -> float:
    """How long the job may go without a new step before it counts as hung."""
    configured = RecoveryPolicy.of(job).progress_timeout_s
    if configured:
        return float(configured)
    if not step_seconds:
        return float(DEFAULT_PROGRESS_TIMEOUT_S)
    return max(PROGRESS_TIMEOUT_FLOOR_S, PROGRESS_TIMEOUT_STEPS * statistics.median(step_seconds))


def end_startup(job: Job, generation: int, now: datetime) -> bool:
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
    return recent_step_seconds(job, generation=previous)


def advance_progress(job: Job, generation: int, first: int, last: int, now: datetime, *, actor: str) -> None:
    """Steps ``first``..``last`` of ``generation`` are newly reported: the deadline moves to ``now``
    + the progress timeout, and a generation reporting its first step is running (its job too, and
    the incidents it recovered from are over)."""
    deadline = now + timedelta(seconds=progress_timeout_s(job, recent_step_seconds(job, generation=generation)))
    Job.objects.filter(pk=job.pk, generation=generation).update(
        last_step=Greatest(Coalesce("last_step", Value(last)), Value(last)),
        last_step_at=now,
        progress_deadline=deadline,
    )
    Generation.objects.filter(job=job, number=generation, first_step_at__isnull=True).update(
        first_step=first, first_step_at=now, state=GenerationState.RUNNING
    )
    if job.state == JobState.INITIALIZING:
        try:
            state.transition(job, JobState.RUNNING, actor=actor, generation=generation,
                             expect_state=JobState.INITIALIZING, reason=f"first step {first} reported")
        except state.TransitionConflict:
            pass  # another batch of the same generation got there first
        record_first_step(job, generation)


def _spare_refused(job: Job, now: datetime) -> bool:
    """Move ``job``'s progress deadline past the last refusal of its generation's reports, if any
    fell within its progress timeout; returns whether the job was spared (a report that moved the
    deadline meanwhile wins the compare-and-set: spared all the same)."""
    timeout = timedelta(seconds=progress_timeout_s(job, recent_step_seconds(job, generation=job.generation)))
    refused = refusals.refused_since(timeout.total_seconds(), now=now)
    last = refused.generations.get((job.pk, job.generation)) if refused is not None else None
    if last is None or last + timeout <= now:
        return False
    Job.objects.filter(pk=job.pk, progress_deadline=job.progress_deadline).update(progress_deadline=last + timeout)
    return True


def restart_after_silence(now: datetime, *, grace: timedelta) -> int:
    """Contact is back after a fleet silence: progress deadlines that ran out (or would within
    ``grace``) while nobody could reach us start over, at ``now`` + the progress timeout and never
    sooner than ``grace`` (the hooks' buffered reports need time to arrive). Returns how many moved.
    Compare-and-set on each deadline, so a report that moved one meanwhile wins."""
    moved = 0
    for job in Job.objects.filter(state__in=PROGRESS_WATCHED, progress_deadline__lt=now + grace):
        timeout = timedelta(seconds=progress_timeout_s(job, recent_step_seconds(job, generation=job.generation)))
        moved += Job.objects.filter(pk=job.pk, progress_deadline=job.progress_deadline).update(
            progress_deadline=now + max(grace, timeout))
    return moved


def expire_one_progress_deadline() -> bool:
    """The first job past its progress deadline is reported as hung; returns whether one was.
    Nothing is while the fleet is silent or the control plane answers heartbeats late: the reports
    may be stuck on our side (see ``nodes.services.silence`` and ``nodes.services.overload``). A job
    whose hooks admission control refused within its progress timeout was heard trying: a refused
    report counts as one that arrived, and its deadline moves a timeout past the last refusal."""
    if silence.held() or overload.holding():
        return False
    now = timezone.now()
    job = (Job.objects.filter(state__in=PROGRESS_WATCHED, progress_deadline__lt=now)
           .order_by("progress_deadline").first())
    if job is None:
        return False
    if _spare_refused(job, now):
        return True
    incident = report_fault(job.pk, policy.HANG, generation=job.generation, step=job.last_step,
                            fault_at=job.last_step_at or job.state_changed_at,
                            detail={"last_step": job.last_step, "progress_deadline": job.progress_deadline.isoformat()})
    if incident is None:  # fenced off: clear the deadline so we do not spin on it
        Job.objects.filter(pk=job.pk, progress_deadline=job.progress_deadline).update(progress_deadline=None)
    return True

