"""A launch refused by the job's own pre-flight on the node (issue 24, items 3 and 7) pauses the job
with the reason and spends no restart; a refused health check still replaces the node."""

from __future__ import annotations

import pytest

from jobs import orchestrator, receivers, services
from jobs.choices import JobState
from jobs.models import Incident, Job
from nodes.models import Node


@pytest.fixture
def job(cast):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test", recovery_policy={"backoff_seconds": 0})
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def refusal(name: str, detail: str) -> dict:
    return {"ok": False, "reason": detail, "checks": [
        {"name": "gpu_reachable", "ok": True, "detail": "no GPU telemetry; the job runs without GPUs"},
        {"name": name, "ok": False, "detail": detail}], "bandwidth": []}


@pytest.mark.django_db
@pytest.mark.parametrize(("check", "detail", "kind"), [
    ("entrypoint", "file not found: /srv/code/examples/trian.py", "deterministic"),
    ("checkpoint_dir", "checkpoint directory /ckpt/job-1 is not writable: permission denied", "checkpoint"),
])
def test_a_failed_pre_flight_pauses_with_the_reason_and_spends_no_restart(cast, job, eager_celery, check, detail,
                                                                            kind):
    receivers.on_launch_refused(sender=Node, node=cast.node1, job_id=job.pk, generation=1, reason=detail,
                                detail=refusal(check, detail))
    while orchestrator.advance_recovery(job.pk):
        pass
    job.refresh_from_db()
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == (kind, "pause")
    assert detail in incident.classification and incident.evidence["page"] is True
    assert (job.state, job.generation, job.restart_count) == (JobState.PAUSED, 1, 0)
    assert detail in job.pause_reason
    cast.node1.refresh_from_db()
    assert cast.node1.schedulability == "active"  # the node is not to blame: not drained


@pytest.mark.django_db
def test_a_failed_health_check_still_moves_the_job_to_a_spare(cast, job, eager_celery):
    receivers.on_launch_refused(sender=Node, node=cast.node1, job_id=job.pk, generation=1, reason="GPU 0: 91 °C",
                                detail=refusal("temperature", "GPU 0: 91 °C"))
    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("hardware", "restart_on_spare")
