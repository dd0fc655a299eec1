"""The hardened boundary: rate limits, body-size limits, problem details for every error, security
headers, and tokens that are shown once, stored hashed and rotatable (by command and by API)."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_rate_limits():
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()


def assert_problem(response, status: int):
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == status and body["type"].startswith("https://nightwatch.dev/problems/")
    return body


def test_no_free_database_connection_is_a_503_to_retry_later_not_a_server_error(settings):
    """A web process's pool (``DB_POOL_MAX_SIZE``) empty for its whole timeout is overload: refused as
    admission control refuses, with ``Retry-After``. Any other database error is still a 500."""
    from types import SimpleNamespace

    from django.db import OperationalError, connection

    from core.problems import exception_handler
    from tests.api.overloaded_urls import pool_exhausted

    context = {"request": SimpleNamespace(path="/api/v1/nodes/7/commands/wait")}
    response = exception_handler(pool_exhausted(), context)
    assert response.status_code == 503 and response["Retry-After"] == str(settings.NIGHTWATCH["RETRY_AFTER_S"])
    assert response.data["type"].endswith("/overloaded") and "retry after" in response.data["detail"]
    assert response.data["instance"] == "/api/v1/nodes/7/commands/wait"
    with pytest.raises(OperationalError) as other, connection.wrap_database_errors:
        import psycopg

        raise psycopg.OperationalError("server closed the connection unexpectedly")
    assert exception_handler(other.value, context).status_code == 500


@pytest.mark.urls("tests.api.overloaded_urls")
def test_a_page_or_a_plain_django_view_without_a_database_connection_is_a_503_too(client, settings):
    """Outside DRF's handler (a dashboard page, a middleware's query) Django's own 500 handler sees
    the exception: the same overload is a 503 with ``Retry-After`` there, as a page or as problem
    details, not Django's "Server Error (500)"."""
    client.raise_request_exception = False
    page = client.get("/jobs/")
    assert page.status_code == 503 and page["Retry-After"] == str(settings.NIGHTWATCH["RETRY_AFTER_S"])
    assert page["Content-Type"].startswith("text/html") and b"Nightwatch is busy" in page.content
    assert b"retry after" in page.content
    api = client.get("/api/v1/jobs")
    body = assert_problem(api, 503)
    assert body["type"].endswith("/overloaded") and api["Retry-After"] == page["Retry-After"]


def test_repeated_authentication_failures_throttle_bad_tokens_only(cast, api, settings):
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "AUTH_FAILURES_PER_MINUTE": 3}
    for _ in range(3):
        assert_problem(api("nw_guess-guess-guess").get("/api/v1/jobs"), 401)
    locked = assert_problem(api("nw_guess-guess-guess").get("/api/v1/jobs"), 429)
    assert "Too many failed authentications" in locked["detail"]
    assert int(api("nw_guess").get("/api/v1/jobs")["Retry-After"]) > 0
    # A right token from the same address still works: behind a shared proxy, a stranger's bad
    # tokens must never lock out agents and CI; the next bad one is still refused.
    assert api(cast.tokens["viewer"]).get("/api/v1/jobs").status_code == 200
    assert_problem(api("nw_guess-guess-guess").get("/api/v1/jobs"), 429)


def test_agent_endpoints_are_rate_limited_per_node(cast, api, monkeypatch):
    from core.auth import AgentThrottle

    monkeypatch.setattr(AgentThrottle, "THROTTLE_RATES", {"agent": "2/min"})
    agent = api(cast.tokens["agent"])
    path = f"/api/v1/nodes/{cast.node1.pk}/heartbeat"
    assert agent.post(path, {}, format="json").status_code == 400  # an empty heartbeat: refused, but counted
    assert agent.post(path, {}, format="json").status_code == 400
    assert_problem(agent.post(path, {}, format="json"), 429)
    # Another node's agent has its own allowance.
    assert api(cast.tokens["agent2"]).post(f"/api/v1/nodes/{cast.node2.pk}/heartbeat", {},
                                           format="json").status_code == 400


