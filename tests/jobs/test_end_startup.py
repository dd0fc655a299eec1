"""Once the hooks report that a generation's ranks restored (or started from scratch), a missing
first step is a hang like any other: the progress deadline moves to now + the progress timeout —
for the current generation only, and never later. Exercised through the hooks' reports endpoint."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
import time_machine
from django.conf import settings
from django.utils import timezone

from agents.protocol import hooks as hooks_protocol
from jobs import ingest, progress, state
from jobs.choices import JobState
from jobs.models import Generation, Incident, Job, StepMetric, TrainingEvent

T0 = datetime.fromisoformat("2026-11-30T12:00:00+00:00")


def launched(cast, *, progress_timeout_s=None, startup=timedelta(seconds=180)):
    """cast.job, generation ``job.generation + 1`` just launched on node1 with the start-up deadline."""
    Job.objects.filter(pk=cast.job.pk).update(recovery_policy={"progress_timeout_s": progress_timeout_s})
    cast.job.refresh_from_db()
    moved = state.transition(cast.job, JobState.INITIALIZING, actor="test",
                             expect_state=frozenset({JobState.PENDING, JobState.RECOVERING}))
    number = moved.job.generation
    generation = Generation.objects.create(job=cast.job, number=number, world_size=2, started_at=timezone.now())
    generation.nodes.add(cast.node1)
    Job.objects.filter(pk=cast.job.pk).update(progress_deadline=timezone.now() + startup)
    cast.job.refresh_from_db()
    return number


def event(job, generation, kind, step=0, key=None):
    return {"job": str(job.pk), "generation": generation, "rank": 0, "step": step, "kind": kind,
            "key": key or f"0:0:{step}:{kind}:0", "message": kind, "detail": {}, "time": time.time()}


def post(api, cast, generation, events=(), reports=()):
    body = {"job": str(cast.job.pk), "generation": generation, "reports": list(reports), "events": list(events)}
    return api(cast.tokens["agent"]).post(f"/api/v1/jobs/{cast.job.pk}/reports", body, format="json")


def deadline(job):
    return Job.objects.get(pk=job.pk).progress_deadline


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["resumed", "model"])
def test_restore_or_scratch_start_brings_the_deadline_to_the_progress_timeout(cast, api, kind):
    with time_machine.travel(T0, tick=False) as clock:
        number = launched(cast, progress_timeout_s=10)
        assert deadline(cast.job) == T0 + timedelta(seconds=180)
        clock.shift(7)  # processes started, rendezvous done, checkpoint restored
        response = post(api, cast, number, [event(cast.job, number, kind)])
        assert response.status_code == 202, response.content
        assert deadline(cast.job) == T0 + timedelta(seconds=7 + 10)


@pytest.mark.django_db
def test_other_events_leave_the_startup_deadline(cast, api):
    with time_machine.travel(T0, tick=False):
        number = launched(cast, progress_timeout_s=10)
        response = post(api, cast, number, [event(cast.job, number, "checkpoint_rejected")])
        assert response.status_code == 202, response.content
        assert deadline(cast.job) == T0 + timedelta(seconds=180)


@pytest.mark.django_db
def test_the_deadline_is_never_extended(cast, api):
    with time_machine.travel(T0, tick=False):
        number = launched(cast, progress_timeout_s=120, startup=timedelta(seconds=30))
        post(api, cast, number, [event(cast.job, number, "model")])
        assert deadline(cast.job) == T0 + timedelta(seconds=30)


@pytest.mark.django_db
def test_an_unset_deadline_is_set(cast, api):
    with time_machine.travel(T0, tick=False):
        number = launched(cast, progress_timeout_s=10)
        Job.objects.filter(pk=cast.job.pk).update(progress_deadline=None)
        post(api, cast, number, [event(cast.job, number, "resumed")])
        assert deadline(cast.job) == T0 + timedelta(seconds=10)


@pytest.mark.django_db
def test_a_stale_generations_event_is_refused_and_moves_nothing(cast, api):
    with time_machine.travel(T0, tick=False):
        old = launched(cast, progress_timeout_s=10)
        state.transition(cast.job, JobState.RUNNING, actor="test")
        state.transition(cast.job, JobState.QUIESCING, actor="test")
        state.transition(cast.job, JobState.RECOVERING, actor="test")
        new = launched(cast, progress_timeout_s=10)
        assert new == old + 1
        response = post(api, cast, old, [event(cast.job, old, "resumed")])
        assert response.status_code == 409
        assert deadline(cast.job) == T0 + timedelta(seconds=180)
        assert not TrainingEvent.objects.filter(job=cast.job).exists()


@pytest.mark.django_db
def test_an_event_that_loses_the_race_with_a_new_generation_moves_nothing(cast):
    """The generation check passed on the job as read, then the generation moved on before the
    update: the compare-and-set on the generation keeps the new generation's deadline."""
    with time_machine.travel(T0, tick=False):
        old = launched(cast, progress_timeout_s=10)
        as_read = Job.objects.get(pk=cast.job.pk)
        state.transition(cast.job, JobState.RUNNING, actor="test")
        state.transition(cast.job, JobState.QUIESCING, actor="test")
        state.transition(cast.job, JobState.RECOVERING, actor="test")
        launched(cast, progress_timeout_s=10)
        batch = hooks_protocol.ReportBatch(job=str(cast.job.pk), generation=old, events=[
            hooks_protocol.Event(**event(cast.job, old, "resumed"))])
        ingest.record_reports(as_read, batch, actor="test")
        assert deadline(cast.job) == T0 + timedelta(seconds=180)
        assert not progress.end_startup(as_read, old, timezone.now())


