"""The Young/Daly interval from measured save costs and the incident history, pushed to "auto" jobs."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.utils import timezone

from agents.protocol.hooks import CheckpointCommit
from checkpoints.paths import checkpoint_dir
from jobs import checkpoint_interval, state
from jobs.checkpointing import commit_checkpoint
from jobs.choices import IncidentKind, JobState
from jobs.models import Event, Incident, Job, StepMetric


def _commit_costs(job, blocking_s: float, total_s: float, count: int = 3) -> None:
    """Commits as the hooks report them; only their measured save cost matters here."""
    for n in range(1, count + 1):
        commit_checkpoint(job, CheckpointCommit(
            job=str(job.pk), generation=job.generation, step=100 * n, path=f"{checkpoint_dir(job)}/step-{100 * n}",
            loss=2.0, config_hash="abc", data_cursor=800 * n, world_size=2, size_bytes=10**9,
            blocking_s=blocking_s, total_s=total_s, manifest={}), actor="node:gpu-01")


def _step_reports(job, step_s: float, count: int = 20) -> None:
    for step in range(1, count + 1):
        for rank in (0, 1):
            StepMetric.objects.create(
                job=job, generation=job.generation, rank=rank, step=step, loss=2.0, world_size=2,
                data_cursor=8 * step, reported_at=timezone.now(),
                # The checkpoint phase is what the interval trades against: not part of a step's time.
                phases={"input": 0.1 * step_s, "compute": 0.8 * step_s, "optimizer": 0.1 * step_s, "checkpoint": 30.0},
            )


def _failures(job, count: int, *, days_ago: float, kind: str = IncidentKind.CRASH) -> None:
    now = timezone.now()
    for n in range(count):
        Incident.objects.create(job=job, kind=kind, detected_at=now - timedelta(days=days_ago, minutes=n))


@pytest.fixture
def auto_job(ckjob):
    """ckjob with an "auto" interval policy, 60 days old."""
    Job.objects.filter(pk=ckjob.pk).update(checkpoint_policy={**ckjob.checkpoint_policy, "interval": "auto"},
                                           created_at=timezone.now() - timedelta(days=60))
    ckjob.refresh_from_db()
    return ckjob


def _control(api, cast, job) -> dict:
    response = api(cast.tokens["agent"]).get(f"/api/v1/jobs/{job.pk}/control", {"generation": job.generation})
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.django_db
def test_the_reference_example_5_minute_saves_10_hour_mtbf_gives_about_77_minutes(auto_job):
    _commit_costs(auto_job, blocking_s=300.0, total_s=300.0)
    _step_reports(auto_job, step_s=1.2)
    _failures(auto_job, 72, days_ago=10)  # 72 failures in the 30-day window: MTBF 10 h
    _failures(auto_job, 5, days_ago=45)  # outside the window
    _failures(auto_job, 9, days_ago=5, kind=IncidentKind.NUMERICAL)  # not a failure of the machines

    recommendation = checkpoint_interval.recommend_interval(auto_job)
    assert (recommendation.mtbf_source, recommendation.failures) == ("incidents", 72)
    assert recommendation.mtbf_s == pytest.approx(10 * 3600, rel=1e-6)
    assert recommendation.save_cost_s == 300.0 and recommendation.cost_samples == 3
    assert recommendation.interval_s == pytest.approx(math.sqrt(2 * 300 * 36000), rel=1e-6)  # 4647.6 s
    assert recommendation.interval_s / 60 == pytest.approx(77.46, abs=0.01)
    assert recommendation.step_time_s == pytest.approx(1.2)
    assert recommendation.interval_steps == round(4647.58 / 1.2) == 3873
    assert "77.5 min" in recommendation.explanation


@pytest.mark.django_db
def test_before_any_failure_the_per_gpu_assumption_divided_by_the_gpu_count_is_used(ckjob, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "GPU_MTBF_HOURS": 50_000}
    _commit_costs(ckjob, blocking_s=0.03, total_s=1.2)
    _step_reports(ckjob, step_s=0.25)
    recommendation = checkpoint_interval.recommend_interval(ckjob)
    assert (recommendation.mtbf_source, recommendation.gpus) == ("assumed", 2)  # 1 node x 2 ranks
    assert recommendation.mtbf_s == 50_000 * 3600 / 2
    assert recommendation.interval_s == pytest.approx(math.sqrt(2 * 0.03 * 9e7))  # 2323.8 s
    assert recommendation.interval_steps == round(math.sqrt(2 * 0.03 * 9e7) / 0.25)


@pytest.mark.django_db
def test_the_interval_is_never_shorter_than_a_save_takes_to_commit(auto_job):
    _commit_costs(auto_job, blocking_s=0.0001, total_s=30.0)
    _failures(auto_job, 72, days_ago=10)
    recommendation = checkpoint_interval.recommend_interval(auto_job)
    assert math.sqrt(2 * 0.0001 * 36000) < 30 and recommendation.interval_s == 30.0
    assert recommendation.interval_steps is None  # no step times reported yet


@pytest.mark.django_db
def test_the_pushed_interval_changes_what_the_hooks_are_told(auto_job, cast, api):
    state.transition(auto_job, JobState.RUNNING, actor="test")
    assert _control(api, cast, auto_job)["checkpoint_interval_steps"] is None
    assert checkpoint_interval.push_intervals() == 0  # no save measured yet: nothing to recommend

    _commit_costs(auto_job, blocking_s=300.0, total_s=300.0)
    _step_reports(auto_job, step_s=1.2)
    _failures(auto_job, 72, days_ago=10)
    assert checkpoint_interval.push_intervals() == 1
    assert _control(api, cast, auto_job)["checkpoint_interval_steps"] == 3873  # save every 3873 steps
    event = Event.objects.get(job=auto_job, kind="checkpoint.interval")
    assert (event.old_state, event.new_state, event.evidence["mtbf_s"]) == ("", "3873", pytest.approx(36000))

    _failures(auto_job, 4, days_ago=3)  # 76 failures: MTBF 9.5 h, a 2.7 % shorter interval: not worth a change
    assert checkpoint_interval.push_intervals() == 0
    _failures(auto_job, 212, days_ago=2)  # 288 failures: MTBF 2.5 h, half the interval
    assert checkpoint_interval.push_intervals() == 1
    assert _control(api, cast, auto_job)["checkpoint_interval_steps"] == round(math.sqrt(2 * 300 * 9000) / 1.2)


@pytest.mark.django_db
def test_only_running_jobs_whose_policy_says_auto_are_pushed(auto_job, cast, api):
    _commit_costs(auto_job, blocking_s=300.0, total_s=300.0)
    _step_reports(auto_job, step_s=1.2)
    Job.objects.filter(pk=auto_job.pk).update(checkpoint_policy={**auto_job.checkpoint_policy, "interval": "fixed"})
    assert checkpoint_interval.push_intervals() == 0
    Job.objects.filter(pk=auto_job.pk).update(checkpoint_policy={**auto_job.checkpoint_policy, "interval": "auto"})
    state.transition(auto_job, JobState.CANCELLED, actor="test")
    assert checkpoint_interval.push_intervals() == 0
    assert Job.objects.get(pk=auto_job.pk).recommended_interval_steps is None


@pytest.mark.django_db
def test_the_interval_endpoint_shows_the_inputs(auto_job, cast, api):
    _commit_costs(auto_job, blocking_s=300.0, total_s=300.0)
    _step_reports(auto_job, step_s=1.2)
    _failures(auto_job, 72, days_ago=10)
    checkpoint_interval.push_interval(auto_job)
    body = api(cast.tokens["viewer"]).get(f"/api/v1/jobs/{auto_job.pk}/checkpoints/interval").json()
    assert body["save_cost_s"] == 300.0 and body["mtbf_s"] == pytest.approx(36000) and body["failures"] == 72
    assert body["interval_s"] == pytest.approx(4647.58, abs=0.01) and body["interval_steps"] == 3873
    assert body["pushed_interval_steps"] == 3873 and body["mtbf_source"] == "incidents"
    assert body["explanation"].startswith("sqrt(2 x 300 s x 36000 s MTBF (72 failures in 720.0 h of history))")
