"""Agent events: stored once by key (the evidence), acted on and signalled once."""

from __future__ import annotations

import time

import pytest
from django.test import TestCase

from jobs.models import Event, Generation
from nodes import services, signals
from nodes.choices import Health, Schedulability
from nodes.models import AgentEventRecord, Node, NodePairBandwidth
from tests.nodes.conftest import event

EXIT = {"exit_code": 1, "ranks": [{"rank": 1, "local_rank": 1, "exit_code": 1}], "root_cause_rank": 1,
        "signature": "oom", "error_line": "torch.OutOfMemoryError: CUDA out of memory", "log_tail": ["..."]}


@pytest.fixture
def placed(cast):
    """Generations 1 and 2 of cast.job placed on node1: its agent may report for them."""
    for number in (1, 2):
        Generation.objects.create(job=cast.job, number=number, world_size=2).nodes.add(cast.node1)


@pytest.fixture
def received():
    """Every nodes signal sent, as (signal name, kwargs)."""
    names = ["generation_exited", "generation_launched", "launch_refused", "health_checked", "drain_acked",
             "node_health_changed", "command_acked"]
    got = []
    for name in names:
        getattr(signals, name).connect(lambda name=name, **kw: got.append((name, kw)), weak=False,
                                       dispatch_uid=f"test-{name}")
    yield got
    for name in names:
        getattr(signals, name).disconnect(dispatch_uid=f"test-{name}")


@pytest.mark.django_db
def test_an_exit_report_is_stored_and_signalled_once_even_when_replayed(cast, placed, post, received):
    body = {"events": [event("e-1", "exited", job=cast.job.pk, generation=1, detail=EXIT)]}
    with TestCase.captureOnCommitCallbacks(execute=True):
        first = post("events", body)
    assert first.status_code == 202, first.content
    assert first.json() == {"accepted": 1, "duplicates": 0}
    with TestCase.captureOnCommitCallbacks(execute=True):
        assert post("events", body).json() == {"accepted": 0, "duplicates": 1}
    record = AgentEventRecord.objects.get(node=cast.node1, key="e-1")
    assert (record.kind, record.job_id, record.generation) == ("exited", cast.job.pk, 1)
    assert record.detail["signature"] == "oom" and record.detail["requested_stop"] is False  # defaults filled in
    assert [name for name, _ in received] == ["generation_exited"]
    kwargs = received[0][1]
    assert (kwargs["node"].pk, kwargs["job_id"], kwargs["generation"], kwargs["kind"]) == (cast.node1.pk, cast.job.pk,
                                                                                           1, "exited")
    assert kwargs["detail"]["error_line"] == EXIT["error_line"] and kwargs["record_id"] == record.pk


@pytest.mark.django_db
def test_each_kind_reaches_its_signal(cast, placed, post, received):
    report = {"ok": False, "reason": "GPU 0: 91 °C", "checks": [
        {"name": "temperature", "ok": False, "detail": "GPU 0: 91 °C", "gpu": 0, "value": 91.0, "limit": 85.0}]}
    events = [
        event("l", "launched", job=cast.job.pk, generation=1, detail={"pid": 42, "log_path": "/var/log/x"}),
        event("r", "launch_refused", job=cast.job.pk, generation=2, detail=report),
        event("s", "stopped", job=cast.job.pk, generation=1, detail={**EXIT, "requested_stop": True}),
        event("h", "health_check", detail={"ok": True}),
        event("d", "drain_ack", detail={"reason": "fan", "running": []}),
        event("a", "agent_started", detail={"agent_version": "0.3.0", "gpu_telemetry": True}),
        event("t", "telemetry_dropped", detail={"count": 5, "total": 9}),
    ]
    with TestCase.captureOnCommitCallbacks(execute=True):
        assert post("events", {"events": events}).json() == {"accepted": 7, "duplicates": 0}
    assert [name for name, _ in received] == ["generation_launched", "launch_refused", "generation_exited",
                                              "health_checked", "drain_acked"]
    by_name = dict(received)
    assert by_name["launch_refused"]["reason"] == "GPU 0: 91 °C" and by_name["launch_refused"]["generation"] == 2
    assert by_name["generation_exited"]["kind"] == "stopped"
    assert by_name["health_checked"]["ok"] is True
    assert by_name["drain_acked"]["running"] == []
    assert Node.objects.get(pk=cast.node1.pk).agent_version == "0.3.0"


@pytest.mark.django_db
def test_an_event_of_a_job_we_do_not_know_is_kept_with_the_raw_reference(cast, post):
    post("events", {"events": [event("x", "exited", job="9999", generation=3, detail=EXIT)]})
    record = AgentEventRecord.objects.get(key="x")
    assert (record.job_id, record.job_ref) == (None, "9999")


