"""Resizing a job (issue 21): ``POST /jobs/{id}/resize`` pauses a running job at a checkpoint and
resumes it on the new world size; a paused job takes the new size at its next resume. Validated
(400 naming the field, in the one problem format), refused for a size the fleet can never hold
(422), authorised (operate) and audited (``job.resize``)."""

from __future__ import annotations

import pytest

from jobs.choices import JobState
from jobs.models import Event, Generation, Job

PROBLEM = "application/problem+json"


def resize(api, token, job, body):
    return api(token).post(f"/api/v1/jobs/{job.pk}/resize", body, format="json")


@pytest.fixture
def running(cast):
    """cast.job (1 node × 2 processes) running generation 1 on gpu-01."""
    from jobs import services

    services.start_job(cast.job, actor="test")
    Job.objects.filter(pk=cast.job.pk).update(state=JobState.RUNNING, last_step=40)
    cast.job.refresh_from_db()
    assert cast.job.generation == 1
    return cast.job


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "field", "reason"), [
    ({"nnodes": 0, "nproc_per_node": 1, "reason": "r"}, "nnodes", "greater than or equal to 1"),
    ({"nnodes": 1, "nproc_per_node": 65, "reason": "r"}, "nproc_per_node", "less than or equal to 64"),
    ({"nnodes": "two", "nproc_per_node": 1, "reason": "r"}, "nnodes", "valid integer"),
    ({"nnodes": 1, "reason": "r"}, "nproc_per_node", "required"),
    ({"nnodes": 1, "nproc_per_node": 1}, "reason", "required"),
    ({"nnodes": 1, "nproc_per_node": 1, "reason": "r", "world_size": 1}, "world_size", "Unknown field"),
    ({"nnodes": 1, "nproc_per_node": 2, "reason": "r"}, "nnodes", "already runs on 1 node(s) × 2 process(es)"),
])
def test_a_bad_size_is_a_400_naming_the_field_and_changes_nothing(running, api, cast, body, field, reason):
    answer = resize(api, cast.tokens["operator"], running, body)
    assert answer.status_code == 400 and answer["Content-Type"] == PROBLEM, answer.content
    errors = answer.json()["errors"]
    assert any(e["field"] == field and reason in e["reason"] for e in errors), errors
    job = Job.objects.get(pk=running.pk)
    assert (job.state, job.resize_to, job.nnodes, job.nproc_per_node) == (JobState.RUNNING, None, 1, 2)
    assert not Event.objects.filter(job=job, kind="job.resize").exists()


@pytest.mark.django_db
def test_a_size_the_fleet_can_never_hold_is_a_422_and_only_operators_resize(running, api, cast):
    never = resize(api, cast.tokens["operator"], running, {"nnodes": 3, "nproc_per_node": 1, "reason": "r"})
    assert never.status_code == 422 and never["Content-Type"] == PROBLEM
    assert [e["field"] for e in never.json()["errors"]] == ["nnodes"]
    for caller in ("viewer", "ci", "agent"):
        refused = resize(api, cast.tokens[caller], running, {"nnodes": 2, "nproc_per_node": 1, "reason": "r"})
        assert refused.status_code == 403, caller
    assert Job.objects.get(pk=running.pk).state == JobState.RUNNING
    pending = Job.objects.create(name="later", entrypoint="examples/train.py", created_by="test")
    conflict = resize(api, cast.tokens["operator"], pending, {"nnodes": 2, "nproc_per_node": 1, "reason": "r"})
    assert conflict.status_code == 409 and "only a running or paused job can be resized" in conflict.json()["detail"]


@pytest.mark.django_db
def test_a_running_job_pauses_at_a_checkpoint_then_resumes_on_the_new_size(running, api, cast):
    from jobs import orchestrator

    answer = resize(api, cast.tokens["operator"], running, {"nnodes": 2, "nproc_per_node": 1, "reason": "more nodes"})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["state"] == JobState.QUIESCING and body["resize_to"] == {"nnodes": 2, "nproc_per_node": 1}
    job = Job.objects.get(pk=running.pk)
    assert job.pause_requested_at is not None and job.quiesce_deadline is not None  # the hooks checkpoint, exit
    event = Event.objects.get(job=job, kind="job.resize")
    assert event.actor == "token:operator(otto)" and "more nodes" in event.reason
    assert event.evidence == {"old_nnodes": 1, "old_nproc_per_node": 2, "nnodes": 2, "nproc_per_node": 1,
                              "last_step": 40, "state": "running"}
    again = resize(api, cast.tokens["operator"], job, {"nnodes": 1, "nproc_per_node": 1, "reason": "r"})
    assert again.status_code == 409
    # The ranks exit paused (their checkpoint committed); the node confirms: the job resumes by itself.
    orchestrator.handle_exit(job.pk, 1, "gpu-01", {"exit_code": 0, "signature": "paused", "requested_stop": False})
    assert orchestrator.advance_recovery(job.pk)  # quiescing → recovering: no approval, nothing went wrong
    assert Job.objects.get(pk=job.pk).state == JobState.RECOVERING
    assert orchestrator.advance_recovery(job.pk)  # the next generation, on the new shape
    job.refresh_from_db()
    assert job.state == JobState.INITIALIZING and job.generation == 2, job.pause_reason
    assert (job.nnodes, job.nproc_per_node, job.resize_to, job.world_size) == (2, 1, None, 2)
    generation = Generation.objects.get(job=job, number=2)
    assert generation.world_size == 2
    assert set(generation.nodes.values_list("hostname", flat=True)) == {"gpu-01", "gpu-02"}


@pytest.mark.django_db
def test_a_paused_job_takes_the_new_size_at_its_next_resume(running, api, cast):
    from jobs import services, state

    state.transition(running, JobState.PAUSED, actor="test", reason="breaker", pause_reason="breaker")
    Generation.objects.filter(job=running, number=1).update(stopped_nodes=["gpu-01"])
    answer = resize(api, cast.tokens["operator"], running, {"nnodes": 1, "nproc_per_node": 1, "reason": "fewer"})
    assert answer.status_code == 200 and answer.json()["state"] == JobState.PAUSED
    assert answer.json()["resize_to"] == {"nnodes": 1, "nproc_per_node": 1}
    job = Job.objects.get(pk=running.pk)
    generation = services.approve_resume(job, actor="test", reason="go")
    job.refresh_from_db()
    assert generation.world_size == 1 and (job.nnodes, job.nproc_per_node, job.resize_to) == (1, 1, None)
