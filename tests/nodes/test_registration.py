"""Registration: a one-time bootstrap token becomes a node and its own agent token."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from controlplane.models import ApiToken
from jobs.models import Event
from nodes.choices import Health, Transport
from nodes.models import GPU, Node
from tests.nodes.conftest import heartbeat, register_body

REGISTER = "/api/v1/agents/register"


@pytest.mark.django_db
def test_registration_creates_the_node_its_gpus_and_a_working_agent_token(cast, api):
    response = api().post(REGISTER, register_body(cast.tokens["bootstrap"]), format="json")
    assert response.status_code == 201, response.content
    answer = response.json()
    node = Node.objects.get(hostname="gpu-new-01")
    assert answer["node_id"] == str(node.pk)
    assert answer["heartbeat_interval_s"] == 5
    assert (node.address, node.transport, node.agent_version, node.labels) == ("10.0.0.9", Transport.AGENT, "0.1.0",
                                                                               {"rack": "r1"})
    assert node.heartbeat_deadline is not None and node.registered_at is not None
    assert node.health == Health.UNKNOWN  # waiting for its first telemetry
    assert list(GPU.objects.filter(node=node).values_list("index", "memory_total_mb")) == [(0, 81920), (1, 81920)]
    token = ApiToken.objects.get(node=node, revoked_at__isnull=True)
    assert token.scope == "agent" and answer["node_token"] not in (token.digest, token.prefix)
    event = Event.objects.get(kind="node.register", node=node)
    assert event.actor == "token:bootstrap" and "2 GPU(s)" in event.reason
    # The new token works for this node's endpoints.
    beat = api(answer["node_token"]).post(f"/api/v1/nodes/{node.pk}/heartbeat", heartbeat(node), format="json")
    assert beat.status_code == 200, beat.content


@pytest.mark.django_db
def test_a_bootstrap_token_registers_once(cast, api):
    body = register_body(cast.tokens["bootstrap"])
    assert api().post(REGISTER, body, format="json").status_code == 201
    again = api().post(REGISTER, register_body(cast.tokens["bootstrap"], hostname="gpu-new-02"), format="json")
    assert again.status_code == 401
    assert again["Content-Type"] == "application/problem+json"
    assert "already used" in again.json()["detail"]
    assert again["WWW-Authenticate"]
    assert not Node.objects.filter(hostname="gpu-new-02").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("token", "status"), [("nw_made-up", 401), ("operator", 403), ("agent", 403)])
def test_anything_but_a_live_bootstrap_token_is_refused_and_nothing_is_stored(cast, api, token, status):
    raw = cast.tokens.get(token, token)
    nodes, tokens = Node.objects.count(), ApiToken.objects.count()
    response = api().post(REGISTER, register_body(raw), format="json")
    assert response.status_code == status, response.content
    assert response.json()["status"] == status
    assert (Node.objects.count(), ApiToken.objects.count()) == (nodes, tokens)
    assert ApiToken.objects.get(name="bootstrap").revoked_at is None  # an unrelated failure does not burn it


@pytest.mark.django_db
def test_an_expired_bootstrap_token_is_refused(cast, api):
    from datetime import timedelta

    from django.utils import timezone

    _, raw = ApiToken.issue(name="old", scope="bootstrap", single_use=True,
                            expires_at=timezone.now() - timedelta(seconds=1))
    assert api().post(REGISTER, register_body(raw), format="json").status_code == 401


@pytest.mark.django_db
def test_a_malformed_registration_names_the_field_and_does_not_burn_the_token(cast, api):
    for gpu, field in [({"index": 99, "uuid": "x", "name": "x", "memory_total": 1}, "gpus.0.index"),
                       ({"index": 0, "uuid": "x", "name": "x", "memory_total": 2**60}, "gpus.0.memory_total")]:
        body = register_body(cast.tokens["bootstrap"], gpus=0)
        body["gpus"] = [gpu]
        response = api().post(REGISTER, body, format="json")
        assert response.status_code == 400
        assert response.json()["errors"][0]["field"] == field
    assert ApiToken.objects.get(name="bootstrap").revoked_at is None
    assert not Node.objects.filter(hostname="gpu-new-01").exists()


@pytest.mark.django_db
def test_re_registration_updates_the_node_and_revokes_its_old_agent_token(cast, api):
    old_token = cast.tokens["agent"]
    _, raw = ApiToken.issue(name="boot2", scope="bootstrap", single_use=True)
    response = api().post(REGISTER, register_body(raw, hostname="gpu-01", gpus=1, agent_version="0.2.0",
                                                  gpu_telemetry=False, gpu_telemetry_reason="NVML: driver not loaded"),
                          format="json")
    assert response.status_code == 201, response.content
    assert response.json()["node_id"] == str(cast.node1.pk)
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.agent_version, node.gpu_telemetry) == ("0.2.0", False)
    assert api(old_token).post(f"/api/v1/nodes/{node.pk}/heartbeat", heartbeat(node), format="json").status_code == 401


@pytest.mark.django_db(transaction=True)
def test_two_registrations_racing_with_one_token_only_one_wins(cast):
    from agents.protocol import parse
    from agents.protocol.agent import Register
    from nodes import services

    results = []

    def register(hostname):
        try:
            services.register_agent(parse(Register, register_body(cast.tokens["bootstrap"], hostname=hostname)))
            results.append("ok")
        except services.RegistrationRefused as exc:
            results.append(exc.status)
        finally:
            connection.close()

    threads = [threading.Thread(target=register, args=(f"race-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [401, "ok"]
    assert Node.objects.filter(hostname__startswith="race-").count() == 1
