"""``core.auth.client_address``: the one answer to "who is calling from where" behind which
every per-address limit sits (failed tokens, registration, login lockouts). ``X-Forwarded-For`` counts
only from a configured trusted proxy, read from the right."""

from __future__ import annotations

import pytest
from django.test import RequestFactory

from core.auth import client_address

PROXY = "10.0.0.5"


@pytest.fixture
def trusting(settings):
    def configure(*cidrs: str):
        settings.NIGHTWATCH = {**settings.NIGHTWATCH, "TRUSTED_PROXIES": list(cidrs)}

    return configure


def request_from(peer: str, forwarded: str | None = None):
    headers = {"REMOTE_ADDR": peer}
    if forwarded is not None:
        headers["HTTP_X_FORWARDED_FOR"] = forwarded
    return RequestFactory().get("/api/v1/jobs", **headers)


def test_without_trusted_proxies_the_header_is_ignored(trusting):
    trusting()
    assert client_address(request_from("198.51.100.7", "203.0.113.1")) == "198.51.100.7"


def test_a_peer_that_is_not_a_trusted_proxy_cannot_choose_its_address(trusting):
    trusting(f"{PROXY}/32")
    assert client_address(request_from("198.51.100.7", "203.0.113.1")) == "198.51.100.7"


@pytest.mark.parametrize(("forwarded", "client"), [
    ("203.0.113.9", "203.0.113.9"),
    # The client wrote the left part itself: only what the trusted proxies appended counts.
    ("1.2.3.4, 203.0.113.9", "203.0.113.9"),
    ("1.2.3.4, 203.0.113.9, 10.0.0.7", "203.0.113.9"),  # through two trusted proxies
    ("1.2.3.4,203.0.113.9", "203.0.113.9"),
    ("2001:db8::1", "2001:db8::1"),
    ("2001:DB8:0::1", "2001:db8::1"),  # normalised: one client, one counter
])
def test_behind_a_trusted_proxy_the_right_most_untrusted_address_is_the_client(trusting, forwarded, client):
    trusting("10.0.0.0/8")
    assert client_address(request_from(PROXY, forwarded)) == client


@pytest.mark.parametrize(("forwarded", "client"), [
    (None, PROXY),  # the proxy's own probe
    ("", PROXY),
    ("not-an-address", PROXY),
    ("203.0.113.9, unknown", PROXY),  # what a proxy appended is garbage: the client cannot choose
    ("unknown, 10.0.0.7", "10.0.0.7"),
    ("10.0.0.8, 10.0.0.7", "10.0.0.8"),  # only trusted hops: the farthest of them
])
def test_garbage_or_only_trusted_hops_end_at_the_nearest_trusted_hop(trusting, forwarded, client):
    trusting("10.0.0.0/8")
    assert client_address(request_from(PROXY, forwarded)) == client


def test_bad_tokens_behind_the_proxy_throttle_their_client_only(cast, trusting, settings):
    from django.core.cache import cache
    from rest_framework.test import APIClient

    cache.clear()
    trusting(f"{PROXY}/32")
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "AUTH_FAILURES_PER_MINUTE": 2}

    def get(token: str, client: str) -> int:
        api = APIClient(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR=client)
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        return api.get("/api/v1/jobs").status_code

    assert [get("nw_guess", "203.0.113.66") for _ in range(3)] == [401, 401, 429]
    assert get("nw_guess", "203.0.113.10") == 401  # another client through the same proxy
    assert get(cast.tokens["viewer"], "203.0.113.66") == 200
    cache.clear()


def test_registration_is_throttled_per_client_behind_the_proxy(trusting):
    from core.auth import RegisterThrottle

    trusting(f"{PROXY}/32")
    keys = {RegisterThrottle().get_cache_key(request_from(PROXY, client), None)
            for client in ("203.0.113.1", "203.0.113.2")}
    assert len(keys) == 2 and all("203.0.113." in key for key in keys)


def test_a_bad_trusted_proxy_entry_is_a_configuration_error(trusting):
    from controlplane.checks import trusted_proxy_settings

    trusting("10.0.0.0/8", "10.0.0.300/32")
    errors = trusted_proxy_settings()
    assert [e.id for e in errors] == ["nightwatch.E004"] and "10.0.0.300/32" in errors[0].msg
    trusting("10.0.0.0/8", "fd00::/64")
    assert trusted_proxy_settings() == []
