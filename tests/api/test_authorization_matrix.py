"""Every API endpoint × every kind of caller → only the intended grants.

The endpoints are read from the URL resolver, not listed by hand: an endpoint nobody classified
in ``GRANTS`` fails ``test_every_api_endpoint_is_classified`` with a message saying where to add
it. Each (route, method) names the capability it needs; ``HOLDERS`` says which callers hold it.
A caller is granted when the answer is anything but 401/403 (a 400 for an empty body, a 404, a
409 all mean the request got past authorisation); refused callers get 401 (anonymous) or 403,
as problem details.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

pytestmark = pytest.mark.django_db

CALLERS = ["anonymous", "viewer", "operator", "oncall", "ci", "agent", "other_node", "bootstrap"]
PEOPLE_VIEW = {"viewer", "operator", "oncall", "ci"}
HOLDERS = {
    "public": set(CALLERS),
    "view": PEOPLE_VIEW,
    "launch": {"operator", "oncall", "ci"},
    "operate": {"operator", "oncall"},
    "drain": {"operator", "oncall"},
    "approve": {"oncall"},
    # the agent token of node-1 (which runs the job); "other_node" is node-2's agent token
    "agent": {"agent"},
    # a token rotating itself: any bearer token but a one-time bootstrap one
    "token": {"viewer", "operator", "oncall", "ci", "agent", "other_node"},
}

#: (route, method) -> capability. Routes as the resolver spells them.
GRANTS = {
    ("api/schema/", "GET"): "public",
    ("api/docs/", "GET"): "public",
    ("api/redoc/", "GET"): "public",
    ("metrics", "GET"): "view",
    ("api/v1/tokens/rotate", "POST"): "token",
    # jobs
    ("api/v1/jobs", "GET"): "view",
    ("api/v1/jobs", "POST"): "launch",
    ("api/v1/jobs/<int:pk>", "GET"): "view",
    ("api/v1/jobs/<int:pk>/status", "GET"): "view",
    ("api/v1/jobs/<int:pk>/events", "GET"): "view",
    ("api/v1/jobs/<int:pk>/cancel", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/pause", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/checkpoint", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/approve", "POST"): "approve",
    ("api/v1/jobs/<int:pk>/rollback", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/resize", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/logs", "GET"): "view",
    ("api/v1/nodes/<int:node_id>/logs", "POST"): "agent",
    ("api/v1/jobs/<int:pk>/incidents", "GET"): "view",
    ("api/v1/jobs/<int:pk>/goodput", "GET"): "view",
    ("api/v1/jobs/<int:pk>/generations", "GET"): "view",
    ("api/v1/jobs/<int:pk>/reports", "POST"): "agent",
    ("api/v1/jobs/<int:pk>/control", "GET"): "agent",
    ("api/v1/incidents", "GET"): "view",
    ("api/v1/incidents/<int:pk>", "GET"): "view",
    # nodes
    ("api/v1/nodes", "GET"): "view",
    ("api/v1/gpus", "GET"): "view",
    ("api/v1/nodes/<int:pk>", "GET"): "view",
    ("api/v1/nodes/<int:pk>/drain", "POST"): "drain",
    ("api/v1/nodes/<int:pk>/undrain", "POST"): "drain",
    ("api/v1/nodes/<int:pk>/clear-lemon", "POST"): "drain",
    ("api/v1/nodes/<int:pk>/commands", "GET"): "view",
    ("api/v1/nodes/<int:pk>/health-check", "POST"): "drain",
    ("api/v1/nodes/<int:pk>/bootstrap-token", "POST"): "drain",
    ("api/v1/agents/register", "POST"): "public",  # the body's one-time bootstrap token decides
    ("api/v1/nodes/<int:node_id>/heartbeat", "POST"): "agent",
    ("api/v1/nodes/<int:node_id>/telemetry", "POST"): "agent",
    ("api/v1/nodes/<int:node_id>/events", "POST"): "agent",
    ("api/v1/nodes/<int:node_id>/commands/<int:command_id>/ack", "POST"): "agent",
    ("api/v1/nodes/<int:node_id>/commands/wait", "GET"): "agent",
    # checkpoints
    ("api/v1/checkpoints", "GET"): "view",
    ("api/v1/checkpoints/<int:pk>", "GET"): "view",
    ("api/v1/checkpoints/<int:pk>", "DELETE"): "operate",
    ("api/v1/checkpoints/<int:pk>/lineage", "GET"): "view",
    ("api/v1/checkpoints/<int:pk>/verify", "POST"): "operate",
    ("api/v1/checkpoints/<int:pk>/pin", "POST"): "operate",
    ("api/v1/checkpoints/<int:pk>/unpin", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/checkpoints", "GET"): "view",
    ("api/v1/jobs/<int:pk>/checkpoints", "POST"): "agent",
    ("api/v1/jobs/<int:pk>/checkpoints/tree", "GET"): "view",
    ("api/v1/jobs/<int:pk>/checkpoints/retention", "GET"): "view",
    ("api/v1/jobs/<int:pk>/checkpoints/interval", "GET"): "view",
    # alerts (issue 10)
    ("api/v1/alert-channels", "GET"): "operate",
    ("api/v1/alert-channels", "POST"): "operate",
    ("api/v1/alert-channels/<int:pk>", "GET"): "operate",
    ("api/v1/alert-channels/<int:pk>", "PATCH"): "operate",
    ("api/v1/alert-channels/<int:pk>", "DELETE"): "operate",
    ("api/v1/alert-channels/<int:pk>/test", "POST"): "operate",
    ("api/v1/jobs/<int:pk>/alerts", "GET"): "view",
    ("api/v1/jobs/<int:pk>/efficiency", "GET"): "view",
    ("api/v1/jobs/<int:pk>/efficiency/target", "GET"): "view",
    ("api/v1/jobs/<int:pk>/efficiency/target", "PUT"): "operate",
}


def _walk(patterns, prefix=""):
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _walk(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry.callback


def _methods(callback) -> list[str]:
    view_class = getattr(callback, "view_class", None) or getattr(callback, "cls", None)
    if view_class is None:
        return ["GET"]  # a function view (/metrics answers GET only)
    return sorted(m.upper() for m in view_class.http_method_names
                  if m not in ("options", "head", "trace") and hasattr(view_class, m))


def api_endpoints() -> list[tuple[str, str]]:
    """Every (route, method) the resolver serves under /api/, plus /metrics."""
    found = []
    for route, callback in _walk(get_resolver().url_patterns):
        if route.startswith("api/") or route == "metrics":
            found += [(route, method) for method in _methods(callback)]
    return sorted(set(found))


def test_every_api_endpoint_is_classified():
    unclassified = [f"{method} /{route}" for route, method in api_endpoints() if (route, method) not in GRANTS]
    assert not unclassified, (
        "These endpoints have no entry in GRANTS (tests/api/test_authorization_matrix.py): add each with the "
        "capability it needs, so the matrix checks who may call it:\n  " + "\n  ".join(unclassified))
    stale = sorted(set(GRANTS) - set(api_endpoints()))
    assert not stale, f"GRANTS lists endpoints that no longer exist: {stale}"


def _concrete(route: str, world) -> str:
    cast = world.cast
    path = "/" + route
    if "<int:node_id>" in route:
        path = path.replace("<int:node_id>", str(cast.node1.pk)).replace("<int:command_id>", str(world.command.pk))
    owner = {"api/v1/jobs/": world.paused_job.pk if route.endswith(("approve", "rollback")) else cast.job.pk,
             "api/v1/nodes/": cast.node1.pk, "api/v1/checkpoints/": world.checkpoint.pk,
             "api/v1/incidents/": world.incident.pk, "api/v1/alert-channels/": 1}
    for prefix, pk in owner.items():
        if route.startswith(prefix):
            return path.replace("<int:pk>", str(pk))
    return path


@pytest.fixture
def matrix_world(world):
    from django.utils import timezone

    from nodes.models import NodeCommand

    world.command = NodeCommand.objects.create(node=world.cast.node1, kind="stop", payload={}, created_by="test",
                                               idempotency_key="matrix-stop",
                                               expires_at=timezone.now() + timedelta(hours=1))
    return world


@pytest.fixture(autouse=True)
def _fresh_rate_limits():
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()


@pytest.mark.parametrize("caller", CALLERS)
def test_only_the_intended_callers_are_granted(matrix_world, api, caller):
    tokens = {**matrix_world.cast.tokens, "other_node": matrix_world.cast.tokens["agent2"]}
    client = api(None if caller == "anonymous" else tokens[caller])
    wrong = []
    # Rotation revokes the caller's token, so it goes last.
    for route, method in sorted(api_endpoints(), key=lambda e: e[0] == "api/v1/tokens/rotate"):
        path = _concrete(route, matrix_world)
        response = client.generic(method, path, b"{}", content_type="application/json")
        granted = caller in HOLDERS[GRANTS[(route, method)]]
        if granted and response.status_code in (401, 403):
            wrong.append(f"{method} {path}: {caller} should be granted, got {response.status_code} "
                         f"{response.content[:200]!r}")
        elif not granted:
            expected = 401 if caller == "anonymous" else 403
            if response.status_code != expected:
                wrong.append(f"{method} {path}: {caller} should get {expected}, got {response.status_code}")
            elif response["Content-Type"] != "application/problem+json":
                wrong.append(f"{method} {path}: refusal is not problem details ({response['Content-Type']})")
    assert not wrong, "\n".join(wrong)
