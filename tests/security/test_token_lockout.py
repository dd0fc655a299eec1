"""Finding 8: the bad-token lockout blocked valid tokens, per address, and behind the TLS proxy every
client shared the proxy's address. Anyone could lock out every agent and CI pipeline.

Against the real server: 1,000 bad tokens from one address, then a valid token still works and only
bad ones are refused (429); ``X-Forwarded-For`` from a peer that is not a trusted proxy changes
nothing, and through the trusted proxy each client has a counter of its own.
"""

from __future__ import annotations

import pytest

from tests.security.loopback import PROXY, TRUSTING_THE_PROXY, Peer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.parametrize("cluster", [TRUSTING_THE_PROXY], indirect=True, ids=["trusting-the-proxy"])]

JOBS = "/api/v1/jobs"
BAD = "nw_0000000000000000000000000000000000000000000"


def bearer(token: str, **extra: str) -> dict:
    return {"Authorization": f"Bearer {token}", **extra}


def test_a_valid_token_works_after_a_thousand_bad_ones(cluster):
    """One cluster for both halves: the untrusted peer's lockout, then clients behind the proxy."""
    from core.models import ApiToken

    _, viewer = ApiToken.issue(name="viewer", scope="viewer")
    _, ci = ApiToken.issue(name="ci", scope="ci")
    attacker, proxy = Peer(cluster.url), Peer(cluster.url, source=PROXY)
    try:
        one_address_floods_bad_tokens(attacker, viewer, ci, cluster.url)
        each_client_behind_the_proxy_counts_alone(proxy, viewer, cluster.url)
    finally:
        attacker.close()
        proxy.close()


def one_address_floods_bad_tokens(attacker: Peer, viewer: str, ci: str, url: str) -> None:
    answers = [attacker.request("GET", JOBS, headers=bearer(f"{BAD}{n}")).status for n in range(1000)]
    limit = answers.index(429)
    assert limit == 30 and set(answers[:limit]) == {401} and set(answers[limit:]) == {429}
    # The same address (as every client behind a shared proxy or NAT would be): right tokens work.
    assert attacker.request("GET", JOBS, headers=bearer(viewer)).status == 200
    assert Peer(url).request("GET", JOBS, headers=bearer(ci)).status == 200
    assert attacker.request("GET", JOBS, headers=bearer(BAD)).status == 429
    # An untrusted peer cannot escape its counter by naming another address.
    assert attacker.request("GET", JOBS, headers=bearer(BAD, **{"X-Forwarded-For": "198.51.100.7"})).status == 429


def each_client_behind_the_proxy_counts_alone(proxy: Peer, viewer: str, url: str) -> None:
    def get(token: str, client: str) -> int:
        return proxy.request("GET", JOBS, headers=bearer(token, **{"X-Forwarded-For": client})).status

    assert [get(BAD, "203.0.113.66") for _ in range(40)] == [401] * 30 + [429] * 10
    # The proxy appends the peer it saw: what the client wrote to the left is not believed.
    assert get(BAD, "203.0.113.10, 203.0.113.66") == 429
    assert get(BAD, "203.0.113.66, 203.0.113.10") == 401  # another client through the same proxy
    assert get(viewer, "203.0.113.66") == 200
    # The proxy's own address was never counted against.
    assert Peer(url, source=PROXY).request("GET", JOBS, headers=bearer(BAD)).status == 401
