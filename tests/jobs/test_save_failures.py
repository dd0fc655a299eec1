"""A failed checkpoint save reported by the hooks becomes a ``checkpoint`` incident that says why
(issue 24, item 3): training is not touched, the on-call is paged once per cause."""

from __future__ import annotations

import time

import pytest

from agents.protocol import hooks as hooks_protocol
from alerts.rules import for_incident
from checkpoints.models import Checkpoint
from jobs import ingest
from jobs.choices import IncidentKind, IncidentState, JobState
from jobs.models import Incident, Job


@pytest.fixture
def running(cast):
    Job.objects.filter(pk=cast.job.pk).update(state=JobState.RUNNING, generation=1)
    cast.job.refresh_from_db()
    return cast.job


def failed_save(job, step, reason="no space left on device", errno=28, **detail):
    event = hooks_protocol.Event(
        job=str(job.pk), generation=1, rank=0, step=step, kind="checkpoint_failed", key=f"0:0:{step}:cf:0",
        message=f"checkpoint at step {step} failed: {reason}", time=time.time() - 3,
        detail={"path": f"/ckpt/step-{step:08d}-g1-aa", "reason": reason, "errno": errno,
                "error": "CheckpointException ranks:dict_keys([0, 1]) ... OSError: [Errno 28]", **detail})
    return hooks_protocol.ReportBatch(job=str(job.pk), generation=1, events=[event])


def record(job, b, capture):
    with capture(execute=True):
        ingest.record_reports(job, b, actor="test")
    job.refresh_from_db()


@pytest.mark.django_db
def test_a_full_disk_raises_one_checkpoint_incident_that_says_why(running, eager_celery,
                                                                   django_capture_on_commit_callbacks):
    record(running, failed_save(running, 20), django_capture_on_commit_callbacks)
    incident = Incident.objects.get(job=running)
    assert incident.kind == IncidentKind.CHECKPOINT and incident.decision == "alert"
    assert "no space left on device" in incident.classification
    assert incident.evidence["detail"]["reason"] == "no space left on device"
    assert incident.evidence["detail"]["errno"] == 28 and incident.evidence["page"] is True
    assert incident.fault_at < incident.detected_at  # the hooks' time of the failure
    assert running.state == JobState.RUNNING  # training goes on: nothing to recover
    assert incident.state == IncidentState.RESOLVED  # an alert: born resolved, as stragglers are
    page = for_incident(incident)  # what the on-call receives says why
    assert page.severity == "page" and "no space left on device" in page.summary

    # The next save fails for the same cause: the same condition, not a second page.
    record(running, failed_save(running, 30), django_capture_on_commit_callbacks)
    assert Incident.objects.filter(job=running).count() == 1
    assert [f["step"] for f in Incident.objects.get(job=running).evidence["further"]] == [30]

    # Another cause is another incident; so is the same cause after a checkpoint committed again.
    record(running, failed_save(running, 40, "permission denied", 13), django_capture_on_commit_callbacks)
    assert Incident.objects.filter(job=running).latest("pk").classification.endswith(
        "failed: permission denied; training goes on from the previous checkpoint")
    Checkpoint.objects.create(job=running, step=50, location="/ckpt/step-50", state="verified")
    record(running, failed_save(running, 60, "permission denied", 13), django_capture_on_commit_callbacks)
    assert Incident.objects.filter(job=running, kind=IncidentKind.CHECKPOINT).count() == 3


@pytest.mark.django_db
def test_a_failure_of_a_stale_generation_is_not_acted_on(running, eager_celery, django_capture_on_commit_callbacks):
    Job.objects.filter(pk=running.pk).update(generation=2)
    from jobs.orchestrator import handle_save_failed

    assert handle_save_failed(running.pk, 1, {"reason": "no space left on device", "step": 3}) is None
    assert not Incident.objects.filter(job=running).exists()


@pytest.mark.django_db
def test_a_save_that_failed_because_a_rank_went_away_is_no_checkpoint_incident(
        running, eager_celery, django_capture_on_commit_callbacks):
    """A rank killed in the middle of a save breaks the others' collectives: their save fails with
    gloo's "Connection closed by peer". The storage is fine; the exit is the incident, and a page
    for the save would be a false one. The event stays on the timeline."""
    from jobs.models import TrainingEvent

    reason = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38558"
    record(running, failed_save(running, 20, reason, None, peer_lost=True), django_capture_on_commit_callbacks)
    assert not Incident.objects.filter(job=running).exists()
    assert TrainingEvent.objects.get(job=running, kind="checkpoint_failed").detail["peer_lost"] is True
    record(running, failed_save(running, 30, reason, None, peer_lost=False), django_capture_on_commit_callbacks)
    assert Incident.objects.get(job=running).kind == IncidentKind.CHECKPOINT  # said otherwise: the storage's
