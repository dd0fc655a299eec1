"""Who may call what: every core API endpoint × every kind of caller."""

from __future__ import annotations

import pytest

CALLERS = ["anonymous", "viewer", "operator", "oncall", "ci", "agent", "bootstrap"]


def endpoints(cast):
    job, node = cast.job.pk, cast.node1.pk
    launch = {"name": "run", "entrypoint": "train.py"}
    return [
        # method, path, body, callers allowed
        ("get", "/api/v1/jobs", None, {"viewer", "operator", "oncall", "ci"}),
        ("post", "/api/v1/jobs", launch, {"operator", "oncall", "ci"}),
        ("get", f"/api/v1/jobs/{job}", None, {"viewer", "operator", "oncall", "ci"}),
        ("get", f"/api/v1/jobs/{job}/events", None, {"viewer", "operator", "oncall", "ci"}),
        ("post", f"/api/v1/jobs/{job}/cancel", {"reason": "r"}, {"operator", "oncall"}),
        ("get", "/api/v1/nodes", None, {"viewer", "operator", "oncall", "ci"}),
        ("get", f"/api/v1/nodes/{node}", None, {"viewer", "operator", "oncall", "ci"}),
        ("get", "/api/v1/checkpoints", None, {"viewer", "operator", "oncall", "ci"}),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("caller", CALLERS)
def test_access_matrix(cast, api, caller):
    from jobs.models import Job

    for method, path, body, allowed in endpoints(cast):
        # A fresh job for each mutating call, so an earlier allowed cancel doesn't turn into a 409.
        if path.endswith("/cancel"):
            job = Job.objects.create(name="victim", entrypoint="t.py", created_by="t")
            path = f"/api/v1/jobs/{job.pk}/cancel"
        client = api(None if caller == "anonymous" else cast.tokens[caller])
        response = getattr(client, method)(path, body, format="json")
        if caller in allowed:
            assert response.status_code in (200, 201), (caller, method, path, response.content)
        else:
            expected = 401 if caller == "anonymous" else 403
            assert response.status_code == expected, (caller, method, path, response.status_code)
            assert response["Content-Type"] == "application/problem+json"
            assert response.json()["status"] == expected


@pytest.mark.django_db
def test_session_users_get_their_role(cast, client):
    client.force_login(cast.viewer)
    assert client.get("/api/v1/jobs").status_code == 200
    assert client.post("/api/v1/jobs", {"name": "x", "entrypoint": "t.py"},
                       content_type="application/json").status_code == 403
    client.force_login(cast.operator)
    assert client.post("/api/v1/jobs", {"name": "x", "entrypoint": "t.py"},
                       content_type="application/json").status_code == 201


@pytest.mark.django_db
def test_a_token_never_outranks_its_owner(cast, api):
    """An operator-scope token owned by a viewer grants only what the viewer may do."""
    from core.models import ApiToken

    _, raw = ApiToken.issue(name="overreach", scope="oncall", user=cast.viewer)
    response = api(raw).post("/api/v1/jobs", {"name": "x", "entrypoint": "t.py"}, format="json")
    assert response.status_code == 403
    assert api(raw).get("/api/v1/jobs").status_code == 200


@pytest.mark.django_db
def test_tokens_are_hashed_at_rest_and_revocable(cast, api):
    from core.models import ApiToken

    raw = cast.tokens["viewer"]
    token = ApiToken.objects.get(name="viewer")
    assert raw not in (token.digest, token.prefix) and len(token.digest) == 64
    assert not ApiToken.objects.filter(digest=raw).exists()
    token.revoke()
    response = api(raw).get("/api/v1/jobs")
    assert response.status_code == 401
    assert "revoked" in response.json()["detail"]


@pytest.mark.django_db
def test_malformed_authorization_header(cast, api):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer two parts")
    response = client.get("/api/v1/jobs")
    assert response.status_code == 401
    assert "Malformed" in response.json()["detail"]
    assert api("nw_not-a-real-token").get("/api/v1/jobs").status_code == 401


@pytest.mark.django_db
def test_health_probes_need_no_credentials(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.content
    assert ready.json()["checks"] == {"database": "ok", "migrations": "ok", "broker": "ok"}


@pytest.mark.django_db
def test_openapi_schema_and_docs_are_served(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    body = schema.json()
    assert "/api/v1/jobs" in body["paths"]
    assert "bearerToken" in body["components"]["securitySchemes"]
    assert client.get("/api/docs/").status_code == 200