def test_bodies_over_the_limit_are_refused_before_parsing(cast, api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    big = {"name": "x", "entrypoint": "t.py", "args": ["a" * 2000]}
    body = assert_problem(api(cast.tokens["operator"]).post("/api/v1/jobs", big, format="json"), 413)
    assert "at most 1000" in body["detail"]
    from jobs.models import Job

    assert not Job.objects.filter(name="x").exists()


@pytest.mark.parametrize("request_kind", ["unknown route", "wrong method", "not json", "malformed json",
                                          "bad filter", "no such job", "NUL in a filter", "NUL idempotency key",
                                          "unknown host", "lone surrogate"])
def test_every_error_is_problem_details(cast, api, request_kind):
    client = api(cast.tokens["operator"])
    response = {
        "unknown route": lambda: client.get("/api/v1/no-such-thing"),
        "wrong method": lambda: client.delete("/api/v1/jobs"),
        "not json": lambda: client.post("/api/v1/jobs", "name=x", content_type="application/x-www-form-urlencoded"),
        "malformed json": lambda: client.post("/api/v1/jobs", "{nope", content_type="application/json"),
        "bad filter": lambda: client.get("/api/v1/incidents?kind=crash,meteor"),
        "no such job": lambda: client.get("/api/v1/jobs/999999/status"),
        # found by schemathesis: PostgreSQL text cannot hold NUL, which used to surface as a 500
        "NUL in a filter": lambda: client.get("/api/v1/jobs?name=a%00b"),
        "NUL idempotency key": lambda: client.post("/api/v1/jobs", {"name": "x", "entrypoint": "t.py"},
                                                   format="json", HTTP_IDEMPOTENCY_KEY="a\x00b"),
        "unknown host": lambda: client.get("/api/v1/jobs", HTTP_HOST="evil.example"),
        # found by schemathesis: valid JSON, but no text; PostgreSQL refused it on save (a 500)
        "lone surrogate": lambda: client.post(f"/api/v1/jobs/{cast.job.pk}/cancel", '{"reason": "ok \\udb8e"}',
                                              content_type="application/json"),
    }[request_kind]()
    status = {"unknown host": 400, "lone surrogate": 400, "unknown route": 404, "wrong method": 405, "not json": 415,
              "malformed json": 400,
              "bad filter": 400, "no such job": 404, "NUL in a filter": 400, "NUL idempotency key": 422}[request_kind]
    body = assert_problem(response, status)
    if request_kind == "lone surrogate":
        assert "reason holds a lone surrogate" in body["detail"]
        cast.job.refresh_from_db()
        assert cast.job.state != "cancelled"
    if request_kind == "bad filter":
        assert body["errors"] == [{"field": "kind", "reason": body["errors"][0]["reason"]}]
        assert "'meteor'" in body["errors"][0]["reason"]


def test_api_responses_carry_security_headers(cast, api):
    response = api(cast.tokens["viewer"]).get("/api/v1/jobs")
    assert response["Content-Security-Policy"].startswith("default-src 'none'")
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"
    assert response["X-Frame-Options"] == "DENY"
    assert response["Cache-Control"] == "no-store"


@pytest.mark.parametrize("scope", ["ci", "agent"])
def test_rotate_by_command_keeps_scope_and_owner_and_shows_the_new_token_once(cast, api, scope):
    from core.models import ApiToken, hash_token

    old_raw = cast.tokens[scope]
    out = io.StringIO()
    call_command("nightwatch_token", "rotate", "--name", scope, stdout=out)
    new_raw = out.getvalue().strip()
    assert new_raw.startswith("nw_") and new_raw != old_raw
    new = ApiToken.objects.get(digest=hash_token(new_raw))
    assert (new.scope, new.user_id, new.node_id) == (scope, *{"ci": (cast.ci_user.pk, None),
                                                             "agent": (None, cast.node1.pk)}[scope])
    assert not ApiToken.objects.filter(digest=new_raw).exists()
    assert_problem(api(old_raw).get(f"/api/v1/nodes/{cast.node1.pk}"), 401)
    listing = io.StringIO()
    call_command("nightwatch_token", "list", stdout=listing)
    assert new_raw not in listing.getvalue()


def test_a_token_rotates_itself_over_the_api(cast, api):
    from core.models import ApiToken

    response = api(cast.tokens["agent"]).post("/api/v1/tokens/rotate")
    assert response.status_code == 201, response.content
    new_raw = response.json()["token"]
    assert response.json()["scope"] == "agent"
    assert_problem(api(cast.tokens["agent"]).post("/api/v1/tokens/rotate"), 401)
    assert api(new_raw).post(f"/api/v1/nodes/{cast.node1.pk}/heartbeat", {}, format="json").status_code == 400
    assert ApiToken.objects.filter(name="agent", revoked_at__isnull=True).count() == 1
    from jobs.models import Event

    audit = Event.objects.get(kind="token.rotate")
    assert (audit.actor, audit.node_id) == ("node:gpu-01", cast.node1.pk) and new_raw not in str(audit.evidence)
    assert_problem(api(cast.tokens["bootstrap"]).post("/api/v1/tokens/rotate"), 403)
