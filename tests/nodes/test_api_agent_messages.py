"""Malformed, oversized and wrongly-authenticated agent messages: a clear 4xx, and nothing stored."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from core.models import ApiToken
from jobs.models import Event, Generation
from nodes.models import GPU, AgentEventRecord, Node, NodeCommand, NodeGpuSample
from tests.nodes.conftest import batch_of, event, heartbeat, sample


def nothing_stored(node) -> bool:
    node = Node.objects.get(pk=node.pk)
    return (not NodeGpuSample.objects.exists() and not AgentEventRecord.objects.exists() and not GPU.objects.exists()
            and not Event.objects.exists() and not NodeCommand.objects.exists() and node.last_heartbeat_at is None)


def problem(response, status):
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == status and body["detail"]
    return body


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("suffix", "make", "field", "words"),
    [
        ("telemetry", lambda n: batch_of(n, gpus=8, per_gpu=250), "samples", "at most 1024 items allowed, got 2000"),
        ("telemetry", lambda n: {"samples": [sample(n, 0), sample(n, 99)]}, "samples.1.gpu", "must be <= 63"),
        ("telemetry", lambda n: {"samples": [sample(n, 0), {**sample(n, 1), "node": "0"}]}, "samples.1.node",
         "the URL is for node"),
        ("telemetry", lambda n: {"samples": [{**sample(n, 0), "temperature_c": "hot"}]}, "samples.0.temperature_c",
         "expected a number"),
        ("telemetry", lambda n: {"samples": [{**sample(n, 0), "fan_rpm": 3}]}, "samples.0.fan_rpm", "unknown field"),
        ("telemetry", lambda n: {"samples": [{**sample(n, 0), "time": 2**40}]}, "samples.0.time", "must be <="),
        ("telemetry", lambda n: {}, "samples", "this field is required"),
        ("telemetry", lambda n: [sample(n, 0)], "body", "expected an object, got a list"),
        ("heartbeat", lambda n: heartbeat(n, node_id="0"), "node_id", "the URL for node"),
        ("heartbeat", lambda n: heartbeat(n, node_id="../etc"), "node_id", "does not match"),
        ("heartbeat", lambda n: heartbeat(n, seq=-1), "seq", "must be >= 0"),
        ("events", lambda n: {"events": [event("k" * 129, "exited")]}, "events.0.key", "at most 128 characters"),
        ("events", lambda n: {"events": [event("k", "rebooted")]}, "events.0.kind", "must be one of"),
        ("events", lambda n: {"events": [event(str(i), "xid", detail={"gpu": 0, "code": 1}) for i in range(257)]},
         "events", "at most 256 items"),
        # Numbers no column can hold, refused by the protocol itself: a 400, never a database error (a 500
        # would make the agent retry the same batch for ever).
        ("telemetry", lambda n: {"samples": [sample(n, 0), sample(n, 1, memory_used=2**64)]}, "samples.1.memory_used",
         "must be a 64-bit integer"),
        ("heartbeat", lambda n: heartbeat(n, seq=2**63), "seq", "must be a 64-bit integer"),
        ("events", lambda n: {"events": [event("g", "xid", job=1, generation=2**70, detail={"gpu": 0, "code": 1})]},
         "events.0.generation", "must be a 64-bit integer"),
    ],
)
def test_a_malformed_message_names_the_field_and_stores_nothing(cast, post, suffix, make, field, words):
    body = problem(post(suffix, make(cast.node1)), 400)
    assert body["errors"][0]["field"] == field
    assert words in body["errors"][0]["reason"]
    assert nothing_stored(cast.node1)


@pytest.mark.django_db
@pytest.mark.parametrize("suffix", ["telemetry", "heartbeat", "events", "commands/1/ack"])
def test_a_body_over_the_limit_is_413_before_it_is_parsed(cast, agent, suffix):
    huge = json.dumps({"samples": [], "padding": "x" * (5 * 2**20)})
    response = agent.post(f"/api/v1/nodes/{cast.node1.pk}/{suffix}", huge, content_type="application/json")
    body = problem(response, 413)
    assert "at most 4194304 are accepted" in body["detail"]
    assert nothing_stored(cast.node1)


@pytest.mark.django_db
def test_exit_reports_with_full_log_tails_fit(cast, post):
    """Each at the protocol's log-tail bound (80 lines × 500 characters): the evidence is kept whole."""
    tail = [f"{i:03d}" + "x" * 497 for i in range(80)]
    Generation.objects.create(job=cast.job, number=1, world_size=2).nodes.add(cast.node1)
    events = [event(f"e{i}", "exited", job=cast.job.pk, generation=1, detail={"exit_code": 1, "log_tail": tail})
              for i in range(64)]
    response = post("events", {"events": events})
    assert response.status_code == 202, response.content[:300]
    assert response.json()["accepted"] == 64
    assert AgentEventRecord.objects.get(key="e63").detail["log_tail"] == tail


@pytest.mark.django_db
def test_registration_has_the_same_limit(cast, api):
    huge = json.dumps({"bootstrap_token": cast.tokens["bootstrap"], "padding": "x" * (5 * 2**20)})
    problem(api().post("/api/v1/agents/register", huge, content_type="application/json"), 413)
    assert ApiToken.objects.get(name="bootstrap").revoked_at is None


@pytest.mark.django_db
def test_a_body_that_is_not_json_is_a_clear_400_and_a_wrong_type_a_415(cast, agent):
    url = f"/api/v1/nodes/{cast.node1.pk}/telemetry"
    problem(agent.post(url, '{"samples": [', content_type="application/json"), 400)
    problem(agent.post(url, "samples=1", content_type="text/plain"), 415)
    assert nothing_stored(cast.node1)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("authorization", "status"),
    [(None, 401), ("Bearer nw_not-a-token", 401), ("Bearer two parts", 401), ("Basic dXNlcjpwYXNz", 401),
     ("revoked", 401), ("agent2", 403), ("operator", 403), ("bootstrap", 403)],
)
def test_wrongly_authenticated_messages_are_refused_and_store_nothing(cast, authorization, status):
    client = APIClient()
    if authorization == "revoked":
        ApiToken.objects.get(name="agent").revoke()
        authorization = f"Bearer {cast.tokens['agent']}"
    elif authorization in cast.tokens:
        authorization = f"Bearer {cast.tokens[authorization]}"
    if authorization:
        client.credentials(HTTP_AUTHORIZATION=authorization)
    base = f"/api/v1/nodes/{cast.node1.pk}"
    for suffix, body in [("telemetry", batch_of(cast.node1, gpus=1, per_gpu=2)), ("heartbeat", heartbeat(cast.node1)),
                         ("events", {"events": [event("e", "xid", detail={"gpu": 0, "code": 79})]})]:
        problem(client.post(f"{base}/{suffix}", body, format="json"), status)
    assert nothing_stored(cast.node1)


@pytest.mark.django_db
def test_an_unknown_node_id_in_the_path_is_a_problem_not_a_crash(cast, agent):
    problem(agent.post("/api/v1/nodes/abc/heartbeat", heartbeat(cast.node1), format="json"), 404)
    problem(agent.post("/api/v1/nodes/999999/heartbeat", heartbeat(cast.node1), format="json"), 403)