@pytest.mark.django_db
def test_a_replayed_event_does_not_pull_a_running_generations_deadline_back(cast, api):
    with time_machine.travel(T0, tick=False) as clock:
        number = launched(cast, progress_timeout_s=10)
        restored = event(cast.job, number, "resumed")
        post(api, cast, number, [restored])
        clock.shift(5)
        # The first step pushes the deadline on; the spool replays the event with a later batch.
        step = {"job": str(cast.job.pk), "generation": number, "rank": 0, "step": 1, "loss": 2.0, "grad_norm": 1.0,
                "world_size": 2, "data_cursor": 8, "samples": 4, "phases": {}, "time": time.time()}
        post(api, cast, number, reports=[step])
        # From the step's own time, one progress sweep early (jobs.progress.verdict_lead).
        assert deadline(cast.job) == T0 + timedelta(seconds=15 - settings.PROGRESS_SWEEP_INTERVAL_S)
        clock.shift(1)
        Job.objects.filter(pk=cast.job.pk).update(progress_deadline=T0 + timedelta(seconds=60))
        post(api, cast, number, [restored])
        assert deadline(cast.job) == T0 + timedelta(seconds=60)  # a duplicate is not news


def trained_then_relaunched(cast, clock, phases):
    """A first generation that trained five steps of ``phases``, then a second one launched 100 s later."""
    first = launched(cast)
    Generation.objects.filter(job=cast.job, number=first).update(first_step=1, first_step_at=timezone.now())
    StepMetric.objects.bulk_create([
        StepMetric(job=cast.job, generation=first, rank=0, step=s, loss=1.0, world_size=2, data_cursor=8 * s,
                   phases=phases, reported_at=timezone.now())
        for s in range(1, 6)])
    state.transition(cast.job, JobState.RUNNING, actor="test")
    state.transition(cast.job, JobState.QUIESCING, actor="test")
    state.transition(cast.job, JobState.RECOVERING, actor="test")
    clock.shift(100)
    return launched(cast)


@pytest.mark.django_db
def test_without_a_configured_timeout_the_previous_generations_step_times_count(cast, api):
    """3 × the p99 step time of the last generation that trained (12 s here) + 1 s: 37 s, more
    than the first-step allowance."""
    with time_machine.travel(T0, tick=False) as clock:
        second = trained_then_relaunched(cast, clock, {"input": 2.0, "compute": 8.0, "optimizer": 2.0})
        clock.shift(4)
        post(api, cast, second, [event(cast.job, second, "model")])
        assert deadline(cast.job) == T0 + timedelta(seconds=104 + 37)


@pytest.mark.django_db
def test_a_fast_jobs_first_step_still_gets_the_first_step_allowance(cast, api):
    """0.1 s steps give a 2 s progress timeout, but the first step of a generation pays for lazy
    initialisation: a slow first step is not a hang before ``FIRST_STEP_ALLOWANCE_S``."""
    with time_machine.travel(T0, tick=False) as clock:
        second = trained_then_relaunched(cast, clock, {"input": 0.01, "compute": 0.07, "optimizer": 0.02})
        clock.shift(4)
        post(api, cast, second, [event(cast.job, second, "model")])
        assert deadline(cast.job) == T0 + timedelta(seconds=104 + progress.FIRST_STEP_ALLOWANCE_S)
        clock.shift(progress.FIRST_STEP_ALLOWANCE_S - 1)  # a first step of 29 s: slow, not hung
        assert not progress.expire_one_progress_deadline()
        clock.shift(2)
        assert progress.expire_one_progress_deadline()
        assert Incident.objects.get(job=cast.job).evidence["signal"] == "hang"


@pytest.mark.django_db
def test_without_any_step_history_the_default_progress_timeout_applies(cast, api):
    with time_machine.travel(T0, tick=False):
        number = launched(cast)
        post(api, cast, number, [event(cast.job, number, "model")])
        assert deadline(cast.job) == T0 + timedelta(seconds=progress.DEFAULT_PROGRESS_TIMEOUT_S)
