"""Fleet silence: the heartbeat sweeper holds when (nearly) every node goes quiet at once."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from core.events import EventKind
from jobs import progress
from jobs.models import Event, Job
from nodes import services, tasks
from nodes.choices import Health
from nodes.models import Node
from nodes.services import silence
from nodes.services.fleet import forget_fleet_count, heartbeat_interval_s

T0 = "2026-11-30 12:00:00Z"


@pytest.fixture
def fleet(cast, settings):
    """Three nodes heartbeating every 2 s (deadline 6 s), hold 60 s; gpu-03 is a third agent."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 2, "HEARTBEAT_MISSES": 3,
                           "FLEET_SILENCE_FRACTION": 0.55, "FLEET_SILENCE_MIN_NODES": 2, "FLEET_SILENCE_HOLD_S": 60}
    node3 = Node.objects.create(hostname="gpu-03", address="10.0.0.3", health="healthy")
    return [cast.node1, cast.node2, node3]


def beat(*nodes):
    for node in nodes:
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now(),
                                               heartbeat_deadline=timezone.now() + timedelta(seconds=6))


def transitions() -> list[str]:
    events = Event.objects.filter(kind=EventKind.FLEET_SILENCE).order_by("created_at", "pk")
    return list(events.values_list("new_state", flat=True))


@pytest.mark.django_db
def test_one_silent_node_of_three_is_a_node_problem(fleet):
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(5)
        beat(fleet[1], fleet[2])
        clock.shift(2)
        assert tasks.expire_heartbeats() == 1
    assert Node.objects.get(pk=fleet[0].pk).health == Health.UNREACHABLE
    assert transitions() == []


@pytest.mark.django_db
def test_when_most_of_the_fleet_goes_silent_together_nobody_turns_unreachable(fleet):
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(5)
        beat(fleet[2])
        clock.shift(2)  # two of three (67% >= 55%) past their deadline
        assert tasks.expire_heartbeats() == 0
        clock.shift(10)
        assert tasks.expire_heartbeats() == 0
        assert silence.held()
    assert set(Node.objects.values_list("health", flat=True)) == {Health.HEALTHY}
    assert transitions() == ["silent"]  # one event per transition, not per sweep
    event = Event.objects.get(kind=EventKind.FLEET_SILENCE)
    assert (event.evidence["silent"], event.evidence["expected"]) == (2, 3)
    assert "suspecting the control plane's own ingress" in event.reason


@pytest.mark.django_db
def test_nodes_that_stop_together_pass_their_deadlines_apart_and_are_still_one_silence(fleet):
    """Each agent beats on its own clock: the first deadline runs out up to one interval before
    the others, and that node must not be taken for a lone failure."""
    with time_machine.travel(T0, tick=False) as clock:
        beat(fleet[0])
        clock.shift(1.5)
        beat(fleet[1], fleet[2])  # then all three stop
        clock.shift(4.6)  # fleet[0] 0.1 s past its deadline, the others 1.4 s short of theirs
        assert tasks.expire_heartbeats() == 0
    assert set(Node.objects.values_list("health", flat=True)) == {Health.HEALTHY}
    assert transitions() == ["silent"]


@pytest.mark.django_db
def test_contact_restored_restarts_the_deadlines_that_ran_out_meanwhile(fleet, cast):
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        Job.objects.filter(pk=cast.job.pk).update(state="running", recovery_policy={"progress_timeout_s": 30},
                                                  progress_deadline=timezone.now() + timedelta(seconds=8))
        clock.shift(7)
        assert tasks.expire_heartbeats() == 0  # all three silent: hold
        clock.shift(20)
        assert progress.expire_one_progress_deadline() is False  # the job's deadline ran out: held
        beat(fleet[0])  # the API is back: one agent gets through first
        assert tasks.expire_heartbeats() == 0
        assert transitions() == ["silent", "restored"]
        now = timezone.now()
        # The two still on their way get one heartbeat timeout, the job its progress timeout.
        assert set(Node.objects.exclude(pk=fleet[0].pk).values_list("heartbeat_deadline", flat=True)) == {
            now + timedelta(seconds=6)}
        assert Job.objects.get(pk=cast.job.pk).progress_deadline == now + timedelta(seconds=30)
        assert silence.held()  # buffered reports are still arriving
        clock.shift(6.5)
        assert not silence.held()
        beat(fleet[0], fleet[1])  # fleet[2] never came back: after the grace it is a node problem again
        assert tasks.expire_heartbeats() == 1
    assert Node.objects.get(pk=fleet[2].pk).health == Health.UNREACHABLE
    assert "restored after 20 s" in Event.objects.filter(kind=EventKind.FLEET_SILENCE).last().reason


@pytest.mark.django_db
def test_a_silence_longer_than_the_hold_is_given_up_to_the_partition_policy(fleet):
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(7)
        assert tasks.expire_heartbeats() == 0
        clock.shift(58)
        assert tasks.expire_heartbeats() == 0  # 59 s past the oldest deadline: still holding
        clock.shift(2)
        assert tasks.expire_heartbeats() == 3
        assert not silence.held()
    assert transitions() == ["silent", "given_up"]
    assert set(Node.objects.values_list("health", flat=True)) == {Health.UNREACHABLE}


@pytest.mark.django_db
def test_a_hold_of_zero_turns_the_watch_off(fleet, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "FLEET_SILENCE_HOLD_S": 0}
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(7)
        assert services.expire_heartbeats() == 3
    assert transitions() == []


