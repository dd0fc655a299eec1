"""Finding 11 (CSP part): dashboard pages had no Content-Security-Policy.

Against the real server: the login pages and, signed in, every dashboard page carry a policy that
admits scripts, styles and connections only from this origin (plus the live view's WebSocket to
this host), no plugins, no framing; and the HTML served holds no inline script it would block.
"""

from __future__ import annotations

import re

import pytest

from tests.security.loopback import Peer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REQUIRED = ["default-src 'self'", "script-src 'self'", "style-src 'self'", "object-src 'none'",
            "base-uri 'self'", "form-action 'self'", "frame-ancestors 'none'"]


def directives(answer) -> dict[str, str]:
    header = answer.headers.get("Content-Security-Policy")
    assert header, "no Content-Security-Policy"
    return {part.split()[0]: part for part in (p.strip() for p in header.split(";")) if part}


def test_every_page_carries_the_policy(cluster):
    from django.contrib.auth.models import Group, User

    from jobs.models import Job

    User.objects.create_user("vera", password="vera-password-1").groups.add(Group.objects.get(name="viewer"))
    job = Job.objects.create(name="csp", entrypoint="examples/train.py", created_by="test")
    browser = Peer(cluster.url)
    try:
        pages = [browser.request("GET", "/login/"), browser.request("GET", "/admin/login/")]
        assert browser.sign_in("/login/", "vera", "vera-password-1").status == 302
        pages += [browser.request("GET", path) for path in ("/", "/nodes/", f"/jobs/{job.pk}/")]
        host = cluster.url.removeprefix("http://")
        for page in pages:
            assert page.status == 200
            policy = directives(page)
            assert [policy[d.split()[0]] for d in REQUIRED] == REQUIRED
            assert policy["connect-src"] == f"connect-src 'self' ws://{host}"
            assert "unsafe-" not in page.headers["Content-Security-Policy"]
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page.text), "an inline script the policy blocks"
    finally:
        browser.close()
