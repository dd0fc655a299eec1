"""The restart budget after an approved retry storm, a cancel with incidents open, and the status
endpoint's incidents (issue 24, item 4).

An approval used to grant the whole budget again, so a storm that still raged ran five more
restarts and paged again; a cancel left every incident open; ``/status`` showed each incident's
generation as null.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from jobs import orchestrator, services
from jobs.choices import IncidentState, JobState
from jobs.models import Event, Incident, Job


@pytest.fixture
def job(cast):
    job = Job.objects.create(name="stormy", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test",
                             recovery_policy={"max_restarts": 4, "window_minutes": 600, "backoff_seconds": 0,
                                              "clean_run_minutes": 60})
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def crash(job) -> Incident:
    job.refresh_from_db()
    orchestrator.handle_exit(job.pk, job.generation, "gpu-01",
                             {"exit_code": 1, "signature": "signal", "ranks": [{"rank": 1, "signal": 9}]})
    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    return Incident.objects.filter(job=job).order_by("-pk").first()


def restarts_until_the_breaker_opens(job) -> int:
    """Crash the job until the breaker opens; returns how many automatic restarts it was allowed."""
    for restarts in range(20):
        incident = crash(job)
        if incident.kind == "retry_storm":
            assert job.state == JobState.PAUSED and incident.evidence["max_restarts"] == restarts
            return restarts
        assert incident.decision == "restart"
    raise AssertionError("the breaker never opened")


@pytest.mark.django_db
def test_each_approved_storm_halves_the_budget_until_the_job_runs_clean(cast, job):
    assert restarts_until_the_breaker_opens(job) == 4
    services.approve_resume(job, actor="user:olga", reason="looked at it")
    assert restarts_until_the_breaker_opens(job) == 2  # half
    services.approve_resume(job, actor="user:olga", reason="again")
    assert restarts_until_the_breaker_opens(job) == 1  # a quarter
    storm = Incident.objects.filter(job=job, kind="retry_storm").order_by("-pk").first()
    assert "reached the budget of 1" in storm.classification
    services.approve_resume(job, actor="user:olga", reason="third time")
    assert restarts_until_the_breaker_opens(job) == 1  # never below one

    # Approved, and then an hour (clean_run_minutes) without a restart: the whole budget is back.
    services.approve_resume(job, actor="user:olga", reason="fixed the switch")
    with time_machine.travel(timezone.now() + timedelta(minutes=61)):
        assert restarts_until_the_breaker_opens(job) == 4


@pytest.mark.django_db
def test_a_cancel_resolves_every_open_incident_and_logs_each(cast, job):
    restarts_until_the_breaker_opens(job)
    open_ids = set(Incident.objects.filter(job=job, state=IncidentState.OPEN).values_list("pk", flat=True))
    assert len(open_ids) == 5  # four crashes never followed by a first step, and the storm
    services.cancel_job(job, actor="user:otto", reason="giving up on this config")
    assert not Incident.objects.filter(job=job, state=IncidentState.OPEN).exists()
    resolved = Event.objects.filter(kind="incident.resolved", job=job)
    assert {e.evidence["incident"] for e in resolved} == open_ids
    assert {(e.actor, e.reason) for e in resolved} == {("user:otto", "job cancelled: giving up on this config")}


@pytest.mark.django_db
def test_status_shows_each_incidents_generation(cast, job, api):
    crash(job)
    crash(job)
    body = api(cast.tokens["viewer"]).get(f"/api/v1/jobs/{job.pk}/status").json()
    assert [(i["generation"], i["kind"]) for i in body["recent_incidents"]] == [(2, "crash"), (1, "crash")]
