"""The endpoints the training hooks talk to: reports, checkpoint commits, control — with fencing."""

from __future__ import annotations

import time

import pytest

from checkpoints.models import Checkpoint
from checkpoints.paths import checkpoint_dir
from core.events import EventKind
from core.models import Event
from jobs import state
from jobs.choices import JobState
from jobs.models import Generation, Job, NodeWindow, StepMetric, TrainingEvent


@pytest.fixture
def running(cast):
    """cast.job in generation 1 on node1, initializing (no step reported yet)."""
    state.transition(cast.job, JobState.INITIALIZING, actor="test")
    generation = Generation.objects.create(job=cast.job, number=1, world_size=2)
    generation.nodes.add(cast.node1)
    return cast


def report(job, generation=1, rank=0, step=1, loss=2.5, **extra):
    return {"job": str(job.pk), "generation": generation, "rank": rank, "step": step, "loss": loss,
            "grad_norm": 1.0, "world_size": 2, "data_cursor": step * 8, "samples": 4,
            "phases": {"input": 0.01, "compute": 0.1, "optimizer": 0.02}, "time": time.time(), **extra}


def batch(job, reports, generation=1, events=(), windows=()):
    return {"job": str(job.pk), "generation": generation, "reports": reports, "events": list(events),
            "windows": list(windows)}


def window(job, node, last_step, generation=1, ranks=8, slowest_rank=0):
    return {"job": str(job.pk), "generation": generation, "node": node, "first_step": last_step - 9,
            "last_step": last_step, "ranks": ranks, "step_median_s": 0.1, "step_max_s": 0.3,
            "slowest_rank": slowest_rank, "slowest_s": 0.2, "slowest_phases": {"compute": 0.18, "input": 0.02},
            "phases": {"compute": 0.09, "input": 0.01}, "time": time.time()}


def post_reports(api, cast, body, token="agent"):  # noqa: S107 - a name in cast.tokens
    return api(cast.tokens[token]).post(f"/api/v1/jobs/{cast.job.pk}/reports", body, format="json")


@pytest.mark.django_db
def test_first_step_marks_the_generation_running_and_sets_a_progress_deadline(running, api):
    response = post_reports(api, running, batch(running.job, [report(running.job, rank=r, step=1) for r in (0, 1)]))
    assert response.status_code == 202, response.content
    assert (response.json()["accepted"], response.json()["ignored"]) == (1, 1)  # rank 0 speaks for the job
    assert response.json()["control"] == {"generation": 1, "stale": False, "checkpoint_now": False,
                                          "pause": False, "checkpoint_interval_steps": None}
    job = Job.objects.get(pk=running.job.pk)
    assert (job.state, job.last_step) == (JobState.RUNNING, 1)
    assert job.progress_deadline is not None
    generation = Generation.objects.get(job=job, number=1)
    assert generation.first_step == 1 and generation.first_step_at is not None


@pytest.mark.django_db
def test_rows_grow_with_steps_and_nodes_not_ranks(running, api):
    """Rank 0's steps and other ranks' flagged steps are stored; timings arrive as node windows."""
    job = running.job
    reports = [report(job, rank=r, step=s) for s in (1, 2) for r in range(4)]
    reports += [report(job, rank=3, step=3, spike=True), report(job, rank=2, step=3, loss="nan", nan=True)]
    windows = [window(job, node, 10, slowest_rank=8 * node + 5) for node in range(3)]
    answer = post_reports(api, running, batch(job, reports, windows=windows)).json()
    assert (answer["accepted"], answer["duplicates"], answer["ignored"]) == (4, 0, 6)
    assert sorted(StepMetric.objects.filter(job=job).values_list("rank", "step")) == [(0, 1), (0, 2), (2, 3), (3, 3)]
    stored = NodeWindow.objects.filter(job=job).order_by("node")
    assert [(w.node, w.slowest_rank, w.last_step) for w in stored] == [(0, 5, 10), (1, 13, 10), (2, 21, 10)]
    assert stored[0].slowest_phases == {"compute": 0.18, "input": 0.02}
    # A replay stores nothing twice.
    post_reports(api, running, batch(job, reports, windows=windows))
    assert NodeWindow.objects.filter(job=job).count() == 3 and StepMetric.objects.filter(job=job).count() == 4


