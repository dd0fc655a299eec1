"""Registration: a one-time bootstrap token becomes a node and its own agent token."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import time_machine
from django.db import connection
from django.utils import timezone

from core.models import ApiToken, hash_token
from jobs.models import Event
from nodes import services
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
def test_a_retry_whose_answer_was_lost_gets_the_same_node_and_a_fresh_token(cast, api):
    """The agent timed out after the bootstrap token was used: its retry (same token, same attempt
    id) gets its node back, and the token in the lost answer stops working."""
    attempt = "0123456789abcdef" * 2
    body = register_body(cast.tokens["bootstrap"]) | {"attempt": attempt}
    lost = api().post(REGISTER, body, format="json").json()
    retried = api().post(REGISTER, body, format="json")
    assert retried.status_code == 201, retried.content
    answer = retried.json()
    assert answer["node_id"] == lost["node_id"] and answer["node_token"] != lost["node_token"]
    node = Node.objects.get(pk=answer["node_id"])
    assert api(lost["node_token"]).post(f"/api/v1/nodes/{node.pk}/heartbeat", heartbeat(node),
                                        format="json").status_code == 401
    assert api(answer["node_token"]).post(f"/api/v1/nodes/{node.pk}/heartbeat", heartbeat(node),
                                          format="json").status_code == 200
    assert "retried its registration" in Event.objects.filter(kind="node.register", node=node).last().reason
    assert Node.objects.filter(hostname="gpu-new-01").count() == 1


@pytest.mark.django_db
def test_a_used_bootstrap_token_without_its_attempt_id_stays_refused(cast, api):
    attempt = "0123456789abcdef" * 2
    body = register_body(cast.tokens["bootstrap"]) | {"attempt": attempt}
    assert api().post(REGISTER, body, format="json").status_code == 201
    without = {k: v for k, v in body.items() if k != "attempt"}
    for retry in (without, body | {"attempt": "f" * 32}, body | {"hostname": "gpu-new-02"}):
        assert api().post(REGISTER, retry, format="json").status_code == 401, retry
    with time_machine.travel(timezone.now() + services.fleet.RETRY_WINDOW + timedelta(seconds=1)):
        assert api().post(REGISTER, body, format="json").status_code == 401
    assert api().post(REGISTER, body | {"attempt": "not hex"}, format="json").status_code == 400


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
def test_re_registration_with_a_token_issued_for_the_node_replaces_its_agent(cast, api):
    old_token = cast.tokens["agent"]
    _, raw = services.issue_bootstrap_token(name="boot2", node=cast.node1, actor="user:otto", reason="re-imaged")
    response = api().post(REGISTER, register_body(raw, hostname="gpu-01", gpus=1, agent_version="0.2.0",
                                                  gpu_telemetry=False, gpu_telemetry_reason="NVML: driver not loaded"),
                          format="json")
    assert response.status_code == 201, response.content
    assert response.json()["node_id"] == str(cast.node1.pk)
    node = Node.objects.get(pk=cast.node1.pk)
    assert (node.agent_version, node.gpu_telemetry, node.address) == ("0.2.0", False, "10.0.0.9")
    assert api(old_token).post(f"/api/v1/nodes/{node.pk}/heartbeat", heartbeat(node), format="json").status_code == 401
    approval, registration = Event.objects.filter(node=node, kind__in=["node.bootstrap_token", "node.register"])
    assert (approval.kind, approval.actor) == ("node.bootstrap_token", "user:otto") and "re-imaged" in approval.reason
    assert registration.actor == "token:boot2" and registration.reason.startswith("re-registered")
    assert registration.evidence["previous"]["address"] == "10.0.0.1"


@pytest.mark.django_db
def test_a_generic_bootstrap_token_cannot_take_over_a_registered_node(cast, api):
    response = api().post(REGISTER, register_body(cast.tokens["bootstrap"], hostname="gpu-01", address="10.6.6.6"),
                          format="json")
    assert response.status_code == 403, response.content
    assert "operator must approve" in response.json()["detail"]
    assert "--node gpu-01" in response.json()["detail"]
    assert Node.objects.get(pk=cast.node1.pk).address == "10.0.0.1"
    assert ApiToken.objects.get(name="bootstrap").revoked_at is None  # a refusal does not burn the token
    assert not Event.objects.filter(kind="node.register").exists()
    beat = api(cast.tokens["agent"]).post(f"/api/v1/nodes/{cast.node1.pk}/heartbeat", heartbeat(cast.node1),
                                          format="json")
    assert beat.status_code == 200, beat.content


@pytest.mark.django_db
def test_a_token_bound_to_a_hostname_registers_only_that_host(cast, api):
    _, raw = services.issue_bootstrap_token(name="for-gpu-07", hostname="gpu-07", actor="user:otto")
    other = api().post(REGISTER, register_body(raw, hostname="gpu-08"), format="json")
    assert other.status_code == 403 and "only 'gpu-07'" in other.json()["detail"]
    assert not Node.objects.filter(hostname="gpu-08").exists()
    assert api().post(REGISTER, register_body(raw, hostname="gpu-07"), format="json").status_code == 201


@pytest.mark.django_db
def test_a_token_issued_for_a_node_registers_neither_another_node_nor_a_new_host(cast, api):
    _, raw = services.issue_bootstrap_token(name="for-gpu-01", node=cast.node1, actor="user:otto")
    for hostname in ("gpu-02", "gpu-new-01"):
        response = api().post(REGISTER, register_body(raw, hostname=hostname), format="json")
        assert response.status_code == 403, response.content
    assert Node.objects.get(pk=cast.node2.pk).address == "10.0.0.2"
    assert not Node.objects.filter(hostname="gpu-new-01").exists()


@pytest.mark.django_db
def test_bootstrap_tokens_expire_after_the_ttl_even_when_issued_without_an_expiry(cast, api, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "BOOTSTRAP_TOKEN_TTL_S": 3600}
    with time_machine.travel("2026-11-30 12:00:00Z", tick=False) as clock:
        issued, raw = services.issue_bootstrap_token(name="ttl", actor="user:otto")
        _, bare = ApiToken.issue(name="bare", scope="bootstrap", single_use=True)
        assert issued.expires_at == timezone.now() + timedelta(hours=1) and issued.single_use
        clock.shift(3601)
        response = api().post(REGISTER, register_body(raw), format="json")
        assert response.status_code == 401 and "expired" in response.json()["detail"]
        assert api().post(REGISTER, register_body(bare), format="json").status_code == 401
    assert not Node.objects.filter(hostname="gpu-new-01").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("address", ["10.0.0.9:29500", "gpu 01"])
def test_a_bad_address_is_a_400_naming_it_and_registers_nothing(cast, api, address):
    response = api().post(REGISTER, register_body(cast.tokens["bootstrap"], address=address), format="json")
    assert response.status_code == 400, response.content
    assert response.json()["errors"][0]["field"] == "address"
    assert not Node.objects.filter(hostname="gpu-new-01").exists()
    assert ApiToken.objects.get(name="bootstrap").revoked_at is None


@pytest.mark.django_db
def test_a_dns_name_is_a_good_address(cast, api):
    response = api().post(REGISTER, register_body(cast.tokens["bootstrap"], address="gpu-new-01.dc1.example.com"),
                          format="json")
    assert response.status_code == 201, response.content
    assert Node.objects.get(hostname="gpu-new-01").address == "gpu-new-01.dc1.example.com"


@pytest.mark.django_db
def test_an_operator_issues_a_re_registration_token_through_the_api_once_and_audited(cast, api):
    url = f"/api/v1/nodes/{cast.node1.pk}/bootstrap-token"
    assert api(cast.tokens["viewer"]).post(url, {"reason": "re-imaged"}, format="json").status_code == 403
    assert api(cast.tokens["operator"]).post(url, {}, format="json").json()["errors"][0]["field"] == "reason"
    response = api(cast.tokens["operator"]).post(url, {"reason": "re-imaged"}, format="json")
    assert response.status_code == 201, response.content
    answer = response.json()
    assert (answer["hostname"], answer["node"]) == ("gpu-01", cast.node1.pk) and answer["expires_at"]
    token = ApiToken.objects.get(name=answer["name"])
    assert (token.scope, token.node_id, token.digest) == ("bootstrap", cast.node1.pk, hash_token(answer["token"]))
    event = Event.objects.get(kind="node.bootstrap_token", node=cast.node1)
    assert event.actor == "token:operator(otto)" and answer["token"] not in str(event.evidence)
    registered = api().post(REGISTER, register_body(answer["token"], hostname="gpu-01"), format="json")
    assert registered.status_code == 201, registered.content


@pytest.mark.django_db(transaction=True)
def test_two_registrations_racing_with_one_token_only_one_wins(cast):
    from agents.protocol import parse
    from agents.protocol.agent import Register

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
