"""Fixtures of the dashboard tests: the shared cast signed in, and a job in the states pages show."""

from __future__ import annotations

import pytest


@pytest.fixture
def signed_in(client):
    """``signed_in(user, csrf=False)`` -> a test client with that person's session."""
    from django.test import Client

    def make(user, *, csrf: bool = False):
        c = Client(enforce_csrf_checks=csrf)
        c.force_login(user)
        return c

    return make


BREAKER_REASON = "5 automatic restarts inside the window reached the budget of 5: circuit breaker open"


def pause_for_breaker(job, *, start: bool = True, reason: str = BREAKER_REASON):
    """Start ``job`` on gpu-01 and open the breaker as the orchestrator does: an incident, then
    ``paused`` with the reason; the old generation's processes are confirmed gone."""
    from jobs import services, state
    from jobs.choices import Decision, IncidentKind, JobState
    from jobs.models import Generation, Incident

    if start:
        services.start_job(job, actor="test")
    job.refresh_from_db()
    Incident.objects.create(job=job, kind=IncidentKind.RETRY_STORM, decision=Decision.PAUSE,
                            classification=reason, evidence={"restarts_in_window": 5, "max_restarts": 5})
    state.transition(job, JobState.PAUSED, actor="system:orchestrator", reason=reason, pause_reason=reason)
    Generation.objects.filter(job=job, number=job.generation).update(stopped_nodes=["gpu-01"])
    job.refresh_from_db()
    return job
