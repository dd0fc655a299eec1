"""Verbs that change jobs. Views parse and authorise, then call one of these."""

from __future__ import annotations

from django.db import transaction

from jobs import state
from jobs.choices import JobState
from jobs.models import Event, Job


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
