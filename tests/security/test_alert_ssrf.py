"""Finding 7: SSRF through alert channels, against the real server (daphne + Celery + PostgreSQL).

An operator aims a channel at the control plane's own network — loopback (a socket this test
listens on), RFC 1918, the cloud metadata address, IPv6 loopback, a name resolving to loopback, a
decimal spelling of 127.0.0.1 — and is refused with a 400 naming ``url``. A channel already in the
database that points there (as a DNS change would make a saved one) is test-sent: the API answers
202 with the delivery record only, the worker refuses the destination at send time, and the
listening socket never sees a connection.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.e2e.cluster import api
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP socket on loopback that accepts nothing: any connection made to it waits in its
    backlog, where ``contacted`` finds it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def contacted(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_channels_cannot_reach_the_control_planes_network(cluster, tokens, listener):
    port = listener.getsockname()[1]
    for url in (f"http://127.0.0.1:{port}/hook", "http://10.0.0.1/hook", "http://169.254.169.254/latest/meta-data/",
                f"http://[::1]:{port}/hook", f"http://localhost:{port}/hook", f"http://2130706433:{port}/hook"):
        status, body = api(cluster, tokens["operator"], "POST", "/api/v1/alert-channels",
                           {"name": "probe", "kind": "webhook", "url": url, "secret": "s" * 20})
        assert status == 400, (url, body)
        assert [e["field"] for e in body["errors"]] == ["url"], (url, body)
    status, body = api(cluster, tokens["oncall"], "POST", "/api/v1/alert-channels",
                       {"name": "pd", "kind": "pagerduty", "url": f"http://127.0.0.1:{port}/v2/enqueue",
                        "secret": "R" * 20})
    assert status == 400 and body["errors"][0]["field"] == "url"
    status, body = api(cluster, tokens["operator"], "GET", "/api/v1/alert-channels")
    assert status == 200 and body["count"] == 0
    assert not contacted(listener)


def test_a_planted_channel_is_refused_at_send_and_nothing_of_the_target_comes_back(cluster, tokens, listener):
    from alerts.models import Channel

    port = listener.getsockname()[1]
    # No secret: the cluster derives its secrets key from its own SECRET_KEY, not this process's.
    planted = Channel.objects.create(name="planted", kind="webhook", url=f"http://127.0.0.1:{port}/hook")
    status, body = api(cluster, tokens["operator"], "POST", f"/api/v1/alert-channels/{planted.pk}/test")
    assert status == 202 and set(body) == {"delivery", "state"} and body["state"] == "pending"

    def outcome():
        _, channel = api(cluster, tokens["operator"], "GET", f"/api/v1/alert-channels/{planted.pk}")
        sends = [s for s in channel["test_sends"] if s["id"] == body["delivery"]]
        return sends and sends[0]["state"] != "pending" and (channel, sends[0])

    channel, test_send = wait_for(outcome, timeout=30, what="the worker to attempt the test-send")
    assert (test_send["state"], test_send["status_code"]) == ("failed", None)
    [error] = test_send["errors"]
    assert "RefusedDestination" in error and "127.0.0.1" not in error
    assert not contacted(listener)
    assert "secret" not in json.dumps(channel).replace("has_secret", "")