@pytest.mark.django_db
def test_a_lone_node_is_never_a_fleet(cast, settings):
    """Below FLEET_SILENCE_MIN_NODES there is no telling our side from the node's."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 2, "HEARTBEAT_MISSES": 3}
    Node.objects.filter(pk=cast.node2.pk).update(heartbeat_deadline=None)
    with time_machine.travel(T0, tick=False) as clock:
        beat(cast.node1)
        clock.shift(7)
        assert tasks.expire_heartbeats() == 1
    assert transitions() == []


def spread_fleet(fleet, n: int = 10) -> list[Node]:
    """``n`` nodes whose last heartbeat got through at T0 - 0.5 s but whose deadlines are spread over
    most of a timeout (T0 + 3.5 s ... + 8.9 s), as under overload, where a node's last contact may be
    a refused request (core.refusals) and the nodes' last contacts lie a whole timeout apart."""
    nodes = fleet + [Node.objects.create(hostname=f"gpu-{i:02d}", address=f"10.0.1.{i}", health="healthy")
                     for i in range(4, n + 1)]
    for i, node in enumerate(nodes):
        Node.objects.filter(pk=node.pk).update(
            last_heartbeat_at=timezone.now() - timedelta(seconds=0.5),
            heartbeat_deadline=timezone.now() + timedelta(seconds=3.5 + 0.6 * i))
    return nodes


@pytest.mark.django_db
def test_no_heartbeat_from_anyone_for_one_and_a_half_intervals_is_our_silence_whatever_the_fraction(fleet):
    """Issue 18's 1,024-node outage: the first sweeps saw 17 % of the fleet past its deadline, below
    the fraction, and 1,023 live nodes were marked unreachable."""
    with time_machine.travel(T0, tick=False) as clock:
        spread_fleet(fleet)
        clock.shift(4)  # one node past its deadline, 5 of 10 within an interval of theirs (< 55 %)
        assert not silence.measure(timezone.now()).silent >= 0.55 * 10
        assert tasks.expire_heartbeats() == 0  # but nobody got through for 4.5 s: 1.5 intervals is 3 s
    assert transitions() == ["silent"]
    assert set(Node.objects.values_list("health", flat=True)) == {Health.HEALTHY}


@pytest.mark.django_db
def test_the_same_spread_with_one_node_still_getting_through_is_a_node_problem(fleet):
    with time_machine.travel(T0, tick=False) as clock:
        nodes = spread_fleet(fleet)
        clock.shift(3.9)
        beat(nodes[-1])
        clock.shift(0.1)
        assert tasks.expire_heartbeats() == 1
    assert transitions() == []
    assert Node.objects.get(pk=nodes[0].pk).health == Health.UNREACHABLE


@pytest.mark.django_db
def test_a_paced_fleet_that_goes_quiet_is_our_silence_before_any_deadline_passes(cast, settings):
    """bench.fleet's storm with heartbeat pacing: 1,088 nodes' deadlines were 66 s away, the web
    stopped for 30 s, no deadline passed, so nothing held the jobs' progress deadlines: 20 jobs hung."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "HEARTBEAT_INTERVAL_S": 5, "HEARTBEAT_MISSES": 3,
                           "MAX_HEARTBEATS_PER_S": 50.0, "FLEET_SILENCE_MIN_NODES": 2, "FLEET_SILENCE_HOLD_S": 120}
    with time_machine.travel(T0, tick=False) as clock:
        now = timezone.now()
        Node.objects.bulk_create([Node(hostname=f"quiet-{i:03d}", address=f"10.1.{i // 200}.{i % 200}",
                                       health="healthy", last_heartbeat_at=now - timedelta(seconds=i % 6),
                                       heartbeat_deadline=now + timedelta(seconds=18 - i % 6)) for i in range(300)])
        forget_fleet_count()
        assert heartbeat_interval_s() == 6.0  # 300 nodes at 50 a second: paced
        Job.objects.filter(pk=cast.job.pk).update(state="running", recovery_policy={"progress_timeout_s": 5},
                                                  progress_deadline=now + timedelta(seconds=5))
        clock.shift(7.0)  # 7 s since the newest heartbeat: not yet 1.5 configured intervals
        assert tasks.expire_heartbeats() == 0 and transitions() == []
        clock.shift(1.0)  # 8 s of nothing from a fleet that sends 50 a second; no deadline has passed
        assert tasks.expire_heartbeats() == 0
        assert transitions() == ["silent"]
        assert "no heartbeat from any of 300 nodes for 8.0 s" in Event.objects.get(kind=EventKind.FLEET_SILENCE).reason
        assert progress.expire_one_progress_deadline() is False  # the job's deadline ran out: held
        Node.objects.filter(hostname="quiet-000").update(last_heartbeat_at=timezone.now())  # the web is back
        assert tasks.expire_heartbeats() == 0
        assert transitions() == ["silent", "restored"]
        # It starts over a (paced) heartbeat timeout from now, longer than its own 5 s: reports buffered
        # through the outage need that long to arrive.
        assert Job.objects.get(pk=cast.job.pk).progress_deadline == timezone.now() + timedelta(seconds=18)
    assert set(Node.objects.values_list("health", flat=True)) == {Health.HEALTHY}
    assert Job.objects.get(pk=cast.job.pk).state == "running"


@pytest.mark.django_db
def test_an_unpaced_fleet_keeps_to_its_deadlines(fleet, settings):
    """The same quiet without pacing is left to the deadline rules, which speak within an outage."""
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "MAX_HEARTBEATS_PER_S": 0}
    with time_machine.travel(T0, tick=False) as clock:
        beat(*fleet)
        clock.shift(4)  # 2 configured intervals of nothing, no deadline passed
        assert tasks.expire_heartbeats() == 0
    assert transitions() == []