@pytest.mark.django_db
def test_bandwidth_results_are_kept_per_node_pair_latest_first(cast, post):
    def probe(key, mbps, ok):
        result = {"peer": str(cast.node2.pk), "address": "10.0.0.2", "expected_mbps": 1000.0, "ok": ok, "mbps": mbps}
        ghost = {"peer": "gone-node", "address": "10.0.0.3", "expected_mbps": 1000.0, "ok": False, "error": "refused"}
        return event(key, "health_check", detail={"ok": ok, "bandwidth": [result, ghost]})

    post("events", {"events": [probe("p1", 950.0, True)]})
    post("events", {"events": [probe("p2", 410.0, False)]})
    pair = NodePairBandwidth.objects.get(source=cast.node1, peer=cast.node2)
    assert (pair.mbps, pair.ok, pair.expected_mbps) == (410.0, False, 1000.0)
    assert NodePairBandwidth.objects.count() == 1


@pytest.mark.django_db
def test_a_drain_ack_with_nothing_running_completes_the_drain(cast, post):
    Node.objects.filter(pk=cast.node1.pk).update(running=[{"job": "1", "generation": 1}])
    cast.node1.refresh_from_db()
    services.drain_node(cast.node1, actor="user:otto", reason="repair")
    post("events", {"events": [event("d1", "drain_ack", detail={"running": [{"job": "1", "generation": 1}]})]})
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINING
    post("events", {"events": [event("d2", "drain_ack", detail={"running": []})]})
    assert Node.objects.get(pk=cast.node1.pk).schedulability == Schedulability.DRAINED


@pytest.mark.django_db
def test_a_fresh_critical_xid_event_marks_the_node_unhealthy_at_once(cast, post):
    post("events", {"events": [event("x1", "xid", detail={"gpu": 3, "code": 13})]})  # not critical
    assert Node.objects.get(pk=cast.node1.pk).health == Health.HEALTHY
    post("events", {"events": [event("x2", "xid", detail={"gpu": 3, "code": 79}, at=time.time() - 3600)]})  # history
    assert Node.objects.get(pk=cast.node1.pk).health == Health.HEALTHY
    post("events", {"events": [event("x3", "xid", detail={"gpu": 3, "code": 79})]})
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.health, node.health_reason) == (Health.UNHEALTHY, "GPU 3: critical Xid 79")
    assert node.schedulability == Schedulability.DRAINED
    assert Event.objects.filter(kind="node.health", node=node).count() == 1


@pytest.mark.django_db
def test_a_bad_detail_refuses_the_whole_batch(cast, post):
    body = {"events": [event("ok", "launched", job=cast.job.pk, generation=1, detail={"pid": 1, "log_path": "/x"}),
                       event("bad", "exited", job=cast.job.pk, generation=1, detail={"exit_code": "one"})]}
    response = post("events", body)
    assert response.status_code == 400
    assert response.json()["errors"] == [{"field": "events.1.detail.exit_code", "reason": "expected an integer, "
                                          "got a string"}]
    assert not AgentEventRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_events_batch_holds_its_node_without_blocking_another_transactions_key_check(cast, placed):
    """The batch locks its node row so that two deliveries cannot both count an event as new, but as
    ``FOR NO KEY UPDATE``: a foreign-key check from another transaction (``FOR KEY SHARE``: an incident
    naming the node, committed by a hang verdict that had locked the job this batch's records point to)
    goes on. With ``FOR UPDATE`` the two waited for each other: a deadlock at 1,024 nodes."""
    from agents.protocol import agent as wire
    from agents.protocol import parse
    from nodes.services import ingest
    from tests.db import InThread, other_connection

    events = wire.parse_event_details(parse(wire.EventBatch, {"events": [
        event("e-lock", "launched", job=cast.job.pk, generation=1, detail={"pid": 4242, "log_path": "/tmp/g1.log"})]}))
    locker, checker = other_connection(), other_connection()
    delivery = InThread(lambda: ingest.record_agent_events(cast.node1, events))
    try:
        locker.execute("LOCK TABLE nodes_agenteventrecord IN EXCLUSIVE MODE")  # the batch's insert waits here
        delivery.start()
        deadline = time.monotonic() + 10
        while not checker.execute("SELECT 1 FROM pg_locks WHERE NOT granted "
                                  "AND relation = 'nodes_agenteventrecord'::regclass").fetchone():
            assert not delivery.outcome, f"the batch ended first: {delivery.outcome}"
            assert time.monotonic() < deadline, "the batch never reached its insert"
            time.sleep(0.02)
        checker.execute("SET lock_timeout = '2s'")
        assert checker.execute("SELECT 1 FROM nodes_node WHERE id = %s FOR KEY SHARE",
                               (cast.node1.pk,)).fetchone() == (1,)
        checker.rollback()
    finally:
        locker.rollback()
        locker.close()
        checker.close()
    delivery.join(timeout=30)
    assert AgentEventRecord.objects.filter(node=cast.node1, key="e-lock").count() == 1
