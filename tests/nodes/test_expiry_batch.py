"""The heartbeat sweeper's batch (nodes.services.sweeper): what a sweep costs, and that the jobs app
gets one task for the whole batch with the same outcome per node as one node at a time."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import TestCase
from django.utils import timezone

from core import shared_counts
from jobs import services as job_services
from jobs import tasks as job_tasks
from jobs.choices import IncidentKind
from jobs.models import Event, Incident, Job
from nodes import services
from nodes.choices import Health
from nodes.models import Node


@pytest.fixture
def quiet_watches(settings):
    """Expiry alone: no fleet-silence hold (every node here is silent at once), no overload hold."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "FLEET_SILENCE_HOLD_S": 0, "OVERLOAD_HOLD_S": 0}


def silent_fleet(n: int, *, overdue_s: float = 1) -> list[Node]:
    past = timezone.now() - timedelta(seconds=overdue_s)
    return Node.objects.bulk_create(
        Node(hostname=f"sim-{i:04d}", address=f"10.1.{i // 250}.{i % 250}", health=Health.HEALTHY,
             last_heartbeat_at=past - timedelta(seconds=15), heartbeat_deadline=past - timedelta(milliseconds=i))
        for i in range(n))


@pytest.fixture
def queued(monkeypatch):
    """What the jobs app's receivers queue, instead of queueing it."""
    calls: dict[str, list] = {"batch": [], "single": []}
    monkeypatch.setattr(job_tasks.handle_nodes_health, "delay", lambda *a: calls["batch"].append(a))
    monkeypatch.setattr(job_tasks.handle_node_health, "delay", lambda *a: calls["single"].append(a))
    return calls


@pytest.mark.django_db
def test_a_sweep_of_many_nodes_costs_a_few_queries_and_queues_one_task(cast, quiet_watches, queued,
                                                                      django_assert_max_num_queries):
    silent_fleet(300)
    # silence + overload watches (3), the count of the fleet heartbeat pacing takes at most every
    # FLEET_COUNT_TTL_S (1), the locked read, one UPDATE, one INSERT of the events, and the savepoint
    # around them that the test's own transaction turns BEGIN/COMMIT into (2)
    with TestCase.captureOnCommitCallbacks(execute=True), django_assert_max_num_queries(9):
        assert services.expire_heartbeats() == 300
    assert Node.objects.filter(health=Health.UNREACHABLE, heartbeat_deadline__isnull=True).count() == 300
    assert Event.objects.filter(kind="node.health", new_state="unreachable").count() == 300
    assert queued["single"] == []
    [(new, reasons)] = queued["batch"]
    assert new == Health.UNREACHABLE and len(reasons) == 300
    assert reasons["sim-0000"][0].startswith("no heartbeat since ")


@pytest.mark.django_db
def test_a_sweep_takes_at_most_its_batch_oldest_deadline_first(cast, quiet_watches, queued):
    fleet = silent_fleet(5)
    with TestCase.captureOnCommitCallbacks(execute=True):
        assert services.expire_batch(3) == 3
    expired = set(Node.objects.filter(health=Health.UNREACHABLE).values_list("hostname", flat=True))
    assert expired == {n.hostname for n in fleet[2:]}  # their deadlines ran out first
    assert services.expire_batch(3) == 2
    assert services.expire_batch(3) == 0


@pytest.mark.django_db
def test_a_node_already_unreachable_loses_its_deadline_without_a_second_event(cast, quiet_watches, queued):
    Node.objects.filter(pk=cast.node1.pk).update(health=Health.UNREACHABLE,
                                                 heartbeat_deadline=timezone.now() - timedelta(seconds=1))
    with TestCase.captureOnCommitCallbacks(execute=True):
        assert services.expire_batch(10) == 1
    assert Node.objects.get(pk=cast.node1.pk).heartbeat_deadline is None
    assert not Event.objects.filter(kind="node.health").exists()
    assert queued["batch"] == [(Health.UNREACHABLE, {})]


@pytest.mark.django_db
def test_the_batch_task_handles_each_node_that_runs_work_as_one_node_at_a_time(cast):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test")
    job_services.start_job(job, actor="test")  # on gpu-01; gpu-02 is the spare and runs nothing
    Node.objects.filter(hostname="gpu-01").update(heartbeat_deadline=timezone.now() - timedelta(seconds=1))
    services.expire_batch(10)
    job_tasks.handle_nodes_health(Health.UNREACHABLE, {"gpu-01": ["no heartbeat"], "gpu-02": ["no heartbeat"]})
    incident = Incident.objects.get(job=job)  # gpu-02 runs nothing: no second one
    assert incident.kind == IncidentKind.PARTITION  # an unreachable node, as handle_node_health classifies it
    assert (incident.evidence["signal"], incident.evidence["nodes"]) == ("node_unreachable", ["gpu-01"])
    assert incident.evidence["detail"] == {"health": "unreachable", "reasons": ["no heartbeat"]}


@pytest.mark.django_db
def test_batch_sizes_reach_the_shared_counts(cast, quiet_watches, queued, redis_counts):
    silent_fleet(30)
    services.expire_batch(1000)
    counts = shared_counts.totals()
    assert (counts["expiry:batches"], counts["expiry:nodes"], counts["expiry:le:100"]) == (1, 30, 1)
