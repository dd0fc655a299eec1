"""The job state machine — the only code that changes ``Job.state`` and ``Job.generation``.

    pending → initializing → running
                              running → quiescing → recovering → initializing (next generation)
    any live state → paused (circuit breaker or operator) → recovering (approve / rollback)
    any non-terminal state → failed | cancelled;  running → completed

Every (re)start enters ``initializing`` and bumps ``generation``: that number is the fencing token
that reports, checkpoints and agent commands must carry. A transition is a compare-and-set on
(state, generation) inside a transaction with the row locked, and appends one ``Event`` row. Two
racing transitions cannot both win: the loser sees the row changed and gets ``TransitionConflict``.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from core.events import EventKind, record_event
from core.models import Event
from core.tokens import retire_job_tokens
from jobs.choices import JobState as S
from jobs.models import Job

ALLOWED: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.INITIALIZING, S.PAUSED, S.CANCELLED, S.FAILED}),
    S.INITIALIZING: frozenset({S.RUNNING, S.QUIESCING, S.PAUSED, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.QUIESCING, S.PAUSED, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.QUIESCING: frozenset({S.RECOVERING, S.PAUSED, S.FAILED, S.CANCELLED}),
    S.RECOVERING: frozenset({S.INITIALIZING, S.PAUSED, S.FAILED, S.CANCELLED}),
    S.PAUSED: frozenset({S.RECOVERING, S.FAILED, S.CANCELLED}),
    S.FAILED: frozenset(),
    S.COMPLETED: frozenset(),
    S.CANCELLED: frozenset(),
}

#: Entering one of these starts a new generation.
STARTS_GENERATION = frozenset({S.INITIALIZING})


class TransitionError(Exception):
    """Base class; ``http_status`` is what the API answers."""

    http_status = 409


class IllegalTransition(TransitionError):
    def __init__(self, job_id: int, old: str, new: str):
        allowed = ", ".join(sorted(ALLOWED.get(old, ()))) or "none (terminal state)"
        super().__init__(f"job {job_id}: cannot go from {old} to {new}; allowed from {old}: {allowed}")
        self.old, self.new = old, new


class StaleGeneration(TransitionError):
    def __init__(self, job_id: int, given: int, current: int):
        super().__init__(f"job {job_id}: generation {given} is stale; the active generation is {current}")
        self.given, self.current = given, current


class JobEnded(TransitionError):
    """The job is cancelled, failed or completed: none of its generations may report any more."""

    def __init__(self, job_id: int, current_state: str):
        super().__init__(f"job {job_id} is {current_state}: its generations are stale")
        self.state = current_state


class TransitionConflict(TransitionError):
    """Someone else changed the job between our read and our write."""


@dataclass(frozen=True)
class Transition:
    job: Job
    event: Event
    old_state: str
    new_generation: bool


def check_live(job: Job, generation: int | None) -> None:
    """``check_generation``, and refuse a job that has ended (``JobEnded``)."""
    check_generation(job, generation)
    if job.state in S.TERMINAL:
        raise JobEnded(job.pk, job.state)


def check_generation(job: Job, generation: int | None) -> None:
    """Raise ``StaleGeneration`` unless ``generation`` is None or the job's active one."""
    if generation is not None and generation != job.generation:
        raise StaleGeneration(job.pk, generation, job.generation)


def transition(
    job: Job | int,
    new_state: str,
    *,
    actor: str,
    reason: str = "",
    evidence: dict | None = None,
    expect_state: str | frozenset[str] | None = None,
    generation: int | None = None,
    restart: bool = False,
    **fields,
) -> Transition:
    """Move a job to ``new_state``, or raise.

    1. Lock the row and re-read it (the caller's copy may be stale).
    2. Refuse a stale ``generation`` (fencing), an unexpected current state (``expect_state``),
       and any move the table above does not allow.
    3. Compare-and-set: update only if state and generation are still what we read.
    4. Append the event row in the same transaction.

    ``restart=True`` counts the move as a restart (recovery or approved resume). Extra keyword
    ``fields`` (e.g. ``pause_reason``) are saved with the transition.
    """
    job_id = job.pk if isinstance(job, Job) else job
    with transaction.atomic():
        current = Job.objects.select_for_update().get(pk=job_id)
        check_generation(current, generation)
        if expect_state is not None:
            expected = {expect_state} if isinstance(expect_state, str) else set(expect_state)
            if current.state not in expected:
                raise TransitionConflict(
                    f"job {job_id} is {current.state}, expected {' or '.join(sorted(expected))}"
                )
        if new_state not in ALLOWED.get(current.state, ()):
            raise IllegalTransition(job_id, current.state, new_state)

        now = timezone.now()
        new_generation = new_state in STARTS_GENERATION
        changes = {"state": new_state, "state_changed_at": now, **fields}
        if new_generation:
            changes["generation"] = current.generation + 1
            changes["last_step_at"] = None
            changes["progress_deadline"] = None
        if restart:
            changes["restart_count"] = current.restart_count + 1
        if new_state != S.PAUSED and "pause_reason" not in fields:
            changes["pause_reason"] = ""
        won = Job.objects.filter(pk=job_id, state=current.state, generation=current.generation).update(**changes)
        if won != 1:
            raise TransitionConflict(f"job {job_id} changed while transitioning to {new_state}")
        event = record_event(
            EventKind.JOB_STATE,
            actor=actor,
            job=job_id,
            generation=changes.get("generation", current.generation),
            old_state=current.state,
            new_state=new_state,
            reason=reason,
            evidence=evidence or {},
            created_at=now,
        )
        if new_state in S.TERMINAL:
            retire_job_tokens(job_id)
        old_state = current.state
        for name, value in changes.items():
            setattr(current, name, value)
    if isinstance(job, Job):
        for name, value in changes.items():
            setattr(job, name, value)
    return Transition(job=current, event=event, old_state=old_state, new_generation=new_generation)
