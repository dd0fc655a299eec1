"""The command queue: validated, idempotent, re-delivered until acknowledged, fenced by generation."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import time_machine
from django.test import TestCase

from agents.protocol import ProtocolError
from jobs import state
from jobs.choices import JobState
from jobs.models import Event
from nodes import services, signals
from nodes.choices import CommandState
from nodes.models import NodeCommand
from tests.nodes.conftest import heartbeat

LAUNCH = {"script": "train.py", "nnodes": 1, "nproc_per_node": 2, "node_rank": 0, "rdzv_endpoint": "10.0.0.1:29400",
          "rdzv_id": "job-1-gen-1", "nccl_env": {"NCCL_DEBUG": "WARN"}}


@pytest.fixture
def generation_one(cast):
    state.transition(cast.job, JobState.INITIALIZING, actor="test")  # generation 1
    return cast.job


def ack(command, status="done", **fields):
    body = {"command_id": str(command.pk), "idempotency_key": command.idempotency_key, "status": status,
            "time": time.time()}
    body.update(fields)
    return body


@pytest.mark.django_db
def test_enqueue_validates_with_the_protocol_and_stores_the_canonical_payload(cast, generation_one):
    command = services.enqueue_command(cast.node1, "launch", job=generation_one, generation=1, payload=LAUNCH,
                                       idempotency_key="launch:1:1:1", actor="system:orchestrator")
    assert command.payload["require_gpu"] is True  # defaults filled in: what the agent will parse
    assert command.state == CommandState.PENDING and command.expires_at > command.created_at
    with pytest.raises(ProtocolError, match="nccl_env.NCCL_DEBG"):
        services.enqueue_command(cast.node1, "launch", job=generation_one, generation=1,
                                 payload={**LAUNCH, "nccl_env": {"NCCL_DEBG": "INFO"}})
    with pytest.raises(ProtocolError, match="needs a job and a generation"):
        services.enqueue_command(cast.node1, "stop", payload={})
    with pytest.raises(ProtocolError, match="grace_s"):
        services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1, payload={"grace_s": -1})
    assert NodeCommand.objects.count() == 1


@pytest.mark.django_db
def test_the_same_idempotency_key_returns_the_first_command(cast, generation_one):
    first = services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1, idempotency_key="k")
    again = services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1, idempotency_key="k")
    other_node = services.enqueue_command(cast.node2, "stop", job=generation_one, generation=1, idempotency_key="k")
    assert first.pk == again.pk != other_node.pk
    assert NodeCommand.objects.count() == 2


@pytest.mark.django_db
def test_commands_are_re_delivered_in_every_heartbeat_until_acknowledged(cast, post, generation_one):
    command = services.enqueue_command(cast.node1, "launch", job=generation_one, generation=1, payload=LAUNCH)
    services.enqueue_command(cast.node2, "health_check")  # another node's: never delivered to node1
    for seq in (1, 2):
        commands = post("heartbeat", heartbeat(cast.node1, seq=seq)).json()["commands"]
        assert [c["id"] for c in commands] == [str(command.pk)]
    delivered = commands[0]
    assert (delivered["kind"], delivered["job"], delivered["generation"]) == ("launch", str(generation_one.pk), 1)
    assert delivered["payload"]["rdzv_id"] == "job-1-gen-1"
    command.refresh_from_db()
    assert (command.state, command.delivery_count) == (CommandState.DELIVERED, 2)
    response = post(f"commands/{command.pk}/ack", ack(command, detail="torchrun pid 4242"))
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "acked"
    assert post("heartbeat", heartbeat(cast.node1, seq=3)).json()["commands"] == []


@pytest.mark.django_db
def test_the_first_acknowledgement_counts_and_repeats_change_nothing(cast, post, generation_one):
    command = services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1)
    got = []
    signals.command_acked.connect(lambda **kw: got.append(kw), weak=False, dispatch_uid="t")
    try:
        with TestCase.captureOnCommitCallbacks(execute=True):
            post(f"commands/{command.pk}/ack", ack(command, "done", detail="stopped"))
            again = post(f"commands/{command.pk}/ack", ack(command, "failed", detail="later"))
    finally:
        signals.command_acked.disconnect(dispatch_uid="t")
    assert again.status_code == 200 and again.json()["state"] == "acked"
    command.refresh_from_db()
    assert (command.state, command.detail) == (CommandState.ACKED, "stopped")
    assert [(kw["kind"], kw["status"], kw["job_id"], kw["generation"]) for kw in got] == [
        ("stop", "done", generation_one.pk, 1)]
    event = Event.objects.get(kind="node.command")
    assert (event.old_state, event.new_state, event.actor, event.job_id) == ("pending", "acked", "node:gpu-01",
                                                                              generation_one.pk)


@pytest.mark.django_db
@pytest.mark.parametrize(("status", "state_"), [("refused", CommandState.REFUSED), ("failed", CommandState.FAILED)])
def test_refusals_and_failures_are_recorded(cast, post, generation_one, status, state_):
    command = services.enqueue_command(cast.node1, "health_check")
    post(f"commands/{command.pk}/ack", ack(command, status, detail="no NVML"))
    command.refresh_from_db()
    assert (command.state, command.detail) == (state_, "no NVML")


@pytest.mark.django_db
def test_an_ack_for_a_stale_generation_is_409_and_closes_the_command(cast, post, generation_one):
    command = services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1)
    for target in (JobState.QUIESCING, JobState.RECOVERING, JobState.INITIALIZING):  # generation 2
        state.transition(generation_one, target, actor="t")
    response = post(f"commands/{command.pk}/ack", ack(command, job=str(generation_one.pk), generation=1))
    assert response.status_code == 409
    assert "generation 1 is stale; the active generation is 2" in response.json()["detail"]
    command.refresh_from_db()
    assert command.state == CommandState.EXPIRED and "stale" in command.detail
    assert not Event.objects.filter(kind="node.command").exists()
    assert post("heartbeat", heartbeat(cast.node1)).json()["commands"] == []


@pytest.mark.django_db
def test_a_launch_for_a_stale_generation_is_never_delivered(cast, post, generation_one):
    command = services.enqueue_command(cast.node1, "launch", job=generation_one, generation=1, payload=LAUNCH)
    for target in (JobState.QUIESCING, JobState.RECOVERING, JobState.INITIALIZING):
        state.transition(generation_one, target, actor="t")
    assert post("heartbeat", heartbeat(cast.node1)).json()["commands"] == []
    command.refresh_from_db()
    assert command.state == CommandState.EXPIRED


@pytest.mark.django_db
@pytest.mark.parametrize(("change", "expected"), [
    ({"idempotency_key": "other"}, 409), ({"generation": 7}, 409), ({"command_id": "12345"}, 400)])
def test_an_ack_that_contradicts_the_command_is_refused(cast, post, generation_one, change, expected):
    command = services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1)
    response = post(f"commands/{command.pk}/ack", ack(command, **change))
    assert response.status_code == expected, response.content
    command.refresh_from_db()
    assert command.state == CommandState.PENDING


@pytest.mark.django_db
def test_an_ack_of_another_nodes_command_is_404(cast, post):
    theirs = services.enqueue_command(cast.node2, "health_check")
    response = post(f"commands/{theirs.pk}/ack", ack(theirs))
    assert response.status_code == 404
    theirs.refresh_from_db()
    assert theirs.state == CommandState.PENDING


@pytest.mark.django_db
def test_commands_nobody_acknowledges_expire_but_a_late_ack_is_still_recorded(cast, post, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "COMMAND_TTL_S": 60}
    with time_machine.travel("2026-11-30 12:00:00Z", tick=False) as clock:
        command = services.enqueue_command(cast.node1, "health_check")
        orphan = services.enqueue_command(cast.node2, "health_check")
        clock.shift(timedelta(seconds=61))
        assert post("heartbeat", heartbeat(cast.node1)).json()["commands"] == []
        assert services.expire_commands() == 1  # node2 never asked: the sweeper closes it
        post(f"commands/{command.pk}/ack", ack(command))
    command.refresh_from_db()
    orphan.refresh_from_db()
    assert (command.state, orphan.state) == (CommandState.ACKED, CommandState.EXPIRED)


@pytest.mark.django_db
def test_the_queue_is_visible_to_people(cast, api, generation_one):
    services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1)
    services.enqueue_command(cast.node1, "health_check")
    listed = api(cast.tokens["viewer"]).get(f"/api/v1/nodes/{cast.node1.pk}/commands").json()
    assert [c["kind"] for c in listed["results"]] == ["health_check", "stop"]
    only = api(cast.tokens["viewer"]).get(f"/api/v1/nodes/{cast.node1.pk}/commands", {"state": "acked"}).json()
    assert only["count"] == 0
    bad = api(cast.tokens["viewer"]).get(f"/api/v1/nodes/{cast.node1.pk}/commands", {"state": "nope"})
    assert bad.status_code == 400


@pytest.mark.django_db
def test_a_node_with_open_commands_is_named_to_admission_control_until_it_acknowledged_them(cast, post,
                                                                                           generation_one):
    """Its heartbeats carry the commands, so they are let in as urgent (core.admission): named once
    the command is committed, forgotten once the node acknowledged its last open one."""
    from core import shared_counts
    from core.models import hash_token

    redis = shared_counts.client()
    if redis is None:
        pytest.fail("this test reads the shared counts: run it with REDIS_URL (as `make test` does)")
    redis.delete(shared_counts.AWAITED)
    node1, node2 = hash_token(cast.tokens["agent"]), hash_token(cast.tokens["agent2"])

    def awaited():
        return shared_counts.awaited_heartbeats(600, now=time.time())

    with TestCase.captureOnCommitCallbacks(execute=True):
        launch = services.enqueue_command(cast.node1, "launch", job=generation_one, generation=1, payload=LAUNCH)
        assert awaited() == frozenset()  # not before the command is committed
    with TestCase.captureOnCommitCallbacks(execute=True):
        stop = services.enqueue_command(cast.node1, "stop", job=generation_one, generation=1)
    assert awaited() == {node1}
    post("heartbeat", heartbeat(cast.node1))  # delivered, not acknowledged: still carrying
    assert awaited() == {node1}
    post(f"commands/{launch.pk}/ack", ack(launch))
    assert awaited() == {node1}  # the stop is still open
    post(f"commands/{stop.pk}/ack", ack(stop, detail="stopped"))
    assert node2 not in awaited() and awaited() == frozenset()
    redis.delete(shared_counts.AWAITED)


@pytest.mark.django_db
def test_a_batch_is_queued_as_each_command_would_be_and_a_bad_order_writes_none(cast, generation_one):
    from core import shared_counts
    from core.models import hash_token

    redis = shared_counts.client()
    if redis is None:
        pytest.fail("this test reads the shared counts: run it with REDIS_URL (as `make test` does)")
    redis.delete(shared_counts.AWAITED)
    orders = [services.Order(cast.node1, {"grace_s": 5}, "stop:1"), services.Order(cast.node2, None, "stop:2")]
    with pytest.raises(ProtocolError, match="grace_s"):
        services.enqueue_commands("stop", [*orders, services.Order(cast.node1, {"grace_s": -1}, "stop:3")],
                                  job=generation_one, generation=1)
    assert not NodeCommand.objects.exists()
    with TestCase.captureOnCommitCallbacks(execute=True):
        first = services.enqueue_commands("stop", orders, job=generation_one, generation=1)
    assert [(c.node, c.idempotency_key, c.payload["grace_s"]) for c in first] == [
        (cast.node1, "stop:1", 5), (cast.node2, "stop:2", 30)]  # the protocol's default grace filled in
    assert shared_counts.awaited_heartbeats(600, now=time.time()) == {hash_token(cast.tokens["agent"]),
                                                                      hash_token(cast.tokens["agent2"])}
    again = services.enqueue_commands("stop", orders[::-1], job=generation_one, generation=1)
    assert [c.pk for c in again] == [c.pk for c in first[::-1]]  # the first of each key, in the orders' order
    assert NodeCommand.objects.count() == 2
    redis.delete(shared_counts.AWAITED)
