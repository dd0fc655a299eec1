"""The pages' Content-Security-Policy: every dashboard, login and admin page gets it, and no template
carries what it would block (inline script, event-handler attributes, inline styles)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIRS = [ROOT / "templates", ROOT / "dashboard" / "templates"]
DIRECTIVES = ["default-src 'self'", "script-src 'self'", "style-src 'self'", "object-src 'none'",
              "base-uri 'self'", "form-action 'self'", "frame-ancestors 'none'"]


def policy(response) -> dict[str, str]:
    header = response["Content-Security-Policy"]
    return {part.split()[0]: part for part in (p.strip() for p in header.split(";")) if part}


def assert_page_policy(response):
    directives = policy(response)
    for directive in DIRECTIVES:
        assert directives[directive.split()[0]] == directive, response["Content-Security-Policy"]
    # The live view's socket to this host, and nothing else.
    assert directives["connect-src"] == "connect-src 'self' ws://testserver"
    assert "unsafe" not in response["Content-Security-Policy"]


def test_every_page_carries_the_policy(signed_in, cast, client):
    viewer = signed_in(cast.viewer)
    for url in ("/", "/nodes/", f"/jobs/{cast.job.pk}/"):
        response = viewer.get(url)
        assert response.status_code == 200, url
        assert_page_policy(response)
    for url in ("/login/", "/admin/login/"):
        assert_page_policy(client.get(url))


def test_over_https_the_socket_is_wss(signed_in, cast):
    response = signed_in(cast.viewer).get("/", secure=True)
    assert policy(response)["connect-src"] == "connect-src 'self' wss://testserver"


def test_api_answers_keep_their_own_stricter_policy(api, cast):
    response = api(cast.tokens["viewer"]).get("/api/v1/jobs")
    assert response["Content-Security-Policy"].startswith("default-src 'none'")


def test_a_host_that_is_not_allowed_is_a_400_not_a_500(client):
    assert client.get("/login/", HTTP_HOST="evil.example").status_code == 400


def templates():
    return sorted(path for folder in TEMPLATE_DIRS for path in folder.rglob("*.html"))


@pytest.mark.parametrize("path", templates(), ids=lambda p: str(p.relative_to(ROOT)))
def test_templates_hold_nothing_the_policy_blocks(path):
    text = path.read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), "inline <script>: move it to a static file"
    assert not re.search(r"\son[a-z]+\s*=", text), "event-handler attribute: bind it in the static JavaScript"
    assert not re.search(r"<style|\sstyle\s*=", text), "inline style: use a class (or data-* set from JavaScript)"
