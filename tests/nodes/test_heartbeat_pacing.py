"""Heartbeat pacing: the interval the control plane asks for grows with the fleet, and each node is
judged by the interval it was asked for (``nodes.services.fleet``, "heartbeat pacing")."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from nodes.models import Node
from nodes.services import fleet
from tests.nodes.conftest import heartbeat, register_body


def _fleet_of(count: int) -> None:
    """``count`` more nodes we expect heartbeats from (each with a deadline)."""
    deadline = timezone.now() + timedelta(minutes=1)
    first = Node.objects.filter(hostname__startswith="paced-").count()
    Node.objects.bulk_create([Node(hostname=f"paced-{i:05d}", address=f"10.9.{i // 250}.{i % 250}", health="healthy",
                                   heartbeat_deadline=deadline) for i in range(first, first + count)])
    fleet.forget_fleet_count()


@pytest.fixture
def pacing(settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 5, "HEARTBEAT_MISSES": 3,
                           "MAX_HEARTBEATS_PER_S": 10.0, "HEARTBEAT_INTERVAL_MAX_S": 30.0}


@pytest.mark.django_db
def test_a_small_fleet_is_asked_for_the_configured_interval(cast, post, pacing):
    with time_machine.travel("2026-12-04 12:00:00Z", tick=False):
        response = post("heartbeat", heartbeat(cast.node1, interval_s=5.0))
    assert response.status_code == 200, response.content
    assert response.json() == {"commands": [], "heartbeat_interval_s": 5.0}
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.heartbeat_deadline - node.last_heartbeat_at == timedelta(seconds=15)


@pytest.mark.django_db
def test_a_larger_fleet_is_asked_to_beat_less_often_and_judged_by_that(cast, post, pacing):
    _fleet_of(123)  # 123 nodes with a deadline (the cast's have none yet), at 10 a second: 12.3 s, asked as 12.5
    with time_machine.travel("2026-12-04 12:00:00Z", tick=False):
        response = post("heartbeat", heartbeat(cast.node1, interval_s=5.0))
    assert response.json()["heartbeat_interval_s"] == 12.5
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.heartbeat_deadline - node.last_heartbeat_at == timedelta(seconds=3 * 12.5)
    assert fleet.heartbeat_timeout() == timedelta(seconds=37.5)  # what the sweepers hold nodes to


@pytest.mark.django_db
def test_the_paced_interval_is_rounded_up_and_capped(cast, pacing, settings):
    _fleet_of(121)  # 12.1 s, asked as 12.5
    assert fleet.heartbeat_interval_s() == 12.5
    _fleet_of(400)
    assert fleet.heartbeat_interval_s() == 30.0  # 52.1 s by the rate, capped
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "MAX_HEARTBEATS_PER_S": 0}
    assert fleet.heartbeat_interval_s() == 5.0  # pacing off


@pytest.mark.django_db
def test_the_count_of_the_fleet_is_taken_once_per_ttl(cast, pacing, django_assert_num_queries):
    with django_assert_num_queries(1):
        assert fleet.heartbeat_interval_s() == 5.0
        assert fleet.heartbeat_interval_s() == 5.0
    _fleet_of(200)  # forgets the count, as a bulk change of the fleet should
    with django_assert_num_queries(1):
        assert fleet.heartbeat_interval_s() == 20.0  # 200 nodes
    with time_machine.travel(timezone.now() + timedelta(seconds=fleet.FLEET_COUNT_TTL_S + 1)):
        Node.objects.filter(hostname__startswith="paced-").delete()
        with django_assert_num_queries(0):
            assert fleet.heartbeat_interval_s() == 20.0  # the count is still fresh by the monotonic clock


@pytest.mark.django_db
def test_an_agent_that_does_not_say_its_interval_is_not_paced(cast, post, pacing):
    """An agent older than pacing: its answer has no field it would refuse, and its deadline is the
    configured interval's, which is the one it beats at."""
    _fleet_of(123)
    with time_machine.travel("2026-12-04 12:00:00Z", tick=False):
        response = post("heartbeat", heartbeat(cast.node1))
    assert response.json() == {"commands": []}
    node = Node.objects.get(pk=cast.node1.pk)
    assert node.heartbeat_deadline - node.last_heartbeat_at == timedelta(seconds=15)


@pytest.mark.django_db
def test_registration_announces_the_configured_interval(cast, api, pacing):
    """An old agent keeps registration's interval for good: it must be one it is judged by."""
    from core.models import ApiToken, Scope

    _fleet_of(123)
    _, raw = ApiToken.issue(name="boot", scope=Scope.BOOTSTRAP, single_use=True)
    response = api(None).post("/api/v1/agents/register", register_body(raw), format="json")
    assert response.status_code == 201, response.content
    assert response.json()["heartbeat_interval_s"] == 5.0
    node = Node.objects.get(hostname="gpu-new-01")
    assert node.heartbeat_deadline - node.last_heartbeat_at == timedelta(seconds=15)
