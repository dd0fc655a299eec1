"""Who may call what: every nodes endpoint × every kind of caller, and only the intended grants."""

from __future__ import annotations

import time

import pytest

from core.models import ApiToken
from nodes import services
from nodes.models import Node
from tests.nodes.conftest import batch_of, event, heartbeat, register_body

CALLERS = ["anonymous", "viewer", "operator", "oncall", "ci", "agent", "agent2", "bootstrap"]
PEOPLE_WHO_VIEW = {"viewer", "operator", "oncall", "ci"}


def endpoints(cast):
    """(method, path or a function making one, body or a function making one, callers allowed)."""
    n1 = cast.node1
    base = f"/api/v1/nodes/{n1.pk}"

    def ack_path():
        command = services.enqueue_command(n1, "health_check")
        return f"{base}/commands/{command.pk}/ack", {"command_id": str(command.pk), "time": time.time(),
                                                      "idempotency_key": command.idempotency_key, "status": "done"}

    return [
        ("get", "/api/v1/nodes", None, PEOPLE_WHO_VIEW),
        ("get", base, None, PEOPLE_WHO_VIEW),
        ("get", f"{base}/commands", None, PEOPLE_WHO_VIEW),
        ("post", f"{base}/drain", {"reason": "r"}, {"operator", "oncall"}),
        ("post", f"{base}/undrain", {"reason": "r"}, {"operator", "oncall"}),
        ("post", f"{base}/heartbeat", heartbeat(n1), {"agent"}),
        ("post", f"{base}/telemetry", batch_of(n1, gpus=2, per_gpu=2), {"agent"}),
        ("post", f"{base}/events", {"events": [event("k1", "health_check", detail={"ok": True})]}, {"agent"}),
        ("post", ack_path, None, {"agent"}),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("caller", CALLERS)
def test_access_matrix(cast, api, caller):
    client = api(None if caller == "anonymous" else cast.tokens[caller])
    for method, path, body, allowed in endpoints(cast):
        if callable(path):
            path, body = path()
        response = getattr(client, method)(path, body, format="json")
        if caller in allowed:
            assert response.status_code in (200, 201, 202), (caller, method, path, response.content)
        else:
            expected = 401 if caller == "anonymous" else 403
            assert response.status_code == expected, (caller, method, path, response.status_code)
            assert response["Content-Type"] == "application/problem+json"
            assert response.json()["status"] == expected


@pytest.mark.django_db
def test_an_agent_token_acts_for_its_own_node_only(cast, api):
    response = api(cast.tokens["agent2"]).post(f"/api/v1/nodes/{cast.node1.pk}/heartbeat", heartbeat(cast.node1),
                                               format="json")
    assert response.status_code == 403
    assert response.json()["detail"] == f"This token acts for node {cast.node2.pk}, not node {cast.node1.pk}."
    assert Node.objects.get(pk=cast.node1.pk).last_heartbeat_at is None


@pytest.mark.django_db
@pytest.mark.parametrize("caller", CALLERS)
def test_registration_is_decided_by_the_token_in_the_body_never_by_the_header(cast, api, caller):
    client = api(None if caller == "anonymous" else cast.tokens[caller])
    _, fresh = ApiToken.issue(name="boot", scope="bootstrap", single_use=True)
    ok = client.post("/api/v1/agents/register", register_body(fresh, hostname=f"new-{caller}"), format="json")
    assert ok.status_code == 201, ok.content
    refused = client.post("/api/v1/agents/register", register_body("nw_guess", hostname="x"), format="json")
    assert refused.status_code == 401
    assert not Node.objects.filter(hostname="x").exists()


@pytest.mark.django_db
def test_a_session_user_gets_the_role_grants(cast, client):
    client.force_login(cast.operator)
    response = client.post(f"/api/v1/nodes/{cast.node1.pk}/drain", {"reason": "r"}, content_type="application/json")
    assert response.status_code == 200
    client.force_login(cast.viewer)
    response = client.post(f"/api/v1/nodes/{cast.node1.pk}/undrain", {"reason": "r"},
                           content_type="application/json")
    assert response.status_code == 403


@pytest.mark.django_db
def test_an_operator_can_ask_for_a_pairwise_health_check_and_a_viewer_cannot(cast, api):
    from nodes.models import Node, NodeCommand

    Node.objects.filter(pk=cast.node2.pk).update(probe_port=29510)
    url = f"/api/v1/nodes/{cast.node1.pk}/health-check"
    assert api(cast.tokens["viewer"]).post(url, {"peers": [cast.node2.pk]}, format="json").status_code == 403
    response = api(cast.tokens["operator"]).post(url, {"peers": [cast.node2.pk], "expected_mbps": 5000},
                                                 format="json")
    assert response.status_code == 202, response.content
    command = NodeCommand.objects.get(node=cast.node1, kind="health_check")
    assert command.payload["peers"] == [{"node": str(cast.node2.pk), "address": "10.0.0.2", "port": 29510,
                                         "expected_mbps": 5000.0}]
    unknown = api(cast.tokens["operator"]).post(url, {"peers": [999999]}, format="json")
    assert unknown.status_code == 400 and unknown.json()["errors"][0]["field"] == "peers"