@pytest.mark.django_db
def test_replayed_reports_and_events_are_stored_once(running, api):
    event = {"job": str(running.job.pk), "generation": 1, "rank": 0, "step": 3, "kind": "guard_skip",
             "key": "r0-s3-guard", "message": "skipped", "detail": {"grad_norm": 1e6}, "time": time.time()}
    body = batch(running.job, [report(running.job, step=s) for s in (1, 2, 3)], events=[event])
    assert post_reports(api, running, body).json()["accepted"] == 3
    again = post_reports(api, running, body).json()
    assert (again["accepted"], again["duplicates"]) == (0, 3)
    assert StepMetric.objects.filter(job=running.job).count() == 3
    assert TrainingEvent.objects.filter(job=running.job).count() == 1


@pytest.mark.django_db
def test_a_report_of_an_old_generation_is_refused_with_409(running, api):
    state.transition(running.job, JobState.RUNNING, actor="t")
    state.transition(running.job, JobState.QUIESCING, actor="t")
    state.transition(running.job, JobState.RECOVERING, actor="t")
    state.transition(running.job, JobState.INITIALIZING, actor="t", restart=True)  # generation 2
    response = post_reports(api, running, batch(running.job, [report(running.job, generation=1, step=9)]))
    assert response.status_code == 409
    assert response["Content-Type"] == "application/problem+json"
    assert "generation 1 is stale; the active generation is 2" in response.json()["detail"]
    assert not StepMetric.objects.filter(job=running.job).exists()


@pytest.mark.django_db
def test_nonfinite_loss_is_stored_as_nan(running, api):
    post_reports(api, running, batch(running.job, [report(running.job, loss="nan", nan=True)]))
    metric = StepMetric.objects.get(job=running.job)
    assert metric.loss is None and metric.nan


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["reports"][0].update(step="x"), "reports.0.step"),
        (lambda b: b["reports"][0].update(extra=1), "reports.0.extra"),
        (lambda b: b["reports"][0].pop("loss"), "reports.0.loss"),
        (lambda b: b["reports"][0].update(generation=7), "reports.0"),
        (lambda b: (b.update(job="999"), b["reports"][0].update(job="999")), "job"),
    ],
)
def test_malformed_batches_name_the_field_and_store_nothing(running, api, mutate, field):
    body = batch(running.job, [report(running.job)])
    mutate(body)
    response = post_reports(api, running, body)
    assert response.status_code == 400, response.content
    assert response.json()["errors"][0]["field"] == field
    assert not StepMetric.objects.exists()


@pytest.mark.django_db
def test_only_agents_of_the_jobs_nodes_may_report(running, api):
    body = batch(running.job, [report(running.job)])
    assert post_reports(api, running, body, token="agent2").status_code == 403  # node2 runs no generation
    assert post_reports(api, running, body, token="operator").status_code == 403
    assert api().post(f"/api/v1/jobs/{running.job.pk}/reports", body, format="json").status_code == 401


@pytest.mark.django_db
def test_control_tells_a_stale_generation_to_stop_and_relays_requests(running, api):
    client = api(running.tokens["agent"])
    url = f"/api/v1/jobs/{running.job.pk}/control"
    assert client.get(url, {"generation": 1, "rank": 0}).json()["stale"] is False
    assert client.get(url, {"generation": 0}).status_code == 403  # never placed on this node
    assert client.get(url, {"generation": "x"}).status_code == 400
    from django.utils import timezone

    Job.objects.filter(pk=running.job.pk).update(pause_requested_at=timezone.now(),
                                                  checkpoint_requested_at=timezone.now(),
                                                  recommended_interval_steps=40,
                                                  checkpoint_policy={"interval": "auto"})
    control = client.get(url, {"generation": 1}).json()
    assert control == {"generation": 1, "stale": False, "checkpoint_now": True, "pause": True,
                       "checkpoint_interval_steps": 40}
    state.transition(running.job, JobState.QUIESCING, actor="t")
    state.transition(running.job, JobState.RECOVERING, actor="t")
    state.transition(running.job, JobState.INITIALIZING, actor="t", restart=True)  # generation 2
    assert client.get(url, {"generation": 1}).json()["stale"] is True


