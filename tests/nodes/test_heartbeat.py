"""Heartbeats, the deadline they move, and the sweeper that marks silent nodes unreachable."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.db import DEFAULT_DB_ALIAS, connections
from django.test import TestCase
from django.utils import timezone

from jobs.models import Event
from nodes import services, signals, tasks
from nodes.choices import Health, Schedulability
from nodes.models import GPU, Node
from tests.nodes.conftest import heartbeat, sample


@pytest.mark.django_db
def test_a_heartbeat_moves_the_deadline_by_interval_times_misses(cast, post):
    with time_machine.travel("2026-11-30 12:00:00Z", tick=False):
        running = [{"job": str(cast.job.pk), "generation": 1, "pids": [100, 101], "started_at": 1.0}]
        response = post("heartbeat", heartbeat(cast.node1, seq=7, spooled=12, telemetry_dropped=3, draining=True,
                                               running=running))
    assert response.status_code == 200, response.content
    assert response.json() == {"commands": []}
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.last_heartbeat_at.isoformat() == "2026-11-30T12:00:00+00:00"
    assert node.heartbeat_deadline - node.last_heartbeat_at == timedelta(seconds=5 * 3)
    assert (node.last_heartbeat_seq, node.spooled, node.telemetry_dropped, node.agent_draining) == (7, 12, 3, True)
    assert node.running == [{"job": str(cast.job.pk), "generation": 1, "pids": [100, 101], "started_at": 1.0}]


@pytest.mark.django_db
def test_a_silent_node_becomes_unreachable_after_the_deadline_and_not_before(cast, post, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 2, "HEARTBEAT_MISSES": 3}
    seen = []
    signals.nodes_health_changed.connect(
        lambda **kw: seen.extend((c["node"].hostname, c["old"], kw["new"]) for c in kw["changes"]), weak=False,
        dispatch_uid="test-seen")
    try:
        with time_machine.travel("2026-11-30 12:00:00Z", tick=False) as clock:
            post("heartbeat", heartbeat(cast.node1))
            clock.shift(5.9)
            assert services.expire_one_heartbeat() is False
            clock.shift(0.2)
            with TestCase.captureOnCommitCallbacks(execute=True):
                assert services.expire_one_heartbeat() is True
            assert services.expire_one_heartbeat() is False  # one-shot: nothing left to do
    finally:
        signals.nodes_health_changed.disconnect(dispatch_uid="test-seen")
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.heartbeat_deadline) == (Health.UNREACHABLE, None)
    event = Event.objects.get(kind="node.health", node=node)
    assert (event.old_state, event.new_state, event.actor) == ("healthy", "unreachable", "system:heartbeat-sweeper")
    assert "no heartbeat since 2026-11-30T12:00:00" in event.reason
    assert seen == [(node.hostname, "healthy", "unreachable")]
    # Unreachable is not unhealthy: the drain policy leaves the decision to the orchestrator.
    assert node.schedulability == Schedulability.ACTIVE


@pytest.mark.django_db
def test_the_task_sweeps_every_overdue_node(cast, settings):
    # Both nodes of this fleet silent at once would be a fleet silence (tests/nodes/test_fleet_silence.py).
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "FLEET_SILENCE_HOLD_S": 0}
    past = timezone.now() - timedelta(seconds=1)
    Node.objects.filter(pk__in=[cast.node1.pk, cast.node2.pk]).update(heartbeat_deadline=past)
    assert tasks.expire_heartbeats() == 2
    assert set(Node.objects.values_list("health", flat=True)) == {Health.UNREACHABLE}


@pytest.mark.django_db
def test_an_unreachable_node_that_comes_back_is_judged_from_fresh_telemetry(cast, post):
    services.set_health(cast.node1, Health.UNREACHABLE, reason="test")
    GPU.objects.create(node=cast.node1, index=0, last_sample=sample(cast.node1, 0, temperature_c=91.0),
                       last_sample_at=timezone.now())
    post("heartbeat", heartbeat(cast.node1))
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.health == Health.UNHEALTHY
    assert "GPU 0 at 91 °C" in node.health_reason


@pytest.mark.django_db
def test_an_unreachable_node_with_only_old_samples_waits_for_telemetry(cast, post):
    services.set_health(cast.node1, Health.UNREACHABLE, reason="test")
    GPU.objects.create(node=cast.node1, index=0, last_sample=sample(cast.node1, 0),
                       last_sample_at=timezone.now() - timedelta(hours=1))
    post("heartbeat", heartbeat(cast.node1))
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.health_reason) == (Health.UNKNOWN, "agent alive; waiting for GPU telemetry")


@pytest.mark.django_db
def test_a_node_without_gpu_telemetry_is_healthy_on_its_heartbeat_and_says_why(cast, post):
    Node.objects.filter(pk=cast.node1.pk).update(health=Health.UNKNOWN)
    post("heartbeat", heartbeat(cast.node1, gpu_telemetry=False, gpu_telemetry_reason="NVML library not found"))
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.health == Health.HEALTHY
    assert node.health_reason == "agent alive; no GPU telemetry (NVML library not found)"
    assert (node.gpu_telemetry, node.gpu_telemetry_reason) == (False, "NVML library not found")


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_racing_the_sweeper_keeps_the_node_reachable(cast):
    """A heartbeat is moving the deadline (its UPDATE holds the row, not yet committed) while the
    sweep runs: the sweep skips that node, and the heartbeat's deadline stands."""
    Node.objects.filter(pk__in=[cast.node1.pk, cast.node2.pk]).update(
        heartbeat_deadline=timezone.now() - timedelta(seconds=1))
    heartbeat_side = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        with heartbeat_side.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("UPDATE nodes_node SET heartbeat_deadline = now() + interval '15 seconds' WHERE id = %s",
                           [cast.node1.pk])
            assert services.expire_batch(10) == 1  # node2 only
            cursor.execute("COMMIT")
    finally:
        heartbeat_side.close()
    node1, node2 = Node.objects.get(pk=cast.node1.pk), Node.objects.get(pk=cast.node2.pk)
    assert node1.health == Health.HEALTHY and node1.heartbeat_deadline > timezone.now()
    assert (node2.health, node2.heartbeat_deadline) == (Health.UNREACHABLE, None)
    assert list(Event.objects.filter(kind="node.health").values_list("node__hostname", flat=True)) == [node2.hostname]


@pytest.mark.django_db
def test_a_draining_node_that_runs_nothing_any_more_is_drained(cast, post):
    Node.objects.filter(pk=cast.node1.pk).update(running=[{"job": "1", "generation": 1, "pids": [], "started_at": 0}])
    cast.node1.refresh_from_db()
    services.drain_node(cast.node1, actor="user:otto", reason="swap a fan")
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINING
    post("heartbeat", heartbeat(cast.node1, running=[{"job": "1", "generation": 1}]))
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINING
    post("heartbeat", heartbeat(cast.node1, running=[]))
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINED
    assert Event.objects.get(kind="node.drained", node=cast.node1).actor == "node:gpu-01"


def test_the_sweep_runs_often_enough_for_a_death_to_be_found_within_two_seconds_of_its_deadline():
    """Issue 18: node death found within the heartbeat timeout + 2 s; the sweep's period is what comes on top."""
    from nodes.beat import BEAT_SCHEDULE

    sweep = BEAT_SCHEDULE["nodes-expire-heartbeats"]
    assert sweep["task"] == "nodes.tasks.expire_heartbeats"
    assert sweep["schedule"] <= 1.0
    assert sweep["options"]["expires"] > sweep["schedule"]
