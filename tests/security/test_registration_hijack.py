"""Finding 4 (and the address of finding 11): a bootstrap token took over an existing node by
registering with its hostname. The real node's tokens were revoked, its address replaced, and the
next launch commands went to the impostor. Bootstrap tokens were bound to no host and never expired;
a registered address was not validated (a bad one left every job placed there pending).

Against the real server, with a real agent registered as gpu-01: a second, generic bootstrap token
cannot register gpu-01 (403, the agent keeps its token and its address); expired and used tokens are
401; a token bound to gpu-02 cannot register gpu-03; a bad address is a 400 that creates no node.
Only a token an operator issued for gpu-01 re-registers it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest

from tests.e2e.cluster import api, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REGISTER = "/api/v1/agents/register"


def register(cluster, token: str, hostname: str, address: str = "10.6.6.6") -> tuple[int, dict]:
    """What an impostor sends: a registration, as the agent would, with no other credential."""
    body = {"bootstrap_token": token, "hostname": hostname, "address": address, "agent_version": "6.6.6",
            "gpus": [{"index": 0, "uuid": f"GPU-{hostname}-evil", "name": "NVIDIA H100", "memory_total": 2**36}]}
    request = urllib.request.Request(f"{cluster.url}{REGISTER}", data=json.dumps(body).encode(), method="POST",  # noqa: S310
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_a_bootstrap_token_cannot_take_over_a_registered_node(cluster, tokens):
    from nodes.models import Node

    first_token = tokens["bootstrap"]()
    cluster.start_agent("gpu-01", bootstrap_token=first_token)
    stored_at = cluster.tmp / "agents" / "gpu-01" / "node-token.json"
    wait_for(stored_at.exists, timeout=60, what="the real agent of gpu-01 to register and store its token")
    node = Node.objects.get(hostname="gpu-01")
    stored = json.loads(stored_at.read_text())["node_token"]

    a_generic_token_is_refused(cluster, tokens, node, stored)
    dead_tokens_are_401(cluster, used=first_token)
    a_bound_token_registers_only_its_host(cluster)
    a_bad_address_registers_nothing(cluster, tokens)
    the_operator_approved_token_replaces_the_agent(cluster, tokens, node, stored)


def a_generic_token_is_refused(cluster, tokens, node, stored: str) -> None:
    from core.models import ApiToken, hash_token
    from jobs.models import Event
    from nodes.models import Node

    attacker = tokens["bootstrap"]()
    status, answer = register(cluster, attacker, "gpu-01")
    assert status == 403, answer
    assert "operator must approve" in answer["detail"] and "--node gpu-01" in answer["detail"]
    assert Node.objects.get(pk=node.pk).address == "127.0.0.1"
    assert Event.objects.filter(kind="node.register", node=node).count() == 1
    assert ApiToken.objects.usable().filter(digest=hash_token(stored)).exists()
    # The real agent still speaks for gpu-01: its next heartbeats are accepted.
    attacked_at = Node.objects.get(pk=node.pk).last_heartbeat_at
    wait_for(lambda: Node.objects.get(pk=node.pk).last_heartbeat_at > attacked_at, timeout=15,
             what="the real agent's next heartbeat, with its own token, after the attack")
    status, _ = api(cluster, stored, "POST", f"/api/v1/nodes/{node.pk}/heartbeat",
                    {"node_id": str(node.pk), "seq": 1, "time": time.time()})
    assert status == 200


def dead_tokens_are_401(cluster, *, used: str) -> None:
    from django.utils import timezone

    from core.models import ApiToken
    from nodes.models import Node

    _, expired = ApiToken.issue(name="expired", scope="bootstrap", single_use=True,
                                expires_at=timezone.now() - timedelta(seconds=1))
    # Issued without an expiry (before bootstrap tokens expired): it lives BOOTSTRAP_TOKEN_TTL_S (24 h).
    stale, old = ApiToken.issue(name="old", scope="bootstrap", single_use=True)
    ApiToken.objects.filter(pk=stale.pk).update(created_at=timezone.now() - timedelta(hours=25))
    for token in (expired, old, used):
        status, answer = register(cluster, token, "gpu-05")
        assert status == 401, answer
        assert answer["detail"] == "Unknown, expired or already used bootstrap token."
    assert not Node.objects.filter(hostname="gpu-05").exists()


def a_bound_token_registers_only_its_host(cluster) -> None:
    from nodes import services
    from nodes.models import Node

    _, bound = services.issue_bootstrap_token(name="for-gpu-02", hostname="gpu-02", actor="user:otto")
    status, answer = register(cluster, bound, "gpu-03")
    assert status == 403 and "only 'gpu-02'" in answer["detail"], answer
    assert not Node.objects.filter(hostname="gpu-03").exists()
    assert register(cluster, bound, "gpu-02", address="10.0.0.2")[0] == 201


def a_bad_address_registers_nothing(cluster, tokens) -> None:
    from nodes.models import Node

    token = tokens["bootstrap"]()
    for address in ("10.0.0.4:29500", "http://gpu-04", "gpu-04; reboot", ""):
        status, answer = register(cluster, token, "gpu-04", address=address)
        assert status == 400, answer
        assert [e["field"] for e in answer["errors"]] == ["address"]
    assert not Node.objects.filter(hostname="gpu-04").exists()
    assert register(cluster, token, "gpu-04", address="gpu-04.dc1.example.com")[0] == 201  # not used up


def the_operator_approved_token_replaces_the_agent(cluster, tokens, node, stored: str) -> None:
    from jobs.models import Event
    from nodes.models import Node

    status, issued = api(cluster, tokens["operator"], "POST", f"/api/v1/nodes/{node.pk}/bootstrap-token",
                         {"reason": "re-imaged"})
    assert status == 201, issued
    status, answer = register(cluster, issued["token"], "gpu-01", address="127.0.0.1")
    assert status == 201 and answer["node_id"] == str(node.pk), answer
    assert Node.objects.get(pk=node.pk).agent_version == "6.6.6"
    assert api(cluster, stored, "POST", f"/api/v1/nodes/{node.pk}/heartbeat",
               {"node_id": str(node.pk), "seq": 2, "time": time.time()})[0] == 401
    assert [e.actor for e in Event.objects.filter(node=node, kind="node.bootstrap_token")] == ["token:ops(otto)"]
    assert register(cluster, issued["token"], "gpu-01", address="127.0.0.1")[0] == 401  # once only
