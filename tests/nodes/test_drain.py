"""Drains, undrains and blame: the only ways schedulability and the lemon count change, each audited."""

from __future__ import annotations

import pytest

from jobs import state
from jobs.choices import JobState
from jobs.models import Event, Generation
from nodes import services
from nodes.choices import CommandKind, CommandState, Health, Schedulability, Transport
from nodes.models import Node, NodeCommand


def drain(api, token, node, reason="fan failure", verb="drain"):
    return api(token).post(f"/api/v1/nodes/{node.pk}/{verb}", {"reason": reason}, format="json")


@pytest.mark.django_db
def test_an_operator_drains_an_idle_node_audited_and_the_agent_is_told(cast, api):
    response = drain(api, cast.tokens["operator"], cast.node1)
    assert response.status_code == 200, response.content
    assert (response.json()["schedulability"], response.json()["drain_reason"]) == ("drained", "fan failure")
    event = Event.objects.get(kind="node.drain", node=cast.node1)
    assert (event.actor, event.old_state, event.new_state, event.reason) == ("token:operator(otto)", "active",
                                                                             "drained", "fan failure")
    command = NodeCommand.objects.get(node=cast.node1)
    assert (command.kind, command.payload, command.state) == (CommandKind.DRAIN, {"reason": "fan failure"},
                                                              CommandState.PENDING)
    assert not Node.objects.get(pk=cast.node1.pk).is_schedulable


@pytest.mark.django_db
def test_a_node_running_a_live_generation_is_draining_until_it_finishes(cast):
    state.transition(cast.job, JobState.INITIALIZING, actor="t")
    Generation.objects.create(job=cast.job, number=1, world_size=2).nodes.add(cast.node1)
    assert services.drain_node(cast.node1, actor="user:otto", reason="swap") is True
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINING
    assert services.finish_drain(cast.node1, actor="system:t", reason="done") is True
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINED


@pytest.mark.django_db
def test_draining_twice_changes_nothing_and_records_nothing(cast, api):
    drain(api, cast.tokens["operator"], cast.node1)
    again = drain(api, cast.tokens["oncall"], cast.node1, reason="other reason")
    assert again.status_code == 200
    assert again.json()["drain_reason"] == "fan failure"
    assert Event.objects.filter(kind="node.drain").count() == 1
    assert NodeCommand.objects.count() == 1


@pytest.mark.django_db
def test_undrain_is_audited_and_withdraws_a_drain_the_agent_has_not_acknowledged(cast, api):
    drain(api, cast.tokens["operator"], cast.node1)
    response = drain(api, cast.tokens["oncall"], cast.node1, reason="fan replaced", verb="undrain")
    assert response.status_code == 200
    assert (response.json()["schedulability"], response.json()["drain_reason"]) == ("active", "")
    event = Event.objects.get(kind="node.undrain")
    assert (event.actor, event.old_state, event.new_state, event.reason) == ("token:oncall(olga)", "drained",
                                                                             "active", "fan replaced")
    assert NodeCommand.objects.get(node=cast.node1).state == CommandState.EXPIRED
    assert services.undrain_node(cast.node1, actor="user:olga", reason="again") is False


@pytest.mark.django_db
def test_a_node_without_an_agent_gets_no_drain_command(cast):
    Node.objects.filter(pk=cast.node2.pk).update(transport=Transport.SLURM)
    cast.node2.refresh_from_db()
    assert services.drain_node(cast.node2, actor="user:otto", reason="slurm says down")
    assert not NodeCommand.objects.exists()


@pytest.mark.django_db
def test_a_reason_is_required(cast, api):
    response = api(cast.tokens["operator"]).post(f"/api/v1/nodes/{cast.node1.pk}/drain", {}, format="json")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "reason"
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.ACTIVE
    assert api(cast.tokens["operator"]).post("/api/v1/nodes/999999/drain", {"reason": "x"},
                                             format="json").status_code == 404


@pytest.mark.django_db
def test_a_racing_writer_makes_the_compare_and_set_lose_cleanly(cast):
    stale = Node.objects.get(pk=cast.node1.pk)
    services.drain_node(cast.node1, actor="user:otto", reason="first")
    assert services.drain_node(stale, actor="user:olga", reason="second") is False
    assert stale.schedulability == Schedulability.DRAINED  # refreshed from the database
    stale_health = Node.objects.get(pk=cast.node2.pk)
    services.set_health(cast.node2, Health.DEGRADED, reason="warm")
    assert services.set_health(stale_health, Health.UNREACHABLE, reason="late") is False
    assert Event.objects.filter(kind="node.drain").count() == 1
    assert Event.objects.filter(kind="node.health").count() == 1


@pytest.mark.django_db
def test_blame_counts_lemons_and_an_operator_clears_them(cast):
    assert services.blame_node(cast.node1, actor="system:orchestrator", reason="incident 1") == 1
    assert services.blame_node(cast.node1, actor="system:orchestrator", reason="incident 2",
                               evidence={"incident": 2}) == 2
    assert Node.objects.get(pk=cast.node1.pk).lemon_count == 2
    blames = list(Event.objects.filter(kind="node.blame", node=cast.node1))
    assert [(e.old_state, e.new_state, e.reason) for e in blames] == [("0", "1", "incident 1"),
                                                                     ("1", "2", "incident 2")]
    services.clear_lemon(cast.node1, actor="user:olga", reason="GPU 3 replaced")
    assert Node.objects.get(pk=cast.node1.pk).lemon_count == 0
    assert Event.objects.get(kind="node.lemon_cleared").old_state == "2"
