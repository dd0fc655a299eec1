"""The sweep's reconciliation: a stored exit (or acknowledged stop) of an active job's current
generation that no task handled is handled by the sweep, once, after a grace period."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import reconcile, state
from jobs.choices import JobState
from jobs.models import Generation, Incident, Job
from nodes.models import AgentEventRecord, NodeCommand

pytestmark = pytest.mark.django_db


@pytest.fixture
def running(cast):
    """cast.job running generation 1 on node1."""
    state.transition(cast.job, JobState.INITIALIZING, actor="test")
    state.transition(cast.job, JobState.RUNNING, actor="test")
    Job.objects.filter(pk=cast.job.pk).update(generation=1)
    cast.job.refresh_from_db()
    Generation.objects.create(job=cast.job, number=1, world_size=2).nodes.add(cast.node1)
    return cast


def _exit(cast, *, ago_s: float, generation: int = 1, key: str = "exit-1"):
    return AgentEventRecord.objects.create(
        node=cast.node1, key=key, kind="exited", time=timezone.now() - timedelta(seconds=ago_s),
        job=cast.job, job_ref=str(cast.job.pk), generation=generation,
        received_at=timezone.now() - timedelta(seconds=ago_s),
        detail={"exit_code": 1, "ranks": [{"rank": 1, "local_rank": 1, "signal": 9}], "error_line": "killed"})


def test_an_exit_no_task_handled_opens_its_incident_after_the_grace(running):
    _exit(running, ago_s=reconcile.GRACE_S / 2)
    assert reconcile.reexamine_one_exit() is False, "within the grace the task may still come"
    AgentEventRecord.objects.update(received_at=timezone.now() - timedelta(seconds=reconcile.GRACE_S + 1))
    assert reconcile.reexamine_one_exit() is True
    generation = Generation.objects.get(job=running.job, number=1)
    assert generation.stopped_nodes == ["gpu-01"]
    incident = Incident.objects.get(job=running.job)
    assert incident.evidence["signal"] == "exit"
    assert Job.objects.get(pk=running.job.pk).state != JobState.RUNNING
    assert reconcile.reexamine_one_exit() is False, "handled once"
    assert Incident.objects.filter(job=running.job).count() == 1


def test_exits_already_handled_or_of_older_generations_are_left_alone(running):
    Generation.objects.filter(job=running.job, number=1).update(stopped_nodes=["gpu-01"])
    _exit(running, ago_s=60)
    _exit(running, ago_s=60, generation=0, key="exit-0")
    assert reconcile.reexamine_one_exit() is False
    assert not Incident.objects.exists()


def test_a_stop_acknowledged_but_never_counted_is_counted(running):
    state.transition(running.job, JobState.QUIESCING, actor="test")
    NodeCommand.objects.create(node=running.node1, kind="stop", job=running.job, generation=1, idempotency_key="s1",
                               state="acked", acked_at=timezone.now() - timedelta(seconds=60),
                               expires_at=timezone.now() + timedelta(minutes=5))
    assert reconcile.reexamine_one_exit() is True
    assert Generation.objects.get(job=running.job, number=1).stopped_nodes == ["gpu-01"]
    assert reconcile.reexamine_one_exit() is False


def test_the_sweep_reads_exits_through_the_active_jobs_not_every_exit_ever_stored(running):
    from django.db import connection

    done = Job.objects.bulk_create(Job(name=f"old{i}", entrypoint="examples/train.py", created_by="test",
                                       state=JobState.COMPLETED, generation=1) for i in range(50))
    AgentEventRecord.objects.bulk_create(
        AgentEventRecord(node=running.node1, key=f"old-{job.pk}", kind="exited", time=timezone.now(), job=job,
                         generation=1, received_at=timezone.now() - timedelta(hours=1)) for job in done)
    query = reconcile.exits_of_active_jobs(timezone.now(), reconcile.active_jobs())
    assert not query.exists()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # tables this small would be scanned anyway
        plan = query[:1].explain()
    assert "agentevent_job_generation" in plan, plan