def commit(job, step, path, generation=1):
    return {"job": str(job.pk), "generation": generation, "step": step, "path": path, "loss": 2.0,
            "config_hash": "abc", "data_cursor": step * 8, "world_size": 2, "size_bytes": 1000,
            "blocking_s": 0.03, "total_s": 1.2, "manifest": {"step": step}}


@pytest.mark.django_db
def test_checkpoint_commits_form_a_lineage_and_replays_are_idempotent(running, api):
    client = api(running.tokens["agent"])
    root = checkpoint_dir(running.job)  # commits name directories inside the job's checkpoint directory
    url = f"/api/v1/jobs/{running.job.pk}/checkpoints"
    first = client.post(url, commit(running.job, 10, f"{root}/step-10"), format="json")
    assert first.status_code == 201, first.content
    second = client.post(url, commit(running.job, 20, f"{root}/step-20"), format="json")
    assert second.json()["parent"] == first.json()["id"]
    replay = client.post(url, commit(running.job, 20, f"{root}/step-20"), format="json")
    assert replay.status_code == 200 and replay.json()["id"] == second.json()["id"]
    assert Checkpoint.objects.filter(job=running.job).count() == 2
    # The next generation resumes from step 10: its first checkpoint branches off there.
    state.transition(running.job, JobState.RUNNING, actor="t")
    state.transition(running.job, JobState.PAUSED, actor="t")
    state.transition(running.job, JobState.RECOVERING, actor="t")
    state.transition(running.job, JobState.INITIALIZING, actor="t", restart=True)
    generation = Generation.objects.create(job=running.job, number=2, world_size=2,
                                           resumed_from_id=first.json()["id"])
    generation.nodes.add(running.node1)
    branch = client.post(url, commit(running.job, 15, f"{root}/b/step-15", generation=2), format="json")
    assert branch.json()["parent"] == first.json()["id"]
    stale = client.post(url, commit(running.job, 30, f"{root}/step-30", generation=1), format="json")
    assert stale.status_code == 409


@pytest.mark.django_db
def test_checkpoint_now_is_asked_until_a_newer_checkpoint_commits(running, api):
    operator, agent = api(running.tokens["operator"]), api(running.tokens["agent"])
    ask = f"/api/v1/jobs/{running.job.pk}/checkpoint"
    control = f"/api/v1/jobs/{running.job.pk}/control"
    refused = operator.post(ask, {"reason": "before the switch upgrade"}, format="json")
    assert refused.status_code == 409 and "initializing" in refused.json()["detail"]  # not running yet
    assert operator.post(ask, {}, format="json").status_code == 400  # the reason is required
    state.transition(running.job, JobState.RUNNING, actor="t")
    asked = operator.post(ask, {"reason": "before the switch upgrade"}, format="json")
    assert asked.status_code == 200 and asked.json()["state"] == "running"
    event = Event.objects.get(job=running.job, kind=EventKind.JOB_CHECKPOINT_REQUEST)
    assert (event.actor, event.reason) == ("token:operator(otto)", "checkpoint requested: before the switch upgrade")
    assert agent.get(control, {"generation": 1}).json()["checkpoint_now"] is True
    assert agent.get(control, {"generation": 1}).json()["checkpoint_now"] is True  # until a commit answers
    root = checkpoint_dir(running.job)
    committed = agent.post(f"/api/v1/jobs/{running.job.pk}/checkpoints", commit(running.job, 10, f"{root}/step-10"),
                           format="json")
    assert committed.status_code == 201, committed.content
    assert agent.get(control, {"generation": 1}).json()["checkpoint_now"] is False
    assert Job.objects.get(pk=running.job.pk).checkpoint_requested_at is None
