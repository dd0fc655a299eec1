"""``jobs.launching.startup_timeout_s``: how long a new generation may take to its first step,
from the job's policy, else its own history of starts, else the configured default."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import time_machine
from django.utils import timezone

from jobs import ingest, orchestrator, services
from jobs.launching import startup_timeout_s
from jobs.models import Generation, Job

T0 = datetime.fromisoformat("2026-11-30T12:00:00+00:00")


@pytest.fixture
def nightwatch(settings):
    """``nightwatch(KEY=value, …)`` overrides NIGHTWATCH settings for one test."""
    def override(**values):
        settings.NIGHTWATCH = {**settings.NIGHTWATCH, **values}
    return override


def generation(job, number, start_s: float | None, *, at=T0):
    """A finished earlier generation launched at ``at`` that took ``start_s`` to its first step
    (None: it never got there)."""
    return Generation.objects.create(
        job=job, number=number, world_size=2, started_at=at,
        first_step_at=at + timedelta(seconds=start_s) if start_s is not None else None,
        first_step=1 if start_s is not None else None, ended_at=at + timedelta(hours=1))


@pytest.mark.django_db
def test_without_history_the_configured_default_applies(cast, nightwatch):
    nightwatch(STARTUP_TIMEOUT_S=240, STARTUP_TIMEOUT_FLOOR_S=60)
    assert startup_timeout_s(cast.job) == 240
    generation(cast.job, 1, None)  # launched but never reached a first step: not a start to learn from
    assert startup_timeout_s(cast.job) == 240


@pytest.mark.django_db
def test_history_gives_three_times_the_slowest_start(cast, nightwatch):
    nightwatch(STARTUP_TIMEOUT_S=180, STARTUP_TIMEOUT_FLOOR_S=10)
    generation(cast.job, 1, 4)
    generation(cast.job, 2, 12.5, at=T0 + timedelta(hours=2))
    generation(cast.job, 3, None, at=T0 + timedelta(hours=4))  # hung while starting
    generation(cast.job, 4, 7, at=T0 + timedelta(hours=6))
    assert startup_timeout_s(cast.job) == pytest.approx(37.5)


@pytest.mark.django_db
def test_history_is_the_jobs_own(cast, nightwatch):
    nightwatch(STARTUP_TIMEOUT_S=180, STARTUP_TIMEOUT_FLOOR_S=10)
    other = Job.objects.create(name="slow-starter", entrypoint="examples/train.py", created_by="test")
    generation(other, 1, 600)
    generation(cast.job, 1, 5)
    assert startup_timeout_s(cast.job) == 15
    assert startup_timeout_s(other) == 1800


@pytest.mark.django_db
def test_quick_starts_are_held_to_the_floor(cast, nightwatch):
    nightwatch(STARTUP_TIMEOUT_S=180, STARTUP_TIMEOUT_FLOOR_S=60)
    generation(cast.job, 1, 3)
    generation(cast.job, 2, 19, at=T0 + timedelta(hours=2))
    assert startup_timeout_s(cast.job) == 60  # 3 × 19 = 57 < 60
    generation(cast.job, 3, 21, at=T0 + timedelta(hours=4))
    assert startup_timeout_s(cast.job) == 63


@pytest.mark.django_db
def test_the_policy_wins_over_history_and_default(cast, nightwatch):
    nightwatch(STARTUP_TIMEOUT_S=180, STARTUP_TIMEOUT_FLOOR_S=60)
    Job.objects.filter(pk=cast.job.pk).update(recovery_policy={"startup_timeout_s": 25})
    cast.job.refresh_from_db()
    assert startup_timeout_s(cast.job) == 25
    generation(cast.job, 1, 100)
    assert startup_timeout_s(cast.job) == 25
    Job.objects.filter(pk=cast.job.pk).update(recovery_policy={"startup_timeout_s": None})
    cast.job.refresh_from_db()
    assert startup_timeout_s(cast.job) == 300  # null: derived again


@pytest.mark.django_db
def test_it_costs_one_query(cast, django_assert_num_queries):
    for number in range(1, 30):
        generation(cast.job, number, number, at=T0 + timedelta(hours=2 * number))
    with django_assert_num_queries(1):
        startup_timeout_s(cast.job)


@pytest.mark.django_db
def test_a_relaunch_gets_a_deadline_from_the_jobs_first_start(cast, nightwatch):
    """Through the real launch path: generation 1 takes 12 s to its first step, crashes, and the
    relaunch's deadline is 3 × 12 s after it, not the 180 s default."""
    nightwatch(STARTUP_TIMEOUT_S=180, STARTUP_TIMEOUT_FLOOR_S=20)
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test",
                             recovery_policy={"max_restarts": 2, "window_minutes": 60, "backoff_seconds": 0,
                                              "allow_shrink": False, "progress_timeout_s": 30})
    with time_machine.travel(T0, tick=False) as clock:
        services.start_job(job, actor="test")
        job.refresh_from_db()
        assert job.generation == 1
        assert job.progress_deadline == T0 + timedelta(seconds=180)  # no history yet

        clock.shift(12)
        from agents.protocol import hooks as hooks_protocol

        ingest.record_reports(job, hooks_protocol.ReportBatch(job=str(job.pk), generation=1, reports=[
            hooks_protocol.StepReport(job=str(job.pk), generation=1, rank=0, step=1, loss=2.0, grad_norm=1.0,
                                      world_size=2, data_cursor=8, samples=4, time=timezone.now().timestamp())]),
            actor="test")
        assert Generation.objects.get(job=job, number=1).first_step_at == T0 + timedelta(seconds=12)

        clock.shift(60)
        orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": 1, "signature": "signal",
                                                       "ranks": [{"rank": 1, "signal": 9}]})
        assert orchestrator.advance_recovery(job.pk)  # quiescing -> recovering
        assert orchestrator.advance_recovery(job.pk)  # recovering -> initializing, generation 2
        job.refresh_from_db()
        assert job.generation == 2
        assert job.progress_deadline == timezone.now() + timedelta(seconds=36)
